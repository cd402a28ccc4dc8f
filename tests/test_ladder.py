"""The size ladder: rungs whose parameters grow ~4x at equal tokens per parameter, the trend
claim's slope interval, the tokenizer as a field of every preset, and `compare --ladder` end to end."""

import base64
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from normlab import claims as C
from normlab import experiments as E
from normlab.cli import main
from normlab.experiments import ladder as LD
from normlab.experiments.lab import Lab, Settings
from normlab.experiments.common import lm_sizes

RECORDS = Path(__file__).resolve().parents[1] / "docs" / "results"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("size", ["quick", "full"])
def test_rungs_grow_parameters_4x_at_equal_tokens_per_parameter(corpus, tmp_path, size):
    tf, mf = lm_sizes(Lab(Settings(out=str(tmp_path), size=size, data=str(corpus))))
    counts, tokens = [], []
    for rung in range(len(LD.WIDTHS)):
        lab = Lab(Settings(out=str(tmp_path), size=size, data=str(corpus), rung=rung))
        rtf, rmf = lab.sized(dict(tf), dict(mf), dict(mf))
        counts.append(lab._non_embedding(rtf, rmf))
        tokens.append(rtf["steps"] * rtf["batch_size"] * rtf["seq_len"])
        assert rtf["lr"] == pytest.approx(tf["lr"] * mf["d_model"] / rmf["d_model"], rel=1e-3)  # the muP rule
    growth = [b / a for a, b in zip(counts, counts[1:])]
    assert all(3.5 < g < 4.5 for g in growth), growth
    per_param = [t / n for t, n in zip(tokens, counts)]
    steps = [t / (tf["batch_size"] * tf["seq_len"]) for t in tokens]
    for r, s in zip(per_param, steps):  # equal up to rounding the steps to whole numbers
        assert abs(r / per_param[LD.MIDDLE] - 1) <= 0.5 / s + 1e-9, per_param


def test_every_arm_of_a_rung_trains_on_the_same_tokens(corpus, tmp_path):
    lab = Lab(Settings(out=str(tmp_path), size="quick", data=str(corpus), rung=2))
    tf, mf = lm_sizes(lab)
    steps = {lab.sized(dict(tf), {**mf, "norm": n}, dict(mf))[0]["steps"]
             for n in ("layernorm", "rmsnorm", "none")}
    assert len(steps) == 1


def test_the_norms_ladder_trains_the_arms_whose_trends_it_can_decide(corpus, tmp_path):
    """norms on the ladder: LayerNorm, RMSNorm and no norm at every rung, seeds 0-4 each; at the
    preset's own size all five arms."""
    from normlab.experiments.norms import LADDER_NORMS

    def arms(**over):
        pending = E.plan_presets(["norms"], Settings(out=str(tmp_path / str(over)), size="quick",
                                                     data=str(corpus), **over))
        fields = [dict(a.split("=", 1) for a in r.argv if "=" in a) for r in pending]
        return {(f["norm"], int(f["seed"])) for f in fields}

    assert {n for n, _ in arms()} == {"layernorm", "rmsnorm", "prmsnorm", "batchnorm", "none"}
    for rung in range(len(LD.WIDTHS)):
        assert arms(rung=rung) == {(n, s) for n in LADDER_NORMS for s in range(LD.SEEDS)}


@pytest.mark.parametrize("preset", ["norms", "shallow"])
def test_the_gpu_size_widens_the_full_runs_at_equal_tokens_per_parameter(corpus, tmp_path, preset):
    """--size gpu: each full-size run at d_model 768 with 64-wide heads and its own depth, its
    steps grown by the parameter ratio, its rate by d_full / 768; the plan lists those runs."""
    full = {r.label: r for r in E.plan_presets([preset], Settings(out=str(tmp_path / "f"), size="full",
                                                                  data=str(corpus)))}
    gpu = {r.label: r
           for r in E.plan_presets([preset], Settings(out=str(tmp_path / "g"), size="gpu", data=str(corpus)))}
    assert full and set(gpu) == set(full)
    for label, run in gpu.items():
        f = dict(a.split("=", 1) for a in full[label].argv[3:] if "=" in a)
        g = dict(a.split("=", 1) for a in run.argv[3:] if "=" in a)
        assert (g["d_model"], g["n_heads"], g["n_layers"]) == ("768", "12", f["n_layers"]), label
        assert float(g["lr"]) == pytest.approx(float(f["lr"]) * int(f["d_model"]) / 768, rel=1e-3)
        assert (g["batch_size"], g["seq_len"]) == (f["batch_size"], f["seq_len"])
        per_param = [r.cost["tokens"] / r.cost["parameters"] for r in (full[label], run)]
        # equal for the arm whose model is the preset's base; arms that vary the model share its tokens
        ratio = run.cost["tokens"] / full[label].cost["tokens"]
        assert ratio == pytest.approx(int(g["steps"]) / int(f["steps"]))
        assert 5 < ratio < 200 and per_param[1] < 2 * per_param[0] and per_param[0] < 2 * per_param[1]
    widths = Lab(Settings(out=str(tmp_path), size="gpu", data=str(corpus), overrides={"d_model": "512"}))
    tf, mf = lm_sizes(widths)  # the user's width is the gpu width, and the rate follows it
    gtf, gmf = widths.sized(dict(tf), dict(mf), dict(mf))
    assert (gmf["d_model"], gmf["n_heads"]) == (512, 8) and gtf["lr"] == pytest.approx(
        tf["lr"] * mf["d_model"] / 512, rel=1e-3
    )


def test_the_slope_interval_is_the_least_squares_one():
    rng = random.Random(3)
    x = [math.log10(n) for n in (2e4, 8e4, 3.2e5) for _ in range(5)]
    y = [0.01 + 0.02 * a + rng.gauss(0, 0.01) for a in x]
    fit = LD.slope(x, y)
    X = np.column_stack([np.ones(len(x)), x])
    beta, res, *_ = np.linalg.lstsq(X, np.array(y), rcond=None)
    sigma2 = float(res[0]) / (len(x) - 2)
    se = math.sqrt(sigma2 * np.linalg.inv(X.T @ X)[1, 1])
    half = stats.t.ppf(0.975, len(x) - 2) * se
    assert fit["slope"] == pytest.approx(beta[1], rel=1e-9) and fit["se"] == pytest.approx(se, rel=1e-9)
    assert (fit["lo"], fit["hi"]) == (pytest.approx(beta[1] - half, rel=1e-9),
                                      pytest.approx(beta[1] + half, rel=1e-9))
    assert LD.slope([1, 1, 1], [1, 2, 3]) is None and LD.slope([1, 2], [1, 2]) is None


def _section(claims, parameters):
    return {"claims": claims, "parameters": parameters}


def _rungs(gap_at, rule, seeds=6, seed=0):
    """Sections at three rungs whose per-seed log ratio is gap_at(log10 N) plus noise."""
    rng = random.Random(seed)
    params = [2e4, 8e4, 3.2e5]
    sections = []
    for n in params:
        b = [3.0 + rng.gauss(0, 0.05) for _ in range(seeds)]
        a = [v * math.exp(gap_at(math.log10(n)) + rng.gauss(0, 0.002)) for v in b]
        sections.append(_section([C.claim("p.c", "a claim", "src", {"a": a, "b": b}, rule)], n))
    return sections, params


def test_trend_claims_decide_both_ways():
    within = C.within("a", "b", 0.02, paired=True, origin=C.ours("test"))
    flat, params = _rungs(lambda x: 0.001, within)
    grows, _ = _rungs(lambda x: 0.05 * (x - 4.9), within)
    directional = C.above("a", "b", paired=True)
    effect, _ = _rungs(lambda x: 0.03 * (x - 4.0), directional)
    shrinks, _ = _rungs(lambda x: 0.2 - 0.03 * x, directional)
    found = [LD.trends(s, params)[0] for s in (flat, grows, effect, shrinks)]
    LD.judge_trends(found)
    assert [t["question"] for t in found] == ["does not grow", "does not grow", "grows up", "grows up"]
    assert [t["verdict"] for t in found] == [C.HOLDS, C.FAILS, C.HOLDS, C.FAILS]
    assert found[0]["margin_per_decade"] == pytest.approx(math.log1p(0.02))
    # the slope it judged is the least-squares slope of every seed's gap on log10 parameters
    xs = [math.log10(r["parameters"]) for r in found[1]["rungs"] for _ in r["gaps"]]
    ys = [g for r in found[1]["rungs"] for g in r["gaps"]]
    assert found[1]["fit"]["slope"] == pytest.approx(stats.linregress(xs, ys).slope)


def test_a_claim_that_names_its_runs_size_is_placed_there_not_at_the_presets_median():
    # a preset of two model kinds: the claim's runs grow 10x a rung while the preset's median grows 4x
    directional = C.above("a", "b", paired=True)
    sections, params = _rungs(lambda x: 0.0, directional)
    own = [1e4, 1e5, 1e6]
    rng = random.Random(1)
    for section, n in zip(sections, own):
        (c,) = section["claims"]
        b = c["measured"]["b"]
        a = [v * math.exp(0.03 * math.log10(n) + rng.gauss(0, 0.002)) for v in b]
        section["claims"] = [C.claim("p.c", "a claim", "src", {"a": a, "b": b}, directional, parameters=n)]
    (t,) = LD.trends(sections, params)
    assert [r["parameters"] for r in t["rungs"]] == own
    assert t["fit"]["slope"] == pytest.approx(0.03, abs=0.003)  # at the median's sizes: 0.05
    # a claim without one stays at the preset's median
    (t,) = LD.trends(_rungs(lambda x: 0.0, directional)[0], params)
    assert [r["parameters"] for r in t["rungs"]] == params


def test_a_rung_whose_baseline_did_not_train_is_left_out_of_the_trend():
    trains = C.below("b", 5.0, 0.1, origin=C.ours("test"))  # the baseline ends 10% below 5
    rule = C.given(trains, C.within("a", "b", 0.02, paired=True, origin=C.ours("test")))
    sections, params = _rungs(lambda x: 0.001, rule)
    for c in sections[0]["claims"]:  # the smallest rung's baseline stays at the unigram-like 5
        c["measured"]["b"] = [5.0 + 0.01 * i for i in range(len(c["measured"]["b"]))]
        c["measured"]["a"] = [v * 1.3 for v in c["measured"]["b"]]  # a gap that would dominate the fit
    (t,) = LD.trends(sections, params)
    assert t["rungs"][0]["precondition"] is False and t["rungs"][0]["gaps"] == []
    assert t["fit"]["n"] == 12 and abs(t["fit"]["slope"]) < 0.01


def test_a_rung_left_out_says_whether_its_baseline_failed_or_was_not_decided():
    # dyt's small-set LayerNorm ended 9.7% below the unigram loss where 10% is asked (interval
    # -10.4% to -9.0%): not decided, which the ladder reported as "did not train"
    from normlab import ladder_report
    from normlab.plots import pyplot

    trains = C.below("b", 5.0, 0.1, origin=C.ours("test"))
    rule = C.given(trains, C.within("a", "b", 0.02, paired=True, origin=C.ours("test")))
    sections, params = _rungs(lambda x: 0.001, rule, seeds=5)
    rng = random.Random(2)
    for rung, centre in ((0, 5.0), (1, 4.0), (2, 4.5)):  # fails, holds, straddles the 10%
        for c in sections[rung]["claims"]:
            c["measured"]["b"] = [centre + rng.gauss(0, 0.02) for _ in range(5)]
            c["measured"]["a"] = [v * math.exp(rng.gauss(0, 0.002)) for v in c["measured"]["b"]]
    sections.append(sections[0])  # a fourth rung that fails too: one legend entry for both
    (t,) = LD.trends(sections, params + [1.28e6])
    assert [r["precondition_verdict"] for r in t["rungs"]] == [C.FAILS, C.HOLDS, C.UNSURE, C.FAILS]
    assert [r["precondition"] for r in t["rungs"]] == [False, True, False, False]
    sizes = params + [1.28e6]
    ladder = {"presets": {"p": {"trends": [t], "parameters": sizes}}, "widths": [0.5, 1, 2, 4],
              "family": LD.judge_trends([t]), "tokens_per_parameter": 10, "lr_rule": "x"}
    (row,) = [line for line in ladder_report.ladder_markdown(ladder, []).splitlines()
              if line.startswith("| p.c |")]
    cells = [c.strip() for c in row.split("|")[2:6]]
    assert cells[0].startswith("left out: the baseline did not train")
    assert cells[2].startswith("left out: the baseline's training not established")
    assert not cells[1].startswith("left out")
    plt = pyplot()
    (fig,) = ladder_report.plot_ladder({"presets": {"p": {"trends": [t]}}}, plt).values()
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert sorted(label for label in labels if label.startswith("left out")) == [
        "left out: the baseline did not train", "left out: the baseline's training not established"]
    plt.close(fig)


def test_a_preset_that_trains_no_run_measures_at_each_rungs_width(corpus, tmp_path):
    # gradients at initialization: no run to resize, so the measurement's own model follows the rung
    from normlab.experiments.common import XIONG_MODEL
    from normlab.model import Decoder, ModelConfig

    out = tmp_path / "ladder"
    assert main(["compare", "gradients", "--size", "tiny", "--ladder", "--data", str(corpus),
                 "--out", str(out), "--quiet"]) == 0
    growth = []
    for rung in range(3):
        results = json.loads((out / E.rung_file(rung)).read_text())
        section = results["presets"]["gradients"]
        width = LD.width(16, 2, rung)
        assert section["settings"]["model"]["d_model"] == width
        claims = {c["id"]: c for c in section["claims"]}
        model = Decoder(ModelConfig.preset("small", d_model=width, n_heads=2, max_seq_len=16, n_layers=2,
                                           vocab_size=results["meta"]["vocab_size"], **XIONG_MODEL))
        assert claims["gradients.post_grows"]["parameters"] == model.num_parameters(False)
        growth.append(claims["gradients.post_grows"]["measured"]["xiong_post_growth"])
        md = (out / f"rung{rung}" / "report.md").read_text()
        assert f"Measured at ladder rung {rung} (d_model x{LD.WIDTHS[rung]:g}" in md
    assert growth[0] != growth[2]  # measured at another width, not the middle rung's numbers again
    trends = json.loads((out / "ladder.json").read_text())["presets"]["gradients"]["trends"]
    assert len(trends) == 8
    for t in trends:
        sizes = [r["parameters"] for r in t["rungs"]]
        assert sizes[0] < sizes[1] < sizes[2], t["id"]
    md = " ".join((out / "ladder.md").read_text().split())
    assert "the models each claim measures" in md and "gradients trains no run" in md


def test_tokenizer_bpe_reaches_every_presets_runs_and_keys_the_cache(corpus, tmp_path):
    char = {r.folder.name
            for r in E.plan_presets(["all"], Settings(out=str(tmp_path), size="tiny", data=str(corpus)))}
    pending = E.plan_presets(["all"], Settings(out=str(tmp_path), size="tiny", data=str(corpus),
                                               overrides={"tokenizer": "bpe", "bpe_vocab": 300}))
    assert pending and all("tokenizer=bpe" in r.command and "bpe_vocab=300" in r.command for r in pending)
    assert not char & {r.folder.name for r in pending}  # none reuses a character-level run
    assert len({r.folder.name.split("-")[0] for r in pending}) > 3  # runs of many arms, not of one preset


def test_compare_ladder_end_to_end(corpus, tmp_path, capsys):
    # shallow: the cheapest preset with trained, paired claims; on characters and BPE
    out = tmp_path / "ladder"
    assert main(["compare", "shallow", "--size", "tiny", "--ladder", "--tokenizers", "char,bpe",
                 "bpe_vocab=300",
                 "--data", str(corpus), "--out", str(out), "--quiet"]) == 0
    ladder = json.loads((out / "ladder.json").read_text())
    params = ladder["presets"]["shallow"]["parameters"]
    assert params[0] < params[1] < params[2]
    trends = ladder["presets"]["shallow"]["trends"]
    assert [(t["id"], t["condition"])
            for t in trends] == [(i, c) for i in ("shallow.post_better", "shallow.pre_deep")
                                 for c in ("char", "bpe")]  # each claim's conditions together
    # one family over both conditions
    assert ladder["family"]["size"] == sum(t["p"] is not None for t in trends)
    for rung in range(3):
        for suffix, tokenizer in ((None, "char"), ("bpe", "bpe")):
            results = json.loads((out / E.rung_file(rung, suffix)).read_text())
            assert results["presets"]["shallow"]["rung"]["index"] == rung and not C.recheck(results)
            assert results["meta"]["tokenizer"] == tokenizer
            # the runs as the rung sized them, not the preset's own steps
            at = results["presets"]["shallow"]["trained_at"]
            assert {a["d_model"]
                    for a in at} == {LD.width(16, 2, rung)} and len({a["steps"] for a in at}) == 1
            md = (out / (f"rung{rung}" + (f"-{suffix}" if suffix else "")) / "report.md").read_text()
            # the report says the width the rung trained at, not only the preset's own fields
            assert f"Trained at ladder rung {rung} (d_model x{LD.WIDTHS[rung]:g}" in md
            assert f"d_model {LD.width(16, 2, rung)}, n_layers" in md
    rows = [line for line in (out / "ladder.md").read_text().splitlines() if line.startswith("| shallow.")]
    assert [r.split(" | ")[1] for r in rows] == ["char", "bpe", "char", "bpe"]
    assert (out / "plots" / "ladder-shallow.png").stat().st_size > 1000
    # `normlab report` redraws a ladder folder: every rung's report, ladder.md and ladder.html
    for f in [out / "ladder.md", out / "ladder.html", out / "rung0-bpe" / "report.md"]:
        f.unlink()
    assert main(["report", str(out)]) == 0
    assert "shallow.post_better" in (out / "ladder.md").read_text()
    assert "<a href='rung0-bpe/report.html'>rung0-bpe</a>" in (out / "ladder.html").read_text()
    assert "Trained at ladder rung 0" in (out / "rung0-bpe" / "report.md").read_text()
    lrs = [
        json.loads((out / E.rung_file(r)).read_text())["presets"]["shallow"]["settings"]["arm_lrs"]["pre-L1"][
            "lr"
        ]
        for r in range(3)
    ]
    # what each rung trained at
    assert lrs[0] == pytest.approx(2 * lrs[1]) and lrs[2] == pytest.approx(lrs[1] / 2)
    text = (out / "ladder.md").read_text()
    assert "muP" in text and "shallow.post_better" in text
    middle = json.loads((out / E.rung_file(1,
                                           "bpe")).read_text())["presets"]["shallow"]["settings"]["arm_lrs"]
    # how each condition's rates were chosen
    assert ladder["rates"]["bpe"] == sorted({a["how"] for a in middle.values()})
    assert "Each arm's rate at the middle rung, by condition: char: " in " ".join(text.split())
    assert main(["compare", "shallow", "--size", "tiny", "--ladder", "--tune", "--out", str(out)]) == 2
    assert "--tune runs at the preset's own size" in " ".join(capsys.readouterr().out.split())
    assert main(["compare", "shallow", "--size", "tiny", "--tokenizers", "char,bpe", "--out", str(out)]) == 2
    assert "add --ladder" in " ".join(capsys.readouterr().out.split())
    assert main(["compare", "shallow", "--size", "tiny", "--ladder", "--tokenizers", "char,words", "--out",
                 str(out)]) == 2
    assert "--tokenizers takes" in " ".join(capsys.readouterr().out.split())


def test_plan_costs_are_6ND_plus_attention(corpus, tmp_path, capsys):
    from normlab import train as T
    from normlab.experiments import cost
    from normlab.model import Decoder

    pending = E.plan_presets(["norms"], Settings(out=str(tmp_path), size="tiny", data=str(corpus)))
    assert pending
    for run in pending:
        tcfg, model_fields = T.resolve(None, dict(a.split("=", 1) for a in run.argv[3:]))
        from normlab import data as D

        vocab = D.prepare(tcfg.data, tcfg.tokenizer, tcfg.bpe_vocab, tcfg.val_fraction).tokenizer.vocab_size
        m = Decoder(T.ModelConfig.preset(tcfg.preset, **{**model_fields, "vocab_size": vocab}))
        n, T_ = m.num_parameters(False), tcfg.seq_len
        tokens = tcfg.steps * tcfg.batch_size * tcfg.grad_accum * T_
        want = 6 * n * tokens + 6 * m.cfg.n_layers * T_ * m.cfg.d_model * tokens
        assert run.cost["parameters"] == n and run.cost["tokens"] == tokens
        assert run.cost["flops"] == pytest.approx(want, rel=1e-12)
        assert run.cost["gpu_s"] == pytest.approx(want / (cost.MFU * cost.PEAK_FLOPS))
    assert main(["compare", "norms", "--size", "tiny", "--data", str(corpus), "--out", str(tmp_path),
                 "--plan"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"total of {len(pending)} runs" in err and "6ND" in err
    assert f"{len(pending)} training run(s) to train" in err
    # a ladder of a preset that trains nothing says so, and still gives the line that measures it
    assert main(["compare", "gradients", "--size", "tiny", "--ladder", "--data", str(corpus),
                 "--out", str(tmp_path), "--plan"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("--ladder --collect") and "normlab train" not in out
    assert "Nothing to train" in " ".join(err.split())


def test_the_ladder_plot_names_each_rung_on_its_axis():
    # within a decade or two a log axis labels its minor ticks, and their labels ran into each other
    from normlab import ladder_report
    from normlab.plots import pyplot

    sections, params = _rungs(lambda x: 0.001, C.within("a", "b", 0.02, paired=True, origin=C.ours("test")))
    trends = LD.trends(sections, params)
    LD.judge_trends(trends)
    plt = pyplot()
    (fig,) = ladder_report.plot_ladder({"presets": {"p": {"trends": trends}}}, plt).values()
    ax = fig.axes[0]
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["20k", "80k", "320k"]
    assert not [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()]
    lo, hi = ax.get_xlim()
    assert lo < params[0] and hi > params[-1]
    plt.close(fig)


def test_time_here_counts_each_runs_steps_and_evaluations(corpus, tmp_path, monkeypatch):
    from normlab import train as T
    from normlab.experiments import timing
    from normlab.runs import RunDir

    # the evaluations the estimate counts are those the training loop makes
    out = tmp_path / "run"
    T.train(*T.resolve(None, {"preset": "tiny", "data": str(corpus), "steps": "7", "eval_every": "3",
                              "batch_size": "2", "seq_len": "16", "out": str(out), "quiet": "true"}))
    evaluations = [m for m in RunDir(out).metrics() if "val_loss" in m]
    calls = []

    def fake(cfg, batch_size, seq_len, bf16=False):
        calls.append((cfg.d_model, cfg.norm, batch_size, seq_len))
        return {"train": 1e-3 * batch_size * cfg.d_model, "eval": 1e-5 * seq_len}

    monkeypatch.setattr(timing, "step_seconds", fake)
    (seconds,) = timing.run_seconds_here([["normlab", "train", "preset=tiny", f"data={corpus}", "steps=7",
                                           "eval_every=3", "batch_size=2", "seq_len=16", "eval_batches=5"]])
    d = T.ModelConfig.preset("tiny").d_model
    assert seconds == pytest.approx(7 * 1e-3 * 2 * d + len(evaluations) * 5 * 1e-5 * 16)
    # a plan's runs: each model and batch shape timed once, micro-batches counted, a resumed run unknown
    calls.clear()
    pending = E.plan_presets(["batchnorm"], Settings(out=str(tmp_path / "plan"), size="tiny",
                                                     data=str(corpus)))
    argvs = [run.argv for run in pending] + [["normlab", "train", "--quiet", "--resume", str(out)]]
    estimates = timing.run_seconds_here(argvs)
    assert estimates[-1] is None
    shapes = set()
    for run, s in zip(pending, estimates):
        tcfg, fields = T.resolve(None, dict(a.split("=", 1) for a in run.argv if "=" in a))
        cfg = T.ModelConfig.preset(tcfg.preset, **fields)
        shapes.add((cfg.d_model, cfg.norm, tcfg.batch_size, tcfg.seq_len))
        evals = 1 + tcfg.steps // tcfg.eval_every + (tcfg.steps % tcfg.eval_every > 0)
        assert s == pytest.approx(tcfg.steps * tcfg.grad_accum * 1e-3 * tcfg.batch_size * cfg.d_model
                                  + evals * tcfg.eval_batches * 1e-5 * tcfg.seq_len)
    assert sorted(calls) == sorted(shapes) and any("grad_accum=8" in run.argv for run in pending)
    # a model this machine cannot hold is not timed (a plan for a bigger machine), the rest still are
    from normlab import footprint

    big = max(shape[2] for shape in shapes)  # the largest batch
    real_check = footprint.check_fits

    def fits_unless_largest(cfg, batch, *args, **kwargs):
        if batch == big:
            raise footprint.TooLarge("too large for this test")
        return real_check(cfg, batch, *args, **kwargs)

    monkeypatch.setattr(footprint, "check_fits", fits_unless_largest)
    calls.clear()
    estimates = timing.run_seconds_here([run.argv for run in pending])
    for run, s in zip(pending, estimates):
        tcfg, _ = T.resolve(None, dict(a.split("=", 1) for a in run.argv if "=" in a))
        assert (s is None) == (tcfg.batch_size == big)
    assert calls and all(call[2] != big for call in calls)


def test_plan_time_here_times_real_steps_and_is_refused_without_a_plan(corpus, tmp_path, capsys):
    from normlab.experiments import timing
    from normlab.model_config import ModelConfig

    times = timing.step_seconds(ModelConfig.preset("tiny", vocab_size=50), 2, 16)
    assert 0 < times["eval"] < times["train"] < 10
    assert main(["compare", "norms", "--size", "tiny", "--data", str(corpus), "--out", str(tmp_path),
                 "--plan", "--time-here"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "one run at a time" in err and "here" in err
    assert main(["compare", "norms", "--size", "tiny", "--data", str(corpus), "--out", str(tmp_path),
                 "--time-here"]) == 2
    assert "add --plan" in " ".join(capsys.readouterr().out.split())


def test_a_rung_reports_the_rates_its_runs_trained_at(corpus, tmp_path):
    # final-norm's high-rate rows printed the preset's 10x rate at every rung, where the runs
    # trained at the size rule's (times d_middle / d)
    settings = Settings(out=str(tmp_path), size="tiny", data=str(corpus), quiet=True, rung=0)
    section = E.run_presets(["final-norm"], settings)["presets"]["final-norm"]
    arms = [f"pre-{final}-{which}" for final in ("final", "nofinal") for which in ("base", "high")]
    assert len(section["rows"]) == len(arms)
    for arm, row in zip(arms, section["rows"]):
        trained = {json.loads((folder / "config.json").read_text())["train"]["lr"]
                   for folder in (tmp_path / "runs").glob(f"{arm}-s*")}
        assert trained == {row["lr"]}, (arm, trained, row["lr"])
    assert section["rows"][1]["lr"] != section["settings"]["lrs"]["high"]  # the rung's, not the preset's


def test_dyt_s_small_set_is_gone_over_as_often_at_every_rung(corpus, tmp_path):
    # the small set was sized from the preset's 250 steps at every rung, so a rung's runs (63 or
    # 999 steps) went over it 41 or 656 times where the claim says 164
    from normlab.experiments import dyt

    def small_runs(**over):
        pending = E.plan_presets(["dyt"], Settings(out=str(tmp_path / str(over)), size="quick",
                                                   data=str(corpus), **over))
        fields = [dict(a.split("=", 1) for a in r.argv if "=" in a) for r in pending]
        return [(r.label, f) for r, f in zip(pending, fields) if "train_tokens" in f]

    middle = small_runs()
    for rung in range(len(LD.WIDTHS)):
        runs = small_runs(rung=rung)
        assert len(runs) == 7 * LD.SEEDS  # every setting, the ladder's seeds
        for label, f in runs:
            passes = int(f["steps"]) * int(f["batch_size"]) * int(f["seq_len"]) / int(f["train_tokens"])
            assert passes == pytest.approx(dyt.SMALL_PASSES, rel=0.01), (rung, label, passes)
        # arm names keep the preset's size, where the design's tuned rates are found
        def arms(pairs):
            return {label.rsplit("-s", 1)[0] for label, _ in pairs}

        assert arms(runs) == arms(middle)
    assert {f["train_tokens"] for _, f in small_runs(rung=0)} != {f["train_tokens"] for _, f in middle}


def test_a_rung_states_the_warmup_and_steps_its_runs_trained(corpus, tmp_path):
    # shallow's conditions and batchnorm's notes named the preset's warmup and steps, where a
    # rung's runs train with the size rule's
    settings = Settings(out=str(tmp_path), size="tiny", data=str(corpus), quiet=True, rung=2)
    sections = E.run_presets(["shallow", "batchnorm"], settings)["presets"]

    def trained(pattern, field):
        return {json.loads((f / "config.json").read_text())["train"][field]
                for f in (tmp_path / "runs").glob(pattern)}

    (warmup,) = trained("post-L*", "warmup")
    assert warmup != sections["shallow"]["settings"]["train"]["warmup"]  # the rung scaled it
    condition = sections["shallow"]["claims"][0]["conditions"][0]
    assert f"with warmup ({warmup} steps)" in condition
    (steps,) = trained("pad-*", "steps")
    assert steps != sections["batchnorm"]["settings"]["trend"]["steps"]
    assert f"mask, {steps} steps per run" in " ".join(sections["batchnorm"]["notes"])


def test_the_warmup_sweep_on_a_rung_is_labelled_with_the_rates_it_trained_at(corpus, tmp_path):
    # the sweep's rows, curves and claim texts named the preset's rates, where a rung's runs train
    # at the size rule's
    settings = Settings(out=str(tmp_path), size="tiny", data=str(corpus), quiet=True, rung=0)
    section = E.run_presets(["warmup"], settings)["presets"]["warmup"]
    trained = sorted({json.loads((folder / "config.json").read_text())["train"]["lr"]
                      for folder in (tmp_path / "runs").glob("pre-warm-lr*")})
    nominal = sorted({float(folder.name.split("-lr")[1].split("-")[0])
                      for folder in (tmp_path / "runs").glob("pre-warm-lr*")})
    assert trained != nominal  # the rung rescales the sweep
    assert sorted({row["lr"] for row in section["rows"]}) == trained
    assert section["settings"]["lrs"] == trained
    assert all(curve["lr"] == trained for curve in section["series"]["curves"].values())
    assert {float(k.rsplit("|", 1)[1]) for k in section["series"]["logits"]} == set(trained)
    claims = {c["id"]: c for c in section["claims"]}
    best = [v for v in claims["warmup.post_lower_lr"]["measured"]["pre_warm_best_log10_lr"] if v is not None]
    assert best and all(min(trained) * 0.999 <= 10 ** v <= max(trained) * 1.001 for v in best)
    assert f"({max(trained):g})" in claims["warmup.qk_norm_logits"]["claim"]
    # the width, steps and warmup it states are the ones its runs trained with (the rung's)
    configs = [json.loads((folder / "config.json").read_text())
               for folder in (tmp_path / "runs").glob("pre-warm-lr*")]
    (width,) = {c["model"]["d_model"] for c in configs}
    (steps,) = {c["train"]["steps"] for c in configs}
    (warmup,) = {c["train"]["warmup"] for c in configs}
    assert (width, steps) != (section["settings"]["model"]["d_model"], section["settings"]["train"]["steps"])
    assert section["settings"]["warmup_steps"] == warmup
    stated = f"layers of width {width}, {steps} steps"
    assert all(stated in " ".join(c["conditions"]) for c in claims.values())


def test_the_ladder_page_shows_every_trend_with_its_plot_and_the_rung_reports(tmp_path):
    from normlab import ladder_report

    ladder = json.loads((RECORDS / "ladder-final-norm-quick-epyc-zen4" / "ladder.json").read_text())
    trends = ladder["presets"]["final-norm"]["trends"]
    trends[0]["text"] = "a <script> & friends"  # a claim text cannot inject markup
    (tmp_path / "rung1").mkdir()
    (tmp_path / "rung1" / "report.html").write_text("<html></html>")
    paths = ladder_report.render_ladder(ladder, tmp_path)
    page = paths["html"].read_text()
    assert paths["html"] == tmp_path / "ladder.html"
    assert "<script>" not in page and "a &lt;script&gt; &amp; friends" in page
    rows = [line for line in page.splitlines() if line.startswith("<tr><td>final_norm.")]
    assert [r.split("<br>")[0].removeprefix("<tr><td>") for r in rows] == [t["id"] for t in trends]
    for row, t in zip(rows, trends):
        assert row.endswith(f">{t['verdict']}</span></td></tr>")
        assert f"{t['rungs'][2]['ci']['gap']:+.2%}" in row
    png = (tmp_path / "plots" / "ladder-final-norm.png").read_bytes()
    assert base64.b64encode(png).decode() in page
    assert "<a href='rung1/report.html'>rung1</a>" in page and "rung0/report.html" not in page
