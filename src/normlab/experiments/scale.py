"""Preset ``scale``: does RMSNorm's sqrt(d) matter? RMSNorm against the plain Euclidean norm
(w * x / ||x||, every row at norm 1 instead of sqrt(d)) and ScaleNorm (g * x / ||x||, one learned
gain started at sqrt(d): RMSNorm's scale without its per-feature weights)."""

from __future__ import annotations

from normlab import claims as C
from normlab.experiments.common import (
    COMPARABLE,
    DIVERGED,
    LM_SEEDS,
    WORSE,
    ZHANG19,
    curves_of,
    claim_values,
    arm_losses,
    lm_sizes,
    train_norms,
    trains,
    unigram_loss,
)
from normlab.experiments.lab import Lab

NGUYEN19 = ("Nguyen & Salazar (2019), Transformers without Tears: "
            "Improving the Normalization of Self-Attention")
ARMS = ("rmsnorm", "l2", "scalenorm")
CONDITIONS = [
    "matches: the three norms swapped into the same Pre-LN model and training, each arm at its own tuned "
    "learning rate",
    "differs: a 4-layer decoder on Shakespeare characters, a few hundred steps (the RMSNorm paper states "
    "the l2 result without a table; Nguyen & Salazar: low-resource translation)",
]


def preset_scale(lab: Lab) -> dict:
    seeds = lab.seeds(LM_SEEDS, LM_SEEDS)
    runs = train_norms(lab, ARMS, seeds, preset="scale")
    lab.plan_equivalence("scalenorm", "rmsnorm", 0.02)
    train_fields, model = lm_sizes(lab)
    rows, measured = [], {"unigram_loss": unigram_loss(lab.dataset.train)}
    for norm in ARMS:
        rows.append({"norm": norm, "lr": lab.arm_lr(norm), **arm_losses(norm, runs[norm], measured)})
    claims = [
        C.claim("scale.l2_worse",
                "the Euclidean norm in place of RMS (w * x / ||x||, without RMSNorm's sqrt(d)) trains "
                "worse than RMSNorm (diverges, or ends at least 2% above it), where RMSNorm trains", ZHANG19,
                claim_values(measured, "l2_val", "rmsnorm_val", "l2_diverged", "unigram_loss"),
                C.given(trains("rmsnorm_val"),
                        C.any_of(C.at_least("l2_diverged", 1, point="a count of diverged seeds",
                                            origin=DIVERGED),
                                 C.above("l2_val", "rmsnorm_val", 0.02, origin=WORSE, paired=True))),
                CONDITIONS),
        C.claim("scale.scalenorm_quality",
                "ScaleNorm (g * x / ||x||, g started at sqrt(d)) reaches RMSNorm's quality, where RMSNorm "
                "trains: the scale, not the direction or the per-feature weights, is what l2 loses", NGUYEN19,
                claim_values(measured, "scalenorm_val", "rmsnorm_val", "unigram_loss"),
                C.given(trains("rmsnorm_val"),
                        C.within("scalenorm_val", "rmsnorm_val", 0.02, origin=COMPARABLE, paired=True)),
                CONDITIONS
                + ["differs: ScaleNorm here is computed inside sqrt(||x||^2 + eps) (Nguyen & Salazar: "
                   "g / max(||x||, eps))"]),
    ]
    return {
        "title": "RMSNorm vs the Euclidean norm vs ScaleNorm",
        "question": "Does RMSNorm's sqrt(d) scale matter, and is it the scale or the per-feature weights?",
        "settings": {"train": {**train_fields, **lab.train_over},
                     "model": {**model, **lab.model_over, "placement": "pre"},
                     "seeds": seeds},
        "columns": ["norm", "lr", "val_loss", "val_std", "val_min", "val_max", "seeds", "diverged"],
        "rows": rows, "claims": claims,
        "series": {"runs": {norm: [{"seed": s, **curves_of(r)} for s, r in zip(seeds, rs)]
                            for norm, rs in runs.items()}},
        "notes": ["val_loss: validation loss at the end of training (mean over seeds; std, min, max over "
                  "seeds). l2: every row leaves the norm at length 1 (RMSNorm: sqrt(d)), so each block's "
                  "input is sqrt(d) times smaller at initialization; ScaleNorm starts as weightless RMSNorm "
                  "and learns one gain per norm. The RMSNorm runs are the norms preset's (same "
                  "configuration: shared when both run in one --out)."],
    }
