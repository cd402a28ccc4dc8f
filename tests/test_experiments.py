"""`normlab compare` end to end at tiny size on a corpus made here: every preset writes a complete
section whose verdicts follow from its numbers by their rules (and flip when the numbers do), the
report renders, a second run redoes nothing, and an interrupted run resumes from its checkpoint."""

import base64
import copy
import dataclasses
import html
import json
import math
import random
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from normlab import claims as C
from normlab import data as D
from normlab import experiments as E
from normlab import report
from normlab.cli import main
from normlab.experiments import common as common_module
from normlab.experiments import design as DS
from normlab.experiments import lab as lab_module
from normlab.experiments import precision as precision_module
from normlab.experiments import timing as timing_module

pytestmark = pytest.mark.slow(minutes=2)  # minutes cold on 2 cores (conftest.py)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("NORMLAB_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def finished(corpus, env, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    settings = E.Settings(out=str(out), size="tiny", data=str(corpus), quiet=True)
    results = E.run_presets(["all"], settings, command="normlab compare all --size tiny")
    return out, results


def test_every_preset_writes_a_complete_section(finished):
    out, results = finished
    saved = json.loads((out / "results.json").read_text())
    assert list(saved["presets"]) == list(E.PRESETS)
    for name, section in saved["presets"].items():
        for key in ("title", "question", "settings", "columns", "rows", "claims", "series", "notes"):
            assert key in section, (name, key)
        assert section["rows"], name
        for row in section["rows"]:
            assert set(section["columns"]) <= set(row), name
        assert section["claims"], name
        for c in section["claims"]:
            assert c["verdict"] in C.VERDICTS
            assert c["source"] and c["rule_text"] and c["claim"]
            assert set(c["measured"]) >= _keys(c["rule"]), (name, c["id"])
    assert saved["meta"]["command"] == "normlab compare all --size tiny"
    assert saved["meta"]["torch"] and saved["meta"]["processor"]


def test_sections_record_what_their_runs_and_timings_were_measured_under(finished):
    clocks = finished[1]["presets"]["norms"]["clocks"]
    # every run here: one condition
    assert [c["threads"] for c in clocks["runs"]] == [torch.get_num_threads()]
    assert clocks["timings"] and clocks["timings"][0]["processor"] == clocks["runs"][0]["processor"]
    # exact: nothing timed or trained
    assert finished[1]["presets"]["eps"]["clocks"] == {"runs": [], "timings": []}


def _keys(rule) -> set:
    if rule["kind"] in ("all", "any"):
        return set().union(*(_keys(r) for r in rule["rules"]))
    if rule["kind"] == "given":
        return _keys(rule["if"]) | _keys(rule["then"])
    return {v for v in (rule["a"], rule["b"]) if isinstance(v, str)}


def test_verdicts_follow_from_the_numbers(finished):
    _, results = finished
    assert E.recheck(results) == []
    # and a recorded verdict that does not follow is caught
    broken = copy.deepcopy(results)
    c = broken["presets"]["norms"]["claims"][0]
    c["verdict"] = next(v for v in C.VERDICTS if v != c["verdict"])
    assert E.recheck(broken) == ["norms: norms.rms_quality"]


def _claim(results, cid):
    return next(c for s in results["presets"].values() for c in s["claims"] if c["id"] == cid)


def _seeds(mean, spread=0.005):
    return [mean - spread, mean, mean + spread]


@pytest.mark.parametrize("cid, holds, fails", [
    ("norms.rms_quality", {"rmsnorm_val": _seeds(2.0), "layernorm_val": _seeds(2.01)},
     {"rmsnorm_val": _seeds(2.5), "layernorm_val": _seeds(2.0)}),
    ("norms.rms_speed", {"rmsnorm_step_ms": [8.0, 9.6, 12.0], "layernorm_step_ms": [10.0, 12.0, 15.0]},
     {"rmsnorm_step_ms": [10.5, 12.5, 15.5], "layernorm_step_ms": [10.0, 12.0, 15.0]}),
    ("norms.none_worse", {"none_val": _seeds(3.0), "layernorm_val": _seeds(2.0), "none_diverged": 0},
     {"none_val": _seeds(2.0), "layernorm_val": _seeds(2.1), "none_diverged": 0}),
    ("warmup.post_sensitive",
     {"post_nowarm_sensitivity": _seeds(1.2, 0.05), "post_warm_sensitivity": _seeds(0.5, 0.05)},
     {"post_nowarm_sensitivity": _seeds(0.4, 0.01), "post_warm_sensitivity": _seeds(0.5, 0.01)}),
    ("warmup.pre_not",
     {"pre_nowarm_sensitivity": [0.495, 0.5, 0.51], "pre_warm_sensitivity": _seeds(0.5, 0.01)},
     {"pre_nowarm_sensitivity": _seeds(0.9, 0.01), "pre_warm_sensitivity": _seeds(0.5, 0.01)}),
    ("warmup.post_lower_lr", {"post_warm_best_log10_lr": [-3.0] * 6, "pre_warm_best_log10_lr": [-2.0] * 6},
     {"post_warm_best_log10_lr": [-2.0] * 6, "pre_warm_best_log10_lr": [-3.0] * 6}),
    ("warmup.qk_norm_logits",
     {"pre_warm_qknorm_max_logit_top_lr": _seeds(5.0, 0.1), "pre_warm_max_logit_top_lr": _seeds(40.0, 1.0)},
     {"pre_warm_qknorm_max_logit_top_lr": _seeds(40.0, 0.1), "pre_warm_max_logit_top_lr": _seeds(30.0, 0.1)}),
    ("warmup.qk_norm_sensitivity",
     {"pre_warm_qknorm_sensitivity": _seeds(0.3, 0.01), "pre_warm_sensitivity": _seeds(0.5, 0.01)},
     {"pre_warm_qknorm_sensitivity": _seeds(0.6, 0.01), "pre_warm_sensitivity": _seeds(0.5, 0.01)}),
    ("warmup.embed_norm_stable",
     {"pre_warm_embednorm_diverged_high": [0] * 9, "pre_warm_diverged_high": [1] * 6 + [0] * 3},
     {"pre_warm_embednorm_diverged_high": [1] * 6 + [0] * 3, "pre_warm_diverged_high": [0] * 9}),
    ("warmup.embed_norm_quality",
     {"pre_warm_embednorm_best_val": _seeds(2.0), "pre_warm_best_val": _seeds(2.005), "unigram_loss": 3.4},
     {"pre_warm_embednorm_best_val": _seeds(2.2), "pre_warm_best_val": _seeds(2.0), "unigram_loss": 3.4}),
    ("warmup.sandwich_unstable",
     {"pre_warm_sandwich_diverged": [1] * 6 + [0] * 12, "pre_warm_diverged": [0] * 18},
     {"pre_warm_sandwich_diverged": [0] * 18, "pre_warm_diverged": [0] * 12 + [1] * 6}),
    ("gradients.post_grows", {"xiong_post_growth": _seeds(3.0, 0.2)},
     {"xiong_post_growth": _seeds(0.8, 0.05)}),
    ("gradients.pre_flat.llama", {"llama_pre_growth": _seeds(1.1, 0.05)},
     {"llama_pre_growth": _seeds(0.25, 0.02)}),
    ("gradients.post_last_constant", {"xiong_post_last_slope": _seeds(0.02, 0.03)},
     {"xiong_post_last_slope": _seeds(-0.5, 0.03)}),
    ("gradients.pre_last_scaling", {"xiong_pre_last_slope": _seeds(-0.48, 0.03)},
     {"xiong_pre_last_slope": _seeds(0.0, 0.03)}),
    ("depth.deepnorm_trains",
     {"deepnorm_val": _seeds(2.0), "pre_val": _seeds(1.95), "deepnorm_diverged": 0, "unigram_loss": 3.4},
     {"deepnorm_val": [None] * 3, "pre_val": _seeds(1.95), "deepnorm_diverged": 3, "unigram_loss": 3.4}),
    ("depth.deepnorm_article_trains",
     {"deepnorm_article_val": _seeds(2.0), "pre_val": _seeds(1.95), "deepnorm_article_diverged": 0,
      "unigram_loss": 3.4},
     {"deepnorm_article_val": _seeds(2.0), "pre_val": _seeds(1.95), "deepnorm_article_diverged": 1,
      "unigram_loss": 3.4}),
    ("depth.post_fails",
     {"post_val": [None] * 3, "pre_val": _seeds(1.95), "post_diverged": 3, "unigram_loss": 3.4},
     {"post_val": _seeds(1.95), "pre_val": _seeds(2.0), "post_diverged": 0, "unigram_loss": 3.4}),
    ("batchnorm.gap_grows",
     {"batchnorm_gap_b2": _seeds(0.05, 0.002), "batchnorm_gap_b32": _seeds(0.01, 0.002)},
     {"batchnorm_gap_b2": _seeds(0.005, 0.0001), "batchnorm_gap_b32": _seeds(0.01, 0.0001)}),
    ("batchnorm.small_batch_worse",
     {"batchnorm_excess_b2": _seeds(0.08, 0.002), "batchnorm_excess_b32": _seeds(0.02, 0.002)},
     {"batchnorm_excess_b2": _seeds(0.01, 0.001), "batchnorm_excess_b32": _seeds(0.03, 0.001)}),
    ("batchnorm.accumulation_worse",
     {"batchnorm_excess_accum": _seeds(0.08, 0.002), "batchnorm_excess_b32": _seeds(0.02, 0.002),
      "layernorm_val_accum": _seeds(2.0), "layernorm_val_b32": _seeds(2.0), "unigram_loss": 3.4},
     {"batchnorm_excess_accum": _seeds(0.01, 0.001), "batchnorm_excess_b32": _seeds(0.03, 0.001),
      "layernorm_val_accum": _seeds(2.0), "layernorm_val_b32": _seeds(2.0), "unigram_loss": 3.4}),
    ("batchnorm.worse_than_layernorm", {"batchnorm_val": _seeds(2.1), "layernorm_val": _seeds(2.0)},
     {"batchnorm_val": _seeds(2.02), "layernorm_val": _seeds(2.0)}),
    ("batchnorm.late_positions_noisier", {"late_position_tokens": 400.0, "early_position_tokens": 800.0,
                                          "late_position_spread": [0.09, 0.093, 0.088, 0.095],
                                          "early_position_spread": [0.07, 0.071, 0.0695, 0.072]},
     {"late_position_tokens": 400.0, "early_position_tokens": 800.0,
      "late_position_spread": [0.05, 0.052, 0.049, 0.051],
      "early_position_spread": [0.07, 0.071, 0.0695, 0.072]}),
    ("batchnorm.position_unseen_refused", {"position_unseen_refused": 1}, {"position_unseen_refused": 0}),
    ("curse.pre_deep_weaker",
     {"pre_deep_share": [0.30, 0.33, 0.31], "pre_val": _seeds(2.0), "unigram_loss": 3.4},
     {"pre_deep_share": [0.60, 0.62, 0.61], "pre_val": _seeds(2.0), "unigram_loss": 3.4}),
    ("curse.post_deep_not_weaker",
     {"post_deep_share": [0.55, 0.56, 0.54], "post_val": _seeds(2.0), "unigram_loss": 3.4},
     {"post_deep_share": [0.30, 0.31, 0.29], "post_val": _seeds(2.0), "unigram_loss": 3.4}),
    ("curse.lns_deeper",
     {"lns_deep_share": [0.45, 0.47, 0.46], "pre_deep_share": [0.30, 0.33, 0.31], "pre_val": _seeds(2.0),
      "unigram_loss": 3.4},
     {"lns_deep_share": [0.20, 0.23, 0.21], "pre_deep_share": [0.30, 0.33, 0.31], "pre_val": _seeds(2.0),
      "unigram_loss": 3.4}),
    ("curse.lns_loss", {"lns_val": _seeds(1.9), "pre_val": _seeds(2.0), "unigram_loss": 3.4},
     {"lns_val": _seeds(2.1), "pre_val": _seeds(2.0), "unigram_loss": 3.4}),
    ("precision.naive_bf16_worse", {"rms_norm_bf16_naive_median_eps": _seeds(0.5, 0.01),
                                    "rms_norm_bf16_normlab_median_eps": _seeds(0.2, 0.01),
                                    "layer_norm_bf16_naive_median_eps": _seeds(0.6, 0.01),
                                    "layer_norm_bf16_normlab_median_eps": _seeds(0.2, 0.01)},
     {"rms_norm_bf16_naive_median_eps": _seeds(0.2, 0.01),
      "rms_norm_bf16_normlab_median_eps": _seeds(0.3, 0.01)}),
    ("speed.bytes_not_flops",
     {"normlab_layer_norm_total_ms": [1.0, 1.05, 1.1], "normlab_rms_norm_total_ms": [0.95, 1.0, 1.05]},
     {"normlab_layer_norm_total_ms": [1.6, 1.68, 1.76], "normlab_rms_norm_total_ms": [1.0, 1.05, 1.1]}),
    ("speed.gru_step",
     {"gru_rmsnorm_step_ms": [80.0, 85.0, 90.0], "gru_layernorm_step_ms": [100.0, 106.0, 112.0]},
     {"gru_rmsnorm_step_ms": [101.0, 107.0, 113.0], "gru_layernorm_step_ms": [100.0, 106.0, 112.0]}),
    ("speed.rms_kernel_normlab",
     {"normlab_rms_norm_total_ms": [0.8, 0.85, 0.9], "normlab_layer_norm_total_ms": [1.0, 1.05, 1.1]},
     {"normlab_rms_norm_total_ms": [1.1, 1.15, 1.2], "normlab_layer_norm_total_ms": [1.0, 1.05, 1.1]}),
    ("eps.inside_bounded", {"inside_max_gain_sqrt_eps": 1.0}, {"inside_max_gain_sqrt_eps": 1.5}),
    ("eps.outside_amplifies", {"outside_zero_row_gain_eps": 1.0}, {"outside_zero_row_gain_eps": 1e-3}),
    ("eps.fused_matches", {"inside_normlab_gain_rel_err": 1e-7, "outside_normlab_gain_rel_err": 1e-7},
     {"inside_normlab_gain_rel_err": 1e-7, "outside_normlab_gain_rel_err": 0.5}),
    ("invariance.layernorm_exact", {"layernorm_invariant_max_change": 1e-15},
     {"layernorm_invariant_max_change": 0.5}),
    ("invariance.rmsnorm_scale", {"rmsnorm_invariant_max_change": 1e-15},
     {"rmsnorm_invariant_max_change": 0.5}),
    ("invariance.rmsnorm_not_recentering", {"rmsnorm_recentering_min_change": 0.5},
     {"rmsnorm_recentering_min_change": 1e-14}),
    ("invariance.layernorm_shift_trained",
     {"layernorm_shift0.1_val": _seeds(2.0), "layernorm_shift0.5_val": _seeds(2.002),
      "layernorm_val": _seeds(2.001), "unigram_loss": 3.4},
     {"layernorm_shift0.1_val": _seeds(2.0), "layernorm_shift0.5_val": _seeds(2.5),
      "layernorm_val": _seeds(2.0),
      "unigram_loss": 3.4}),
    ("invariance.rmsnorm_shift_trained",
     {"rmsnorm_shift0.5_val": _seeds(2.3), "rmsnorm_val": _seeds(2.0), "unigram_loss": 3.4},
     {"rmsnorm_shift0.5_val": _seeds(1.9), "rmsnorm_val": _seeds(2.0), "unigram_loss": 3.4}),
    ("batchnorm.accumulation",
     {"layernorm_accumulation_change": 1e-16, "batchnorm_accumulation_change": 0.08},
     {"layernorm_accumulation_change": 1e-16, "batchnorm_accumulation_change": 1e-15}),
    ("invariance.rmsnorm_sphere", {"rmsnorm_sphere": 1e-16}, {"rmsnorm_sphere": 0.01}),
    ("invariance.layernorm_train_eval", {"layernorm_train_eval": 0.0, "batchnorm_train_eval": 0.9},
     {"layernorm_train_eval": 0.2, "batchnorm_train_eval": 0.9}),
    ("stability.layernorm_grows", {"layernorm_gain_over_bound": 1.0, "layernorm_gain_growth": 316.0},
     {"layernorm_gain_over_bound": 1.0, "layernorm_gain_growth": 3.0}),
    ("stability.rmsnorm_bounded", {"rmsnorm_gain_times_mean": 1.0}, {"rmsnorm_gain_times_mean": 300.0}),
    ("stability.bf16_within_bound", {"bf16_out_of_bound": 0}, {"bf16_out_of_bound": 2}),
    ("final_norm.loss", {"nofinal_base_val": _seeds(2.2), "final_base_val": _seeds(2.0), "unigram_loss": 3.4},
     {"nofinal_base_val": _seeds(1.9), "final_base_val": _seeds(2.0), "unigram_loss": 3.4}),
    ("final_norm.head_grows", {"nofinal_base_head_growth": _seeds(5.0, 0.1)},
     {"nofinal_base_head_growth": _seeds(0.8, 0.01)}),
    ("final_norm.high_lr",
     {"nofinal_high_val": [None] * 3, "final_high_val": _seeds(2.0), "nofinal_high_diverged": 3,
      "unigram_loss": 3.4},
     {"nofinal_high_val": _seeds(1.9), "final_high_val": _seeds(2.0), "nofinal_high_diverged": 0,
      "unigram_loss": 3.4}),
    ("shallow.post_better",
     {"post_shallow_val": _seeds(1.9), "pre_shallow_val": _seeds(2.0), "unigram_loss": 3.4},
     {"post_shallow_val": _seeds(2.1), "pre_shallow_val": _seeds(2.0), "unigram_loss": 3.4}),
    ("shallow.pre_deep",
     {"post_deep_val": [None] * 3, "pre_deep_val": _seeds(2.0), "post_deep_diverged": 3, "unigram_loss": 3.4},
     {"post_deep_val": _seeds(1.9), "pre_deep_val": _seeds(2.0), "post_deep_diverged": 0,
      "unigram_loss": 3.4}),
    ("sandwich.stream_growth",
     {"sandwich_stream_growth": _seeds(1.2, 0.01), "pre_stream_growth": _seeds(3.0, 0.1)},
     {"sandwich_stream_growth": _seeds(3.0, 0.1), "pre_stream_growth": _seeds(1.2, 0.01)}),
    ("sandwich.quality", {"sandwich_val": _seeds(2.0), "pre_val": _seeds(2.01), "unigram_loss": 3.4},
     {"sandwich_val": _seeds(2.5), "pre_val": _seeds(2.0), "unigram_loss": 3.4}),
    ("dyt.parity", {"dyt0.5_large_val": _seeds(2.0), "rmsnorm_large_val": _seeds(2.01)},
     {"dyt0.5_large_val": _seeds(2.5), "rmsnorm_large_val": _seeds(2.0)}),
    ("dyt.alpha0_sensitive",
     {"dyt_worst_alpha0_large_val": _seeds(2.3), "dyt_best_alpha0_large_val": _seeds(2.0)},
     {"dyt_worst_alpha0_large_val": _seeds(1.9), "dyt_best_alpha0_large_val": _seeds(2.0)}),
    ("dyt.regime_flips",
     {"dyt0.5_small_val": _seeds(2.8), "layernorm_small_val": _seeds(3.0), "dyt0.5_large_val": _seeds(2.2),
      "layernorm_large_val": _seeds(2.0)},
     {"dyt0.5_small_val": _seeds(3.2), "layernorm_small_val": _seeds(3.0), "dyt0.5_large_val": _seeds(2.2),
      "layernorm_large_val": _seeds(2.0)}),
])

def test_changing_the_numbers_flips_the_verdict(finished, cid, holds, fails):
    c = _claim(finished[1], cid)
    # the "trains" preconditions met (tiny runs learn nothing), unless the case sets them itself
    base = {**c["measured"], **{k: v for k, v in TRAINED.items() if k in c["measured"]}}
    assert C.judge(c["rule"], {**base, **holds}) == "holds"
    assert C.judge(c["rule"], {**base, **fails}) == "does not hold"


TRAINED = {"unigram_loss": 3.4, "post_warm_best_val": _seeds(2.0), "pre_warm_best_val": _seeds(2.0),
           "layernorm_val": _seeds(2.0), "rmsnorm_val": _seeds(2.0), "rmsnorm_large_val": _seeds(2.0),
           "layernorm_small_val": _seeds(3.0), "layernorm_large_val": _seeds(2.0),
           "dyt_best_alpha0_large_val": _seeds(2.0),
           "layernorm_val_b2": _seeds(2.0), "layernorm_val_b32": _seeds(2.0)}



def test_the_warmup_divergence_claims_count_seed_and_rate_pairs(finished):
    # their sign tests run over one outcome per seed and rate, and said "of 15 seeds" for 5 seeds
    section = finished[1]["presets"]["warmup"]
    seeds, rates = len(section["settings"]["seeds"]), len(section["settings"]["lrs"])
    for cid, n in (("warmup.embed_norm_stable", seeds * (rates - rates // 2)),
                   ("warmup.sandwich_unstable", seeds * rates)):
        c = _claim(finished[1], cid)
        assert f" of {n} (seed, rate) pairs above 0" in " ".join(c["evidence"])
        assert "[exact sign test over (seed, rate) pairs]" in c["rule_text"]


def test_eps_claims_hold_exactly_and_the_fused_kernels_agree(finished):
    # exact math, no training: at any size each claim must hold, and a zero row's gain outside the
    # root must be 1/eps where inside it is 1/sqrt(eps)
    section = finished[1]["presets"]["eps"]
    assert all(c["verdict"] == "holds" for c in section["claims"]), [c["evidence"] for c in section["claims"]]
    zero = {r["eps"]: r for r in section["rows"] if r["row_rms"] == 0}
    assert zero["inside"]["gain"] == pytest.approx(1e3) and zero["outside"]["gain"] == pytest.approx(1e6)
    assert zero["outside"]["gain_normlab_fp32"] == pytest.approx(1e6, rel=1e-4)


def test_the_exact_facts_of_stability_and_invariance_hold_at_any_size(finished):
    # LayerNorm's gain follows 1/sqrt(s^2 + eps) up to its cap, RMSNorm's stays at or below 1/|mean|
    for name, ids in (("stability", None),
                      ("invariance", ("invariance.rmsnorm_sphere", "invariance.layernorm_train_eval")),
                      ("batchnorm", ("batchnorm.accumulation",))):
        claims = [c for c in finished[1]["presets"][name]["claims"] if ids is None or c["id"] in ids]
        assert claims and all(c["verdict"] == "holds" for c in claims), [c["evidence"] for c in claims]
    rows = finished[1]["presets"]["stability"]["rows"]
    assert rows[0]["layernorm_gain"] < 1.01 and rows[-1]["layernorm_gain"] == pytest.approx(
        1e-5**-0.5, rel=1e-3
    )
    assert max(r["rmsnorm_gain"] for r in rows) <= 1.0 + 1e-9


def test_the_bf16_stability_check_catches_statistics_kept_in_bf16(monkeypatch):
    # the check must be able to fail: a LayerNorm whose one-pass variance is computed in bf16
    # loses the small spreads' rows to cancellation
    from normlab.experiments import stability

    real = stability._call

    def naive(norm, x, backend):
        if backend != "cpu" or norm != "layernorm":
            return real(norm, x, backend)
        var = (x * x).mean(-1, keepdim=True) - x.mean(-1, keepdim=True) ** 2  # in bf16, E[x^2] - E[x]^2
        return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(var.clamp_min(0) + stability.EPS)

    assert stability.bf16_misses("layernorm", 64, 4, seed=61, backend="cpu") == []
    monkeypatch.setattr(stability, "_call", naive)
    assert stability.bf16_misses("layernorm", 64, 4, seed=61, backend="cpu")


def test_the_stability_sweep_records_its_settings_and_measures(finished):
    section = finished[1]["presets"]["warmup"]
    assert section["settings"]["beta2"] == 0.98 and section["settings"]["grad_clip"] == 0
    run = json.loads(next((finished[0] / "runs").glob("post-nowarm-lr*-s0-*/config.json")).read_text())
    assert run["train"]["beta2"] == 0.98 and run["train"]["grad_clip"] == 0 and run["train"]["warmup"] == 0
    assert run["model_resolved"]["norm"] == "layernorm" and run["model_resolved"]["mlp"] == "relu"
    lrs = section["settings"]["lrs"]
    assert math.log10(max(lrs) / min(lrs)) >= 1.5
    m = {k: v for c in section["claims"] for k, v in c["measured"].items()}
    for key in ("post_warm", "post_nowarm", "pre_warm", "pre_nowarm", "pre_warm_qknorm"):
        assert all(math.isfinite(v) and v >= 0
                   for v in m.get(f"{key}_sensitivity", [])) and m.get(f"{key}_sensitivity")
    assert all(v > 0 for v in m["pre_warm_max_logit_top_lr"] + m["pre_warm_qknorm_max_logit_top_lr"])
    assert set(section["series"]["curves"]) == set(E.SWEEP)
    embed = json.loads(
        next((finished[0] / "runs").glob("pre-warm-embednorm-lr*-s0-*/config.json")).read_text()
    )
    assert embed["model_resolved"]["embed_norm"] is True and run["model_resolved"]["embed_norm"] is False
    high = sorted(lrs)[len(lrs) // 2:]
    assert len(m["pre_warm_embednorm_diverged_high"]) == len(high) * len(section["settings"]["seeds"])
    assert all(v is None or math.isfinite(v)
               for v in m["pre_warm_embednorm_best_val"]) and m["pre_warm_embednorm_best_val"]
    sandwich = json.loads(
        next((finished[0] / "runs").glob("pre-warm-sandwich-lr*-s0-*/config.json")).read_text()
    )
    assert sandwich["model_resolved"]["placement"] == "sandwich" and sandwich["train"]["warmup"] > 0
    # the exact counts: one 0/1 per (rate, seed), summing to the table's diverged column at each rate
    n = len(section["settings"]["seeds"])
    per_rate = [sum(m["pre_warm_sandwich_diverged"][j * n:(j + 1) * n]) for j in range(len(lrs))]
    assert per_rate == [r["diverged"] for r in section["rows"] if r["setting"] == "pre|warm|sandwich"]


def test_lr_sensitivity_follows_wortsman():
    want = (2.0 + 2.5 + 4.0 + 4.0) / 4 - 2.0
    assert E.lr_sensitivity([2.0, 2.5, None, 5.0], init=4.0) == pytest.approx(want)
    assert E.lr_sensitivity([2.0, 2.0], init=4.0) == 0
    assert E.lr_sensitivity([2.0, 2.5], init=None) is None  # a run from before the loss at init was logged


def test_one_seed_leaves_quality_claims_inconclusive_and_says_why(finished):
    _, results = finished  # tiny size: one seed
    for cid in ("norms.rms_quality", "norms.prms_quality", "invariance.layernorm_shift_trained"):
        c = _claim(results, cid)
        assert c["verdict"] == "inconclusive", cid
        assert any("gives no interval" in line for line in c["evidence"]), cid


def test_every_threshold_has_an_origin(finished):
    def leaves(rule):
        if rule["kind"] in ("all", "any"):
            return [x for r in rule["rules"] for x in leaves(r)]
        if rule["kind"] == "given":
            return leaves(rule["if"]) + leaves(rule["then"])
        return [rule]

    for section in finished[1]["presets"].values():
        for c in section["claims"]:
            for leaf in leaves(c["rule"]):
                if leaf.get("rel") or not isinstance(leaf["b"], str):
                    assert leaf["origin"]["by"] in ("source",
                                                    "normlab") and leaf["origin"]["text"], (c["id"], leaf)
            assert c["origins"] or all(not (leaf.get("rel") or not isinstance(leaf["b"], str))
                                       for leaf in leaves(c["rule"]))
    speed = _claim(finished[1], "norms.rms_speed")
    assert speed["origins"][0].endswith("from the source ('reduces the running time by 7%~64% on different "
                                        "models' (abstract))")


def test_every_curve_starts_at_step_zero_on_both_axes(finished):
    """The loss at initialization is each curve's first point, at 0 s; the time axis then adds
    each step's own time (test_train checks that no compilation is in it)."""
    for norm, curves in finished[1]["presets"]["norms"]["series"]["runs"].items():
        for c in curves:
            v = c["val_curve"]
            assert v["step"][0] == 0 and v["time_s"][0] == 0, norm
            assert v["time_s"] == sorted(v["time_s"]) and v["time_s"][1] > 0, norm


def test_batchnorm_depends_on_batch_mates_and_layernorm_does_not(finished):
    rows = {r["norm"]: r for r in finished[1]["presets"]["batchnorm"]["rows"] if r["batching"] == "windows"}
    assert rows["batchnorm"]["mates_change"] > 1e-3 and rows["batchnorm"]["padding_change"] > 1e-3
    assert rows["layernorm"]["mates_change"] <= 1e-5 and rows["rmsnorm"]["padding_change"] <= 1e-5


def test_batchnorm_trend_trains_on_padded_batches_of_each_size(finished):
    section = finished[1]["presets"]["batchnorm"]
    trend = [r for r in section["rows"] if r["batching"] == "paragraphs"]
    assert {(r["norm"], r["batch_size"]) for r in trend} == {(n, b) for n in ("batchnorm", "layernorm")
                                                             for b in E.BATCH_SIZES}
    for r in trend:
        assert r["val_loss"] is not None and r["train_eval_gap"] is not None
        if r["norm"] == "layernorm":
            assert r["train_eval_gap"] == 0  # no dropout, no batch statistics
    run = json.loads(next((finished[0] / "runs").glob("pad-batchnorm-b2-s0-*/config.json")).read_text())
    assert run["train"]["batching"] == "paragraphs" and run["train"]["batch_size"] == 2
    # the batch of 32 again by accumulation: 8 micro-batches of 4, at the true batch's rate
    accum = [r for r in section["rows"] if r["batching"] == "paragraphs, 8 x 4 accumulated"]
    assert [(r["norm"], r["batch_size"]) for r in accum] == [("batchnorm", 32), ("layernorm", 32)]
    for norm in ("batchnorm", "layernorm"):
        run = json.loads(next((finished[0] / "runs").glob(f"pad-{norm}-b4x8-s0-*/config.json")).read_text())[
            "train"
        ]
        true = json.loads(next((finished[0] / "runs").glob(f"pad-{norm}-b32-s0-*/config.json")).read_text())[
            "train"
        ]
        assert (run["batch_size"], run["grad_accum"], run["lr"]) == (4, 8, true["lr"])
    m = _claim(finished[1], "batchnorm.accumulation_worse")["measured"]
    assert len(m["batchnorm_excess_accum"]) == len(section["settings"]["trend"]["seeds"])
    # per-position statistics: fewer tokens at the last positions of padded paragraphs, a refusal past them
    m = _claim(finished[1], "batchnorm.late_positions_noisier")["measured"]
    assert m["late_position_tokens"] <= m["early_position_tokens"]  # this corpus's paragraphs fill the window
    assert len(m["late_position_spread"]) == len(m["early_position_spread"]) == 32
    assert _claim(finished[1], "batchnorm.position_unseen_refused")["verdict"] == "holds"


def test_claims_of_presets_with_two_model_kinds_name_their_own_runs_size(finished):
    # a ladder's trend places such a claim at its runs' size (the preset's median is the other kind's)
    out, results = finished

    def size(pattern):
        sizes = [json.loads((r / "summary.json").read_text())["parameters_no_embedding"]
                 for r in (out / "runs").glob(pattern)]
        assert sizes, pattern
        return statistics.median(sizes)

    claims = {c["id"]: c for s in results["presets"].values() for c in s["claims"]}
    depths = results["presets"]["shallow"]["settings"]["depths"]
    norms, padded = size("[blr]*norm-s*"), size("pad-*")
    want = {"batchnorm.worse_than_layernorm": norms, "batchnorm.mates": norms,
            "batchnorm.small_batch_worse": padded, "batchnorm.gap_grows": padded,
            "shallow.post_better": size(f"p*-L{depths[0]}-s*"),
            "shallow.pre_deep": size(f"p*-L{depths[1]}-s*")}
    assert want["shallow.post_better"] != want["shallow.pre_deep"]  # (at tiny size batchnorm's kinds are one)
    assert {k: claims[k].get("parameters") for k in want} == want


def test_batchnorm_trend_validates_every_batch_size_on_the_same_paragraphs(corpus, tmp_path):
    # the excess losses the trend compares across batch sizes must come from the same text: at
    # eval_batches batches of the run's own size, batch 2 was validated on 1/16 of batch 32's paragraphs
    from normlab import data as D
    from normlab import train as T

    pending = E.plan_presets(["batchnorm"], E.Settings(out=str(tmp_path), size="tiny", data=str(corpus)))
    texts = {}
    for run in pending:
        if run.label.startswith("pad-") and run.label.endswith("-s0"):
            tcfg, _ = T.resolve(None, dict(a.split("=", 1) for a in run.argv if "=" in a))
            dataset = D.prepare(tcfg.data, tcfg.tokenizer, tcfg.bpe_vocab, tcfg.val_fraction)
            batches = T._fixed_batches(dataset.val, tcfg, tcfg.seq_len, dataset.tokenizer)
            texts[run.label] = [tuple(x[i][m[i]].tolist()) for x, _, m in batches for i in range(len(x))]
    assert {label.split("-")[2] for label in texts} == {"b2", "b8", "b32", "b4x8"}
    first = next(iter(texts.values()))
    assert len(first) >= E.BATCH_SIZES[-1] and all(t == first for t in texts.values())


def test_per_position_statistics_count_the_real_tokens_of_padded_paragraphs():
    from normlab.experiments.batchnorm import position_statistics

    rng = random.Random(torch.seed())
    tokens = []
    for _ in range(60):  # paragraphs of 2 to 20 tokens (ids 2-9), each followed by a blank line (0 0)
        tokens += [rng.randint(2, 9) for _ in range(rng.randint(2, 20))] + [0, 0]
    got = position_statistics(np.array(tokens), 0, batch_size=4, seq_len=12, steps=6, seeds=[0, 1])
    seen = got["seen"]
    assert seen[0] == 4 * 6  # every sequence has a first token
    assert all(a >= b for a, b in zip(seen, seen[1:])) and seen[-1] < seen[0]  # fewer real tokens later
    assert got["refused"] == 1 and 1 <= got["longest"] <= 12
    assert len(got["spread"]) == 12 and all(len(row) == 32 for row in got["spread"])


def test_every_batch_size_of_the_trend_trains_the_same_steps(finished):
    # fewer steps for larger batches made the small batches' "gain" the step count
    steps = {}
    for path in (finished[0] / "runs").glob("pad-*-b*-s0-*/config.json"):
        train = json.loads(path.read_text())["train"]
        # the accumulated runs: the batch of 32
        steps[train["batch_size"] * train["grad_accum"]] = train["steps"]
    assert set(steps) == set(E.BATCH_SIZES) and len(set(steps.values())) == 1, steps
    assert finished[1]["presets"]["batchnorm"]["settings"]["trend"]["steps"] == next(iter(steps.values()))


def _leaf_keys(rule) -> list[str]:
    if rule["kind"] in ("all", "any"):
        return [k for r in rule["rules"] for k in _leaf_keys(r)]
    if rule["kind"] == "given":
        return _leaf_keys(rule["if"]) + _leaf_keys(rule["then"])
    return [k for k in (rule["a"], rule["b"]) if isinstance(k, str)]


def test_every_comparison_of_trained_losses_needs_a_baseline_that_trains(finished):
    # a loss compared with another means nothing where neither learned more than letter counts
    checked = 0
    for name, section in finished[1]["presets"].items():
        for c in section["claims"]:
            rule = c["rule"]
            then = rule["then"] if rule["kind"] == "given" else rule
            if not any(k.endswith("_val") or "_val_" in k or k.endswith("_sensitivity") or "excess" in k
                       for k in _leaf_keys(then)):
                continue
            checked += 1
            assert rule["kind"] == "given" and "unigram_loss" in _leaf_keys(rule["if"]), (name, c["id"])
    assert checked >= 15


def test_timing_rounds_run_in_a_balanced_random_order():
    labels = ["layernorm", "rmsnorm", "prmsnorm", "batchnorm", "none"]
    orders = timing_module.balanced_orders(labels, rounds=4, seed=0)
    assert len(orders) == 5  # rounded up to a multiple of the labels
    for position in range(5):  # every label once in every position
        assert sorted(o[position] for o in orders) == sorted(labels)
    assert all(sorted(o) == sorted(labels) for o in orders)
    assert orders != timing_module.balanced_orders(labels, rounds=4, seed=1)  # each process its own order


def test_precision_finds_the_fp16_overflow(finished):
    rows = [r for r in finished[1]["presets"]["precision"]["rows"] if r["dtype"] == "fp16"]
    naive = [r for r in rows if r["impl"] == "naive"]
    assert all(r["broken_scales"] >= 1 and r["first_broken_scale"] <= 1e3 for r in naive)
    assert all(r["broken_scales"] == 0 for r in rows if r["impl"] == "normlab")


@pytest.fixture(scope="module")
def rendered(finished):
    """The report of every preset, rendered once (each render draws every preset's plots)."""
    out, results = finished
    return report.render(results, out)


def test_report_renders(finished, rendered):
    out, results = finished
    paths = rendered
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == sum(len(v) for v in _images(out))
    png = page.split("data:image/png;base64,")[1].split("'")[0]
    assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "does not hold" in page or "holds" in page
    md = paths["markdown"].read_text()
    for name in E.PRESETS:
        assert f"## {name}:" in md
    # every claim shows its interval (or why there is none), its sample count and each threshold's origin
    for section in results["presets"].values():
        for c in section["claims"]:
            assert c["evidence"]
            for line in c["evidence"] + c["origins"]:
                assert line in md and html.escape(line) in page, line
            assert all(any(w in x
                           for w in ("seed", "process", "round", "draw", "feature", "exact", "not measured"))
                       for x in c["evidence"]), c["evidence"]
    assert "Machine and versions" in md and "normlab compare all --size tiny" in md
    family = results["presets"]["norms"]["family"]
    assert f"the {family['size']} sampled tests of one `normlab compare` invocation" in md


def test_report_md_carries_no_raw_html_from_the_results(finished, tmp_path):
    out, results = finished
    bad = copy.deepcopy(results)
    claim = bad["presets"]["norms"]["claims"][0]
    claim["claim"] += " <script>alert(1)</script> <img src=x onerror=alert(2)>"
    bad["presets"]["norms"]["notes"].append("<!-- hidden --> note")
    md = report.markdown(bad, {})
    assert "<script>" not in md and "<img" not in md and "<!--" not in md
    assert "&lt;script>alert(1)&lt;/script>" in md
    assert "p < 0.05" in report.md_safe("p < 0.05")  # a comparison is not markup


def test_a_full_disk_keeps_the_previous_report_whole(finished, tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    out, results = finished
    # one preset: fewer plots
    results = {**results, "presets": {"precision": results["presets"]["precision"]}}
    folder = tmp_path / "report"
    report.render(results, folder)
    before = (folder / "report.html").read_bytes()
    real = Path.write_bytes

    def full(self, data):
        if self.name.startswith(".report.html"):
            real(self, data[:1000])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(OSError, match=f"could not write {folder / 'report.html'}"):
        report.render(results, folder)
    assert (folder / "report.html").read_bytes() == before and not list(folder.glob(".*.tmp"))


def test_the_report_writes_tables_others_can_reuse(finished, rendered):
    import csv

    out, results = finished
    paths = rendered
    rows = list(csv.DictReader(paths["results_csv"].open()))
    norms = results["presets"]["norms"]
    mine = [r for r in rows if r["preset"] == "norms" and r["quantity"] == "rmsnorm_val"]
    assert [float(r["value"])
            for r in mine] == pytest.approx(_claim(results, "norms.rms_quality")["measured"]["rmsnorm_val"])
    assert [int(r["sample"]) for r in mine] == norms["settings"]["seeds"] and {r["over"]
                                                                               for r in mine} == {"seeds"}
    claims = list(csv.DictReader(paths["claims_csv"].open()))
    ids = {c["id"] for s in results["presets"].values() for c in s["claims"]}
    assert {r["claim"] for r in claims} == ids
    tested = [r for r in claims if r["p"]]
    assert len(tested) == norms["family"]["size"]  # one row per test of the family
    for r in tested:  # the adjusted p is Holm's over the family's p-values
        assert float(r["p_adjusted"]) == pytest.approx(C.holm_adjust(float(r["p"]),
                                                                     norms["family"]["p_values"]))
    tex = paths["tex"].read_text()
    assert "\\toprule" in tex and "\\bottomrule" in tex and tex.count(" \\\\") == len(ids) + 1
    assert "rms\\_quality" in tex  # escaped for LaTeX


def _images(out):
    return [[p] for p in out.glob("*.png")]


def test_second_run_redoes_nothing(finished, monkeypatch):
    out, results = finished

    def fail(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(lab_module, "train", fail)
    monkeypatch.setattr(timing_module, "time_steps", fail)
    monkeypatch.setattr(precision_module, "precision_errors", fail)
    again = E.run_presets(["all"],
                          E.Settings(out=str(out), size="tiny", data=results["meta"]["data"], quiet=True))
    for name in E.PRESETS:
        assert again["presets"][name]["rows"] == results["presets"][name]["rows"]


def test_interrupted_run_resumes_from_its_checkpoint(corpus, env, tmp_path):
    settings = E.Settings(out=str(tmp_path), size="tiny", data=str(corpus), quiet=True,
                          overrides={"stop_at": "3"})
    lab = E.Lab(settings)
    lab.preset = "norms"
    fields, model = E.lm_sizes(lab)
    with pytest.raises(E.Interrupted, match="stopped at step 3"):
        lab.run("rmsnorm-s0", fields, model, {"norm": "rmsnorm", "seed": 0})
    lab = E.Lab(E.Settings(out=str(tmp_path), size="tiny", data=str(corpus), quiet=True))
    said = []
    lab.say = said.append
    lab.preset = "norms"
    result = lab.run("rmsnorm-s0", fields, model, {"norm": "rmsnorm", "seed": 0})
    assert any("resuming" in s for s in said)
    assert result["status"] == "completed" and result["steps"] == fields["steps"]
    steps = [json.loads(line)["step"] for line in open(tmp_path / "runs" / result["run"] / "metrics.jsonl")
             if "step_ms" in line]
    assert steps == list(range(fields["steps"]))  # each step once: nothing redone, nothing skipped


def test_overriding_what_a_preset_compares_is_an_error():
    with pytest.raises(ValueError, match="the norms preset compares norm"):
        E.check_overrides(["norms"], {"norm": "rmsnorm"})
    with pytest.raises(ValueError, match="unknown preset 'nrms'"):
        E.expand(["nrms"])
    assert E.expand(["demo", "norms"]) == ["norms", "gradients", "batchnorm", "precision"]


def test_cli_compare_and_report(finished, capsys, tmp_path):
    out, results = finished
    out = tmp_path  # precision alone: it trains nothing, and its report draws one preset's plots
    code = main(["compare", "precision", "--size", "tiny", "--out", str(out), "--data",
                 results["meta"]["data"], "--quiet"])
    assert code == 0
    text = capsys.readouterr().out
    assert "precision" in text and "report:" in text
    assert main(["report", str(out)]) == 0
    assert main(["compare", "norms", "norm=rmsnorm", "--out", str(out)]) == 2
    assert "compares norm" in capsys.readouterr().out
    assert main(["report", str(out / "nothing")]) == 2


def test_gradients_show_the_sources_model_and_this_decoder(finished):
    section = finished[1]["presets"]["gradients"]
    settings = {(r["setting"], r["placement"]) for r in section["rows"]}
    assert {("xiong", "post"), ("xiong", "pre"), ("llama", "post"), ("llama", "pre")} <= settings
    assert any(s.startswith("xiong+") for s, _ in settings)  # a single-factor control
    ids = {c["id"] for c in section["claims"]}
    assert {"gradients.post_grows", "gradients.post_grows.llama", "gradients.pre_last_scaling.llama"} <= ids
    for c in section["claims"]:
        assert any(x.startswith("matches") for x in c["conditions"]) and any(x.startswith("differs")
                                                                             for x in c["conditions"])
        for key, v in c["measured"].items():  # one value per seed, all finite
            assert isinstance(v, list) and all(math.isfinite(x) for x in v), (c["id"], key)
    assert "The factor that moves it most" in section["notes"][-1]


def test_depth_claims_need_a_pre_ln_baseline_that_trains(finished):
    c = _claim(finished[1], "depth.deepnorm_trains")
    untrained = {"deepnorm_val": _seeds(3.3), "pre_val": _seeds(3.35), "deepnorm_diverged": 0,
                 "unigram_loss": 3.4}
    verdict, lines = C.evaluate(c["rule"], {**c["measured"], **untrained})
    assert verdict == "inconclusive" and lines[0].startswith("precondition does not hold")


def test_the_depth_preset_trains_deepnorm_with_both_inits(finished):
    section = finished[1]["presets"]["depth"]
    assert [(r["placement"], r["init"]) for r in section["rows"]] == [
        ("post", "xavier"), ("deepnorm", "deepnet"), ("deepnorm", "article"), ("pre", "xavier")]
    runs = finished[0] / "runs"
    article = json.loads(next(runs.glob("deepnorm-article-deep-s0-*/config.json")).read_text())[
        "model_resolved"
    ]
    deepnet = json.loads(next(runs.glob("deepnorm-deep-s0-*/config.json")).read_text())["model_resolved"]
    assert (article["deepnorm_init"], deepnet["deepnorm_init"]) == ("article", "deepnet")
    assert {c["id"] for c in section["claims"]} >= {"depth.deepnorm_trains", "depth.deepnorm_article_trains"}


def test_a_layers_contribution_is_the_loss_of_the_model_without_its_block(finished):
    from normlab.experiments.curse import deep_share, layer_contributions
    from normlab.train import load_run

    section = finished[1]["presets"]["curse"]
    folder = next((finished[0] / "runs").glob("pre-curse-s0-*"))
    val = E.Lab(E.Settings(out=str(finished[0]), size="tiny", data=finished[1]["meta"]["data"],
                           quiet=True)).dataset.val
    got = layer_contributions(folder, val, 4, 16, 2)
    model, _ = load_run(folder)
    model.eval()
    gen = D.Batches(val, 4, 16, seed=606)
    batches = [gen.next() for _ in range(2)]
    blocks = list(model.blocks)
    for i in range(len(blocks)):  # the model rebuilt without block i: an independent skip
        model.blocks = torch.nn.ModuleList(blocks[:i] + blocks[i + 1:])
        with torch.no_grad():
            loss = sum(model(x, y)[1].item() for x, y in batches) / len(batches)
        assert loss - got["loss"] == pytest.approx(got["rise"][i], abs=1e-6)
    assert len(got["cos"]) == len(blocks) and all(-1 <= c <= 1 for c in got["cos"])
    assert deep_share([1.0, 1.0, 0.0, 2.0]) == 0.5 and deep_share([1.0, -1.0, 3.0, 0.0]) == 0.75
    assert deep_share([-1.0, 0.0]) is None
    lns = json.loads(next((finished[0] / "runs").glob("lns-curse-s0-*/config.json")).read_text())[
        "model_resolved"
    ]
    assert lns["ln_scaling"] is True and lns["placement"] == "pre" and lns["n_layers"] >= 4
    assert [r["arm"] for r in section["rows"]] == ["pre", "post", "lns"]


def test_every_claim_lists_its_conditions(finished):
    for name, section in finished[1]["presets"].items():
        for c in section["claims"]:
            assert c.get("conditions") and all(isinstance(x, str) and x
                                               for x in c["conditions"]), (name, c["id"])


def test_the_speed_preset_times_a_normalized_gru_and_the_norms_share_of_a_step(finished):
    speed = finished[1]["presets"]["speed"]
    gru = [r for r in speed["rows"] if r["what"] == "GRU train step"]
    assert {r["op"] for r in gru} == {"layernorm", "rmsnorm"} and all(r["ms"] > 0 for r in gru)
    norms = finished[1]["presets"]["norms"]
    budget = norms["settings"]["step_budget"]
    # the norms' share of a step is measured in the model (the step without norms, same processes),
    # not summed from calls timed alone
    steps = norms["series"]["step_ms"]
    share = 1 - statistics.median(n / ln for n, ln in zip(steps["none"], steps["layernorm"]))
    assert budget["norm_share_of_step"] == pytest.approx(share, rel=0.01, abs=1e-3)
    assert budget["expected_step_gain"] == pytest.approx(budget["norm_share_of_step"] * budget["kernel_gain"],
                                                         rel=0.02, abs=1e-3)
    assert any(f"the norms take {share:.1%} of a LayerNorm step" in x and "even if RMSNorm cost nothing" in x
               for x in _claim(finished[1], "norms.rms_speed")["conditions"])


def test_the_demo_leaves_out_the_batch_size_trend_and_says_how_to_run_it(finished, tmp_path):
    out = tmp_path / "demo"
    shutil.copytree(finished[0] / "runs", out / "runs")
    shutil.copytree(finished[0] / "jobs", out / "jobs")
    results = E.run_presets(["demo"], E.Settings(out=str(out), size="tiny", data=finished[1]["meta"]["data"],
                                                 quiet=True))
    section = results["presets"]["batchnorm"]
    assert [c["id"] for c in section["claims"]] == ["batchnorm.mates", "batchnorm.accumulation"]
    assert "normlab compare batchnorm --quick" in section["notes"][-1]
    # without the trend no column is all "-", and no note speaks of rows the table does not have
    assert not {"eval_loss", "train_mode_loss", "train_eval_gap"} & set(section["columns"])
    assert not any("paragraphs rows" in n for n in section["notes"])
    assert report.render(results, out)["html"].exists()
    # the seed counts are planned for the demo's family and for all's: the sizes the design assumes
    assert section["family"]["size"] == DS.FAMILY["demo"]
    assert finished[1]["presets"]["norms"]["family"]["size"] == DS.FAMILY["all"]


def test_the_pilot_tunes_each_arm_and_sizes_the_seeds(corpus, env, tmp_path):
    settings = E.Settings(out=str(tmp_path / "tune"), size="tiny", data=str(corpus), quiet=True)
    design = E.tune_presets(["norms"], settings, command="normlab compare norms --size tiny --tune")["tiny"]
    assert set(design["arms"]) == set(common_module.NORMS)
    for arm, a in design["arms"].items():
        # the preset's learning rate and either side
        around = [float(f"{2e-3 * f:.3g}") for f in DS.LR_FACTORS]
        assert set(around) <= set(a["grid"]) and len(a["grid"]) <= len(around) + DS.MAX_EXTEND
        if len(a["grid"]) > len(around):  # extended only past an edge that held the best
            assert a["grid"][0] < around[0] or a["grid"][-1] > around[-1]
        finite = {lr: v for lr, v in zip(a["grid"], a["mean_loss"]) if v is not None}
        assert a["lr"] == min(finite, key=finite.get)  # the lowest mean pilot loss
    # the pilot trains only at its own seeds, never at a test seed
    labels = [p.name for p in (tmp_path / "tune" / "runs").iterdir()]
    assert labels and all(name.startswith("pilot-") and any(f"-s{s}-" in name for s in DS.PILOT_SEEDS)
                          for name in labels)
    pairs = design["seeds"]["norms"]["pairs"]
    assert [(p["a"], p["b"]) for p in pairs] == [("rmsnorm", "layernorm"), ("prmsnorm", "rmsnorm")]
    for p in pairs:
        n = DS.seeds_for(p["pilot_sd_log_ratio"], 0.02, p["alpha_per_test"], DS.MAX_SEEDS["tiny"])[0]
        assert p["seeds"] == n and p["alpha_per_test"] == pytest.approx(0.05 / DS.FAMILY["demo"])
    assert design["seeds"]["norms"]["seeds"] == max(p["seeds"] for p in pairs)
    # tuning another preset that shares an arm (scale's rmsnorm) adds its own arms and seeds and keeps
    # the arm its owner tuned (a marked rate stands in for it, so that a re-tune cannot look the same)
    path = tmp_path / "tune" / "design.json"
    marked = json.loads(path.read_text())
    marked["tiny"]["arms"]["rmsnorm"]["lr"] = 0.00123
    path.write_text(json.dumps(marked))
    both = E.tune_presets(["scale"], settings, command="normlab compare scale --size tiny --tune")["tiny"]
    assert both["arms"]["rmsnorm"]["lr"] == 0.00123 and both["arms"]["rmsnorm"]["preset"] == "norms"
    assert {both["arms"][a]["preset"] for a in ("l2", "scalenorm")} == {"scale"}
    assert set(both["seeds"]) == {"norms", "scale"} and both["seeds"]["norms"] == design["seeds"]["norms"]
    assert [(p["a"], p["b"]) for p in both["seeds"]["scale"]["pairs"]] == [("scalenorm", "rmsnorm")]
    # --arms pilots only the arms it names: the others keep their rates (the marked one), and an
    # equivalence whose arms were not both piloted keeps its seeds; a pattern that names no arm is refused
    one = E.tune_presets(["norms"], dataclasses.replace(settings, tune_arms=("prms*",)),
                         command="... --arms 'prms*'")["tiny"]
    assert one["arms"]["rmsnorm"]["lr"] == 0.00123 and one["arms"]["prmsnorm"] == design["arms"]["prmsnorm"]
    assert one["seeds"]["norms"] == design["seeds"]["norms"]
    with pytest.raises(ValueError,
                       match="--arms zz matches none of the tuned arms of norms: batchnorm, layernorm, none"):
        E.tune_presets(["norms"], dataclasses.replace(settings, tune_arms=("zz",)), command="")
    # a pilot under BPE tokens writes its rates under their own key and leaves the character ones be
    bpe = E.tune_presets(["norms"], dataclasses.replace(settings, tune_arms=("prms*",),
                                                        overrides={"tokenizer": "bpe", "bpe_vocab": "300"}),
                         command="")
    assert (
        set(bpe["tiny|bpe300"]["arms"]) == {"prmsnorm"}
        and bpe["tiny"] == json.loads(path.read_text())["tiny"] == one
    )


def test_a_tokenizer_other_than_characters_has_rates_of_its_own(tmp_path):
    # the design keeps BPE-tuned rates apart from character-tuned ones; without a BPE pilot a BPE
    # run takes the character rate and says so; lr set for every run wins over both
    path = tmp_path / "design.json"
    path.write_text(json.dumps({"tiny": {"arms": {"rmsnorm": {"lr": 0.002}, "layernorm": {"lr": 0.001}}},
                                "tiny|bpe2048": {"arms": {"rmsnorm": {"lr": 0.0005}}}}))

    def lab(**overrides):
        return lab_module.Lab(E.Settings(out=str(tmp_path / "out"), size="tiny", design=str(path),
                                         overrides=overrides))

    assert lab().design_key == "tiny" and lab(tokenizer="char").design_key == "tiny"
    bpe = lab(tokenizer="bpe", bpe_vocab="2048")
    assert bpe.design_key == "tiny|bpe2048" and lab(tokenizer="bpe").design_key == "tiny|bpe1024"
    assert lab(tokenizer="byte").design_key == "tiny|byte"
    assert bpe._design_lr("rmsnorm") == (0.0005, "tuned (the design)")
    lr, how = bpe._design_lr("layernorm")
    assert lr == 0.001 and how.startswith("tuned on characters") and "bpe2048" in how
    assert lab()._design_lr("rmsnorm") == (0.002, "tuned (the design)")
    assert lab(lr="0.01")._design_lr("rmsnorm") == (None, "set for every run")
    # a rate set for every run takes the lab's floor, a tenth of it, unless min_lr is set too:
    # the preset's floor (2e-4) would sit above a low rate and the cosine would climb to it
    assert lab(lr="1e-4").train_over["min_lr"] == 1e-5
    assert lab(lr="1e-4", min_lr="0").train_over["min_lr"] == 0
    assert lab()._design_lr("deepnorm") == (None, "the preset's (no design at this size)")


def _no_clocks(monkeypatch):
    """Timings stubbed out, for tests of what is trained (they cost seconds of fresh processes each)."""
    from normlab.experiments import norms

    monkeypatch.setattr(norms, "time_steps_in_processes", lambda configs, *a, **k: {
        label: {"ms": 1.0, "samples": [1.0, 1.1], "rounds": [1.0, 1.1]} for label in configs})
    monkeypatch.setattr(norms, "time_norm_calls", lambda *a, **k: {"layernorm": 1.0, "rmsnorm": 0.9})


def _timings_of(finished_out, out):
    """The finished runs' timing jobs (clocks of this machine) copied into ``out``, so that a test of
    what is trained or collected measures nothing a clock decides again."""
    for path in (finished_out / "jobs").glob("*/*.json"):
        if path.name.split("-")[0] in lab_module.TIMING_JOBS:
            (out / "jobs" / path.parent.name).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, out / "jobs" / path.parent.name / path.name)


def test_each_arm_trains_at_the_learning_rate_its_design_gives(corpus, env, tmp_path, monkeypatch):
    _no_clocks(monkeypatch)
    lrs = {"layernorm": 1e-3, "rmsnorm": 3e-3, "prmsnorm": 4e-3, "batchnorm": 5e-4, "none": 2e-4}
    path = tmp_path / "design.json"
    path.write_text(json.dumps({"tiny": {"arms": {k: {"lr": v} for k, v in lrs.items()},
                                         "seeds": {"norms": {"seeds": 2}}}}))
    settings = E.Settings(out=str(tmp_path / "out"), size="tiny", data=str(corpus), quiet=True,
                          design=str(path))
    section = E.run_presets(["norms"], settings)["presets"]["norms"]
    assert section["settings"]["seeds"] == [0, 1]  # the design's seed count
    for norm, lr in lrs.items():
        for seed in (0, 1):
            (cfg,) = (tmp_path / "out" / "runs").glob(f"{norm}-s{seed}-*/config.json")
            train = json.loads(cfg.read_text())["train"]
            assert (train["lr"], train["min_lr"]) == (lr, lr / 10), norm
        assert section["settings"]["arm_lrs"][norm] == {"lr": lr, "how": "tuned (the design)"}
        assert next(r for r in section["rows"] if r["norm"] == norm)["lr"] == lr
    # the design's seed count goes to the arms of the equivalences it was sized for; the others keep
    # the preset's default (tiny: 1)
    path.write_text(
        json.dumps(
            {"tiny": {"seeds": {"norms": {"seeds": 3, "pairs": [{"a": "rmsnorm", "b": "layernorm"}]}}}}
        )
    )
    sized = E.run_presets(["norms"],
                          dataclasses.replace(settings, out=str(tmp_path / "sized")))["presets"]["norms"]
    assert {r["norm"]: r["seeds"] for r in sized["rows"]} == {"layernorm": 3, "rmsnorm": 3, "prmsnorm": 1,
                                                              "batchnorm": 1,
                                                              "none": 1}
    # a learning rate the user sets for every run wins, and the report says so
    over = E.run_presets(["norms"],
                         dataclasses.replace(settings, out=str(tmp_path / "over"), overrides={"lr": 1e-3}))
    assert {a["how"]
            for a in over["presets"]["norms"]["settings"]["arm_lrs"].values()} == {"set for every run"}


def test_the_power_calculation():
    # two one-sided tests at alpha: power 2 T(m / se - t) - 1 with se = sd / sqrt(n)
    sd, n, m, alpha = 0.006, 6, 0.02, 0.05 / 16
    se = sd / math.sqrt(n)
    t = stats.t.ppf(1 - alpha / 2, n - 1)
    assert DS.power_tost(sd, n, m, alpha) == pytest.approx(2 * stats.t.cdf(math.log1p(m) / se - t, n - 1) - 1)
    n_needed, power = DS.seeds_for(sd, m, alpha, most=50)
    assert power >= DS.POWER > DS.power_tost(sd, n_needed - 1, m, alpha)
    # capped: says its power
    assert DS.seeds_for(1.0, m, alpha, most=8) == (8, pytest.approx(DS.power_tost(1.0, 8, m, alpha)))


def test_the_learning_rate_sweep_is_a_field():
    assert E.parse_lrs("1e-3, 1e-4,1e-2") == (1e-4, 1e-3, 1e-2)
    assert E.parse_lrs(None) is None
    with pytest.raises(ValueError, match="at least two distinct positive"):
        E.parse_lrs("1e-3")
    with pytest.raises(ValueError, match="comma-separated numbers"):
        E.parse_lrs("1e-3;1e-2")


def test_the_warmup_preset_sweeps_the_learning_rates_it_is_given(finished, tmp_path):
    out = tmp_path / "lrs"
    shutil.copytree(finished[0] / "runs", out / "runs")
    settings = E.Settings(out=str(out), size="tiny", data=finished[1]["meta"]["data"], quiet=True,
                          lrs=(1e-3, 0.1))
    section = E.run_presets(["warmup"], settings)["presets"]["warmup"]
    assert section["settings"]["lrs"] == [1e-3, 0.1]
    assert all(c["lr"] == [1e-3, 0.1] for c in section["series"]["curves"].values())
    assert list((out / "runs").glob("pre-nowarm-lr0.1-s0-*/summary.json"))


def test_each_section_says_which_command_measured_it(finished, tmp_path):
    out = tmp_path / "merged"
    shutil.copytree(finished[0] / "runs", out / "runs")
    shutil.copytree(finished[0] / "jobs", out / "jobs")
    data = finished[1]["meta"]["data"]
    E.run_presets(["precision"], E.Settings(out=str(out), size="tiny", data=data, quiet=True),
                  command="first")
    merged = E.run_presets(["norms"], E.Settings(out=str(out), size="tiny", data=data, quiet=True),
                           command="second")
    assert merged["presets"]["precision"]["meta"]["command"] == "first"
    assert merged["presets"]["norms"]["meta"]["command"] == "second"
    assert len(merged["presets"]["norms"]["meta"]["data_sha256"]) == 16
    assert "Measured by `first`" in report.render(merged, out)["markdown"].read_text()


def test_report_refuses_a_verdict_its_rule_does_not_give(finished, tmp_path, capsys):
    tampered = copy.deepcopy(finished[1])
    c = tampered["presets"]["precision"]["claims"][0]
    c["verdict"] = next(v for v in C.VERDICTS if v != c["verdict"])
    (tmp_path / "results.json").write_text(json.dumps(tampered))
    assert main(["report", str(tmp_path)]) == 2
    assert "precision: precision.fp16_overflow" in capsys.readouterr().out
    assert not (tmp_path / "report.html").exists()


def test_a_cached_run_is_redone_when_its_data_or_code_changed(corpus, env, tmp_path, monkeypatch):
    data = tmp_path / "corpus"
    shutil.copytree(corpus, data)
    settings = E.Settings(out=str(tmp_path / "out"), size="tiny", data=str(data), quiet=True)

    def run(lab):
        lab.preset = "norms"
        fields, model = E.lm_sizes(lab)
        return lab.run("rmsnorm-s0", fields, model, {"norm": "rmsnorm", "seed": 0})

    first = run(E.Lab(settings))
    again = E.Lab(settings)
    assert run(again)["run"] == first["run"] and again.stale == []  # same data, same code: reused
    (data / "play0.txt").write_text((data / "play1.txt").read_text())  # the same file name, other text
    said, changed = [], E.Lab(settings)
    changed.say = said.append
    redone = run(changed)
    assert redone["run"] != first["run"] and changed.stale == ["run rmsnorm-s0"]
    assert any("no longer matches its data or code" in s for s in said)
    monkeypatch.setattr(lab_module, "sources_hash", lambda: "another version")
    newer = E.Lab(settings)
    assert run(newer)["run"] not in (first["run"], redone["run"]) and newer.stale == ["run rmsnorm-s0"]


def test_the_code_hash_ignores_layout_and_comments_but_not_code():
    from normlab.experiments.lab import code_of

    source = (Path(lab_module.__file__).parents[1] / "train.py").read_text()
    assert "def lr_at" in source
    relaid = source.replace("\n\n\ndef ", "\n\n\n# a comment\ndef ").replace("(step: int, cfg: TrainConfig)",
                                                                            "(\n    step: int,\n    cfg: "
                                                                            "TrainConfig,\n)")
    assert relaid != source and code_of(relaid) == code_of(source)
    assert code_of(source.replace("step < cfg.warmup", "step <= cfg.warmup")) != code_of(source)


# ------------------------------------------------------------------ plan, collect, --jobs


def _untimed(results: dict, names) -> dict:
    """Each preset's rows and claims without what a clock measured (step times, tokens/s)."""
    def timed(key: str) -> bool:
        return "ms" in key.split("_") or key.startswith(("tokens_per_s", "step_vs"))

    return {name: {"rows": [{k: v for k, v in row.items() if not timed(k)}
                            for row in results["presets"][name]["rows"]],
                   "claims": {c["id"]: (c["verdict"], c["measured"])
                              for c in results["presets"][name]["claims"]
                              if not any(timed(k) for k in c["measured"])}}
            for name in names}


def test_the_plan_lists_every_run_a_preset_trains(finished, tmp_path):
    out, results = finished
    settings = E.Settings(out=str(tmp_path), size="tiny", data=results["meta"]["data"], quiet=True)
    planned = {p.folder.name for p in E.plan_presets(["all"], settings)}
    assert planned == {f.name for f in (out / "runs").iterdir()}
    assert not any(tmp_path.iterdir())  # planning writes nothing
    assert E.plan_presets(["all"], E.Settings(out=str(out), size="tiny", data=results["meta"]["data"])) == []


def test_planned_commands_then_collect_train_nothing_more_and_match_a_direct_run(
    finished, tmp_path, capsys, monkeypatch
):
    out, results = finished
    data = results["meta"]["data"]
    _timings_of(out, tmp_path)
    # sandwich trains two runs at tiny (each a fresh process here), gradients none
    assert main(["compare", "sandwich", "gradients", "--size", "tiny", "--data", data, "--out", str(tmp_path),
                 "--plan"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    *trains, collect = [shlex.split(line) for line in lines]
    # pre-LN and sandwich, one seed
    assert len(trains) == 2 and all(t[:2] == ["normlab", "train"] for t in trains)
    assert collect[:2] == ["normlab", "compare"] and collect[-1] == "--collect"
    for argv in trains:  # what a job array or GNU parallel would do with them
        subprocess.run([sys.executable, "-m", "normlab", *argv[1:]], check=True, capture_output=True)

    def fail(*a, **k):
        raise AssertionError("collect trained a run")

    monkeypatch.setattr(lab_module, "train", fail)
    assert main(collect[1:]) == 0
    collected = json.loads((tmp_path / "results.json").read_text())
    assert _untimed(collected, ["sandwich", "gradients"]) == _untimed(results, ["sandwich", "gradients"])


def test_collect_trains_nothing_and_lists_the_runs_it_still_needs(finished, tmp_path, capsys, monkeypatch):
    out, results = finished

    def fail(*a, **k):
        raise AssertionError("collect trained a run")

    monkeypatch.setattr(lab_module, "train", fail)
    args = ["compare", "norms", "precision", "--size", "tiny", "--data", results["meta"]["data"], "--out",
            str(tmp_path)]
    assert main([*args, "--collect"]) == 1
    text = capsys.readouterr().out
    assert "5 training run(s) have not finished" in text and "rmsnorm-s0" in text
    written = json.loads((tmp_path / "results.json").read_text())
    assert list(written["presets"]) == ["precision"]  # the preset that needs no runs is measured and written
    assert main([*args, "--plan", "--collect"]) == 2


def test_two_jobs_at_once_give_the_verdicts_of_one(finished, tmp_path, capsys):
    out, results = finished
    _timings_of(out, tmp_path)
    # one preset of two runs, one per job: what is tested is the sweep's scheduling, which every
    # preset's runs go through alike
    args = ["compare", "sandwich", "--size", "tiny", "--data", results["meta"]["data"], "--out",
            str(tmp_path), "--quiet"]
    assert main([*args, "--jobs", "2"]) == 0
    logs = list((tmp_path / "logs").iterdir())
    # pre-LN and sandwich, one seed
    assert len(logs) == 2 and all("completed" in log.read_text() for log in logs)
    two = json.loads((tmp_path / "results.json").read_text())
    # the verdicts of what was trained; a clock's (the speed claim's) can differ between any two runs

    def verdicts(res):
        return {name: {cid: verdict for cid, (verdict, _) in section["claims"].items()}
                for name, section in _untimed(res, ("sandwich",)).items()}

    assert verdicts(two) == verdicts(results) and "sandwich.quality" in verdicts(results)["sandwich"]
    # one thread each instead of two: the losses agree to float32 rounding, not bit for bit
    for a, b in zip(two["presets"]["sandwich"]["rows"], results["presets"]["sandwich"]["rows"], strict=True):
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-3)


def test_a_job_that_fails_is_reported_with_its_log(tmp_path):
    from normlab.experiments import sweep

    bad = E.Pending("broken", tmp_path / "runs" / "broken",
                    ["normlab", "train", "--quiet", "steps=0", f"out={tmp_path}/x"])
    good = E.Pending("fine", tmp_path / "runs" / "fine", ["normlab", "--version"])
    failed = sweep.execute([bad, good], 2, tmp_path / "logs")
    assert [run.label for run, _ in failed] == ["broken"]
    assert "steps must be at least 1" in failed[0][1].read_text()
    env = sweep.job_env(1, 2, gpus=4)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["OMP_NUM_THREADS"] == str(max(1, sweep.cpus() // 2))


def test_a_preset_must_ask_for_its_runs_before_its_measurements(corpus, env, tmp_path):
    lab = E.Lab(E.Settings(out=str(tmp_path), size="tiny", data=str(corpus), quiet=True))
    lab.begin("norms")
    lab.job("something", {"x": 1}, lambda: {"y": 2})
    fields, model = E.lm_sizes(lab)
    with pytest.raises(RuntimeError, match="after a measurement"):
        lab.run("rmsnorm-s0", fields, model, {"norm": "rmsnorm", "seed": 0})



def test_the_invariances_are_exact_where_the_theory_says(finished):
    section = finished[1]["presets"]["invariance"]
    exact, invariant = section["series"]["exact"], section["series"]["invariant"]
    for norm in ("layernorm", "rmsnorm"):
        for where in ("op", "model"):
            for name, change in exact[norm][where].items():
                assert (change < 1e-12) if name in invariant[norm] else (change > 1e-2), (
                    norm,
                    where,
                    name,
                    change,
                )
    shifted = {r["transform"]: r["val_loss"] for r in section["rows"] if r["where"] == "training"
               and r["norm"] == "layernorm"}
    assert len(shifted) == 3  # trained without shift noise and with it at two levels


def test_final_norm_records_what_the_lm_head_reads(finished):
    section = finished[1]["presets"]["final-norm"]
    for key, curves in section["series"]["head_rms"].items():
        for c in curves:
            assert c["step"][0] == 0 and len(c["step"]) >= 2 and all(v > 0 for v in c["rms"]), key
    with_norm = [r for r in section["rows"] if r["final_norm"] and r["head_rms_end"] is not None]
    # a norm's output: RMS near its weights'
    assert with_norm and all(0.1 < r["head_rms_end"] < 10 for r in with_norm)


def test_sandwich_measures_the_stream_after_every_layer(finished):
    section = finished[1]["presets"]["sandwich"]
    layers = section["settings"]["model"]["n_layers"]
    for placement, per_seed in section["series"]["stream_rms"].items():
        assert all(len(v) == layers and all(x > 0 for x in v) for v in per_seed), placement
    # the Pre-LN runs are the norms preset's RMSNorm runs
    norms_runs = {c["val_curve"]["loss"][-1]
                  for c in finished[1]["presets"]["norms"]["series"]["runs"]["rmsnorm"]}
    assert {c["val_curve"]["loss"][-1] for c in section["series"]["runs"]["pre"]} <= norms_runs
    # before training: Pre-LN's stream is its small initial embeddings plus small branch outputs,
    # a sandwich's first layer already adds normalized branch outputs
    init = section["series"]["stream_rms_at_init"]
    assert all(len(v) == layers for per_seed in init.values() for v in per_seed)
    assert min(v[0] for v in init["sandwich"]) > 10 * max(v[0] for v in init["pre"])
    assert all(t != i for p in init for t, i in zip(section["series"]["stream_rms"][p], init[p]))
    for row in section["rows"]:
        ratios = [v[-1] / v[0] for v in init[row["placement"]]]
        # rows keep 3 digits
        assert row["growth_at_init"] == pytest.approx(sum(ratios) / len(ratios), rel=5e-3)



def test_dyt_compares_a_small_repeated_set_with_the_whole_split_and_measures_saturation(finished):
    section = finished[1]["presets"]["dyt"]
    budgets, passes, train = (
        section["settings"]["budgets"],
        section["settings"]["passes"],
        section["settings"]["train"],
    )
    assert budgets["large"] >= 10 * budgets["small"]
    settings = {r["setting"] for r in section["rows"]}
    assert settings == {"rmsnorm", "layernorm", "dyt0.2", "dyt0.5", "dyt1", "dyt0.5-nogain", "derf0.5"}
    for key, shares in section["series"]["saturated"].items():
        assert key.startswith("dyt") and all(0.0 <= s <= 1.0 for s in shares), key
    # both budgets train the same steps; what differs is the data they draw from
    steps = {c["val_curve"]["step"][-1] for curves in section["series"]["runs"].values() for c in curves}
    assert steps == {train["steps"]}
    for budget, n in budgets.items():
        assert passes[budget] == pytest.approx(train["steps"] * train["batch_size"] * train["seq_len"] / n)
    # read from each run's saved config: the small budget's runs train on the split's first
    # budgets["small"] tokens, the large budget's on all of it; the DyT runs start the embedding
    # gain where the paper's 7B does, the baselines and the no-gain setting have none
    out = finished[0]
    gains, data = {}, {}
    for config in (out / "runs").glob("*/config.json"):
        name = config.parent.name
        if name.startswith(("dyt", "derf", "rmsnorm-", "layernorm-")) and "steps" in name:
            saved = json.loads(config.read_text())
            setting = name.split("-")[0] + ("-nogain" if "-nogain-" in name else "")
            gains.setdefault(setting, set()).add(saved["model"].get("embed_gain"))
            data.setdefault("small" if "tokens-s" in name else "large",
                            set()).add(saved["train"].get("train_tokens", 0))
    assert data == {"small": {budgets["small"]}, "large": {0}}
    assert (
        gains["dyt0.5"]
        == gains["dyt0.2"]
        == gains["dyt1"]
        == gains["derf0.5"]
        == {section["settings"]["dyt_embed_gain"]}
        == {64.0}
    )
    assert gains["dyt0.5-nogain"] == gains["rmsnorm"] == gains["layernorm"] == {None}
    norms = {json.loads(c.read_text())["model"]["norm"] for c in (out / "runs").glob("derf0.5-*/config.json")}
    assert norms == {"derf"}
    assert next(c for c in section["claims"] if c["id"] == "dyt.derf_beats_dyt")["verdict"] in C.VERDICTS


def test_dyt_small_budget_is_a_set_gone_over_as_often_as_the_study_s(tmp_path):
    from types import SimpleNamespace


    from normlab.experiments import dyt

    lab = SimpleNamespace(dataset=SimpleNamespace(train=np.zeros(20_000, np.int32)))
    budgets = dyt.data_budgets(lab, 250, 16, 64)  # the quick size
    assert budgets == {"small": 250 * 16 * 64 // dyt.SMALL_PASSES,
                       "large": 20_000} and budgets["small"] == 1560
    # at least a few windows, however few the steps
    assert dyt.data_budgets(lab, 20, 4, 16)["small"] == 4 * 17
    lab.dataset.train = np.zeros(15_599, np.int32)
    with pytest.raises(ValueError,
                       match=r"small training set of 1,560 tokens .* at least 10x that \(15,600 tokens\); "
                                         r"this data's split has 15,599"):
        dyt.data_budgets(lab, 250, 16, 64)


def test_the_verdict_counts_read_as_english():
    assert report._counts_text({"holds": 1, "does not hold": 1,
                                "inconclusive": 2}) == "1 holds, 1 does not hold, 2 inconclusive"
    assert report._counts_text({"holds": 3, "does not hold": 0,
                                "inconclusive": 1}) == "3 hold, 0 do not hold, 1 inconclusive"


def test_settings_are_a_readable_table_not_raw_json():
    # the report printed each section's settings as one line of raw JSON in a code font
    from normlab import report

    from pathlib import Path

    results = json.loads(
        (Path(__file__).parents[1] / "docs/results/compare-demo-epyc-avx512/results.json").read_text()
    )
    md = report.markdown(results, {})
    assert '{"train"' not in md and "| setting | value |" in md
    rows = dict(report.settings_rows(results["presets"]["norms"]))
    seeds = len(results["presets"]["norms"]["settings"]["seeds"])
    assert rows["seeds"] == f"0 to {seeds - 1} ({seeds})"
    assert rows["arm_lrs"].startswith("layernorm: lr ") and "; rmsnorm: lr " in rows["arm_lrs"]
    assert "steps 200" in rows["train"]


def test_seed_start_trains_fresh_seeds_and_says_so(corpus, tmp_path, capsys):
    # a confirmatory run: the same preset on seeds no earlier verdict has seen
    out = tmp_path / "fresh"
    assert main(["compare", "final-norm", "--size", "tiny", "--seed-start", "7", "--seeds", "2", "--data",
                 str(corpus), "--out", str(out), "--quiet"]) == 0
    seeds = {json.loads((f / "config.json").read_text())["train"]["seed"] for f in (out / "runs").iterdir()}
    assert seeds == {7, 8}
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["seed_start"] == 7 and "--seed-start 7" in results["meta"]["command"]
    assert results["presets"]["final-norm"]["settings"]["seeds"] == [7, 8]
    assert "from seed 7 (fresh seeds)" in (out / "report.md").read_text()
    lab = lab_module.Lab(E.Settings(out=str(tmp_path / "lab"), size="tiny", data=str(corpus), seed_start=5,
                                    rung=0))
    assert lab.seeds(3, 3) == [5]  # a ladder rung at tiny size: one seed, from the start
    with pytest.raises(ValueError, match="reaches the pilot's seeds 100, 101, 102: start at most 97"):
        lab_module.Lab(E.Settings(out=str(tmp_path / "lab"), size="tiny", data=str(corpus), seed_start=98,
                                  seeds=3)).seeds(3, 3)
    assert lab_module.Lab(E.Settings(out=str(tmp_path / "lab"), size="tiny", data=str(corpus), seed_start=97,
                                     seeds=3)).seeds(3, 3) == [97, 98, 99]
    capsys.readouterr()
    assert main(["compare", "final-norm", "--size", "tiny", "--seed-start", "-1", "--out", str(out)]) == 2
    assert "--seed-start must be 0 or more, got -1" in " ".join(capsys.readouterr().out.split())
    assert main(["compare", "final-norm", "--size", "tiny", "--seed-start", "5", "--tune",
                 "--out", str(out)]) == 2
    assert "the pilot (--tune) trains at its own seeds" in " ".join(capsys.readouterr().out.split())
