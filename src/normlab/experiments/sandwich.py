"""Preset ``sandwich``: a norm on each branch's output as well as its input (CogView's sandwich
LayerNorm; Gemma 2's and OLMo 2's post-branch norms) against Pre-LN.

Pre-LN adds each branch's raw output to the residual stream, so the stream's scale can grow from
layer to layer; the sandwich normalizes what each branch adds. Measured after training: the
residual stream's RMS after each layer on fixed validation batches, and the final loss. The same
RMS of each run's untrained model shows how much of the growth the placement has before training.
"""

from __future__ import annotations

import torch

from normlab import claims as C
from normlab import data as D
from normlab.experiments.common import (COMPARABLE, curves_of, claim_values, round_sig, lm_sizes, stats,
                                        trains, unigram_loss)
from normlab.experiments.lab import Lab
from normlab.train import initial_model, load_run

SANDWICH = ("Ding et al. (2021), CogView (sandwich LayerNorm); Gemma Team (2024), Gemma 2; "
            "OLMo Team (2024), 2 OLMo 2 Furious (a norm on each branch's output)")


@torch.no_grad()
def stream_rms(folder, val_tokens, batch_size: int, seq_len: int, trained: bool = True) -> list[float]:
    """The residual stream's RMS after each layer of a run (trained, or as it was before its first
    step), averaged over 4 fixed batches."""
    model = load_run(folder)[0] if trained else initial_model(folder)
    gen = D.Batches(val_tokens, batch_size, seq_len, seed=505)
    total = None
    for _ in range(4):
        x, _ = gen.next()
        model.record_activations()
        model(x)
        rms = torch.tensor(model.activation_rms(), dtype=torch.float64)
        total = rms if total is None else total + rms
    return (total / 4).tolist()


def preset_sandwich(lab: Lab) -> dict:
    train_fields, model = lm_sizes(lab)
    seeds = lab.seeds(3, 3)
    # Pre-LN runs are the norms preset's RMSNorm runs (same config): reused when both are run
    runs = {placement: [lab.run(f"rmsnorm-s{seed}" if placement == "pre" else f"sandwich-rmsnorm-s{seed}",
                                train_fields,
                                {**model, "placement": placement}, {"norm": "rmsnorm", "seed": seed},
                                tune=True)
                        for seed in seeds]
            for placement in ("pre", "sandwich")}
    lab.plan_equivalence("sandwich-rmsnorm", "rmsnorm", 0.02)
    tf = {**train_fields, **lab.train_over}

    def measure(r, trained):
        return lab.job(f"stream-rms-{r['run']}" if trained else f"stream-rms-init-{r['run']}",
                       {"run": r["run"], "B": tf["batch_size"], "T": tf["seq_len"]},
                       lambda: stream_rms(lab.out / "runs" / r["run"], lab.dataset.val, tf["batch_size"],
                                          tf["seq_len"], trained))

    by_layer = {p: [measure(r, True) for r in rs] for p, rs in runs.items()}
    at_init = {p: [measure(r, False) for r in rs] for p, rs in runs.items()}
    rows, measured = [], {"unigram_loss": unigram_loss(lab.dataset.train)}
    for p, rs in runs.items():
        layers = by_layer[p]
        measured[f"{p}_val"] = [r["val_loss"] for r in rs]
        measured[f"{p}_max_stream_rms"] = [max(ls) for ls in layers]
        measured[f"{p}_stream_growth"] = [ls[-1] / ls[0] for ls in layers]
        measured[f"{p}_stream_growth_at_init"] = [ls[-1] / ls[0] for ls in at_init[p]]
        val = stats(measured[f"{p}_val"])
        arm = "rmsnorm" if p == "pre" else "sandwich-rmsnorm"
        rows.append({"placement": p, "lr": lab.arm_lr(arm), "seeds": len(rs),
                     "val_loss": round_sig(val["mean"]), "val_std": round_sig(val["std"], 2),
                     "stream_rms_first": round_sig(stats([ls[0] for ls in layers])["mean"], 3),
                     "stream_rms_last": round_sig(stats([ls[-1] for ls in layers])["mean"], 3),
                     "stream_growth": round_sig(stats(measured[f"{p}_stream_growth"])["mean"], 3),
                     "growth_at_init": round_sig(stats(measured[f"{p}_stream_growth_at_init"])["mean"], 3)})
    conditions = [
        "matches: the same RMSNorm decoder with a norm on each branch's input (Pre-LN) or on its input and "
        "output (sandwich, as Gemma 2 and OLMo 2 place them), and a final norm in both",
        "matches: the residual stream's RMS after each layer, measured after training on fixed validation "
        "batches",
        "differs: 4 layers on Shakespeare characters for a few hundred steps (CogView: 48 layers, and the "
        "growth it reports appears over long training)",
        "differs: in so short a run much of the growth is there before training (growth_at_init): a "
        "sandwich adds normalized branch outputs from the first step, Pre-LN the outputs of its small "
        "initial weights",
    ]
    claims = [
        C.claim("sandwich.stream_growth",
                "with sandwich norms the residual stream grows less from the first layer to the "
                "last than in Pre-LN", SANDWICH,
                claim_values(measured, "sandwich_stream_growth", "pre_stream_growth"),
                C.below("sandwich_stream_growth", "pre_stream_growth", paired=True), conditions),
        C.claim("sandwich.quality", "sandwich norms reach Pre-LN's quality (within 2%), where Pre-LN trains",
                SANDWICH,
                claim_values(measured, "sandwich_val", "pre_val", "unigram_loss"),
                C.given(trains("pre_val"),
                        C.within("sandwich_val", "pre_val", 0.02, origin=COMPARABLE, paired=True)),
                conditions),
    ]
    return {
        "title": "Sandwich norms vs Pre-LN",
        "question": "Does normalizing each branch's output bound the residual stream, and at what cost in "
                    "loss?",
        "settings": {"train": {**train_fields, **lab.train_over},
                     "model": {**model, **lab.model_over, "norm": "rmsnorm"},
                     "seeds": seeds},
        "columns": ["placement", "lr", "seeds", "val_loss", "val_std", "stream_rms_first", "stream_rms_last",
                    "stream_growth",
                    "growth_at_init"],
        "rows": rows, "claims": claims,
        "series": {"runs": {p: [curves_of(r) for r in rs] for p, rs in runs.items()}, "stream_rms": by_layer,
                   "stream_rms_at_init": at_init},
        "notes": [f"{len(seeds)} seeds per placement. stream_rms: the residual stream's RMS after each layer "
                  "(mean over seeds); growth: last layer over first, per seed; growth_at_init: the same "
                  "ratio for each run's model before its first step (same config and seed). The Pre-LN runs "
                  "are the norms preset's RMSNorm runs."],
    }
