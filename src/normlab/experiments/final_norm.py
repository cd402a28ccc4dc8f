"""Preset ``final-norm``: a Pre-LN model needs a norm before its LM head.

In Pre-LN every branch adds to the residual stream and nothing normalizes the sum, so its scale
grows with depth and with training; the final norm (Xiong et al. 2020's Pre-LN Transformer,
LLaMA's final RMSNorm) puts the LM head's input back on a fixed scale. Trained with and without
it: the final loss, the RMS of what the LM head reads over training, and a high learning rate.
"""

from __future__ import annotations

from pathlib import Path

from normlab import claims as C
from normlab.experiments.common import (DIVERGED, WORSE, XIONG20, curves_of, claim_values, round_sig,
                                        lm_sizes, stats, trains, unigram_loss)
from normlab.experiments.lab import Lab
from normlab.runs import RunDir

LLAMA23 = ("Touvron et al. (2023), LLaMA: Open and Efficient Foundation Language Models (a final RMSNorm "
           "before the "
           "output layer); " + XIONG20 + " (the Pre-LN Transformer adds a final layer normalization)")
HIGH_LR_FACTOR = 10  # the stability runs: ten times the preset's learning rate


def head_rms_curve(folder: Path) -> dict:
    """The RMS of the LM head's input at each diagnostic step of a run (metrics.jsonl)."""
    records = [r for r in RunDir(folder).metrics() if "head_input_rms" in r]
    return {"step": [r["step"] for r in records], "rms": [r["head_input_rms"] for r in records]}


def preset_final_norm(lab: Lab) -> dict:
    train_fields, model = lm_sizes(lab)
    train_fields = {**train_fields, "diag_every": max(1, train_fields["steps"] // 20)}
    model = {**model, "placement": "pre", "norm": "rmsnorm"}
    base_lr = {**train_fields, **lab.train_over}["lr"]
    lrs = {"base": base_lr, "high": base_lr * HIGH_LR_FACTOR}
    seeds = lab.seeds(3, 3)
    # the base runs train each arm at its own learning rate; the high ones at 10x the preset's, shared
    runs = {(final,
             which): [lab.run(f"pre-{'final' if final else 'nofinal'}-{which}-s{seed}", train_fields, model,
                              {"final_norm": final, "lr": lr, "min_lr": lr / 10, "seed": seed},
                              tune=which == "base")
                      for seed in seeds]
            for final in (True, False) for which, lr in lrs.items()}
    curves = {key: [lab.job(f"head-rms-{r['run']}", {"run": r["run"]},
                            lambda r=r: head_rms_curve(lab.out / "runs" / r["run"])) for r in rs]
              for key, rs in runs.items()}
    rows, measured = [], {"unigram_loss": unigram_loss(lab.dataset.train)}
    for (final, which), rs in runs.items():
        name = f"{'final' if final else 'nofinal'}_{which}"
        growth = [c["rms"][-1] / c["rms"][0] if len(c["rms"]) > 1 and c["rms"][0] else None
                  for c in curves[final, which]]
        measured[f"{name}_val"] = [r["val_loss"] for r in rs]
        measured[f"{name}_diverged"] = sum(r["status"] == "diverged" for r in rs)
        measured[f"{name}_head_growth"] = growth
        val = stats(measured[f"{name}_val"])
        arm = f"pre-{'final' if final else 'nofinal'}-{which}"
        trained_lr = next((r["lr"] for r in rs if r.get("lr")), lrs[which])  # the size rule's on a ladder
        rows.append({"final_norm": final, "lr": lab.arm_lr(arm) if which == "base" else trained_lr,
                     "seeds": len(rs), "diverged": measured[f"{name}_diverged"],
                     "val_loss": round_sig(val["mean"]), "val_std": round_sig(val["std"], 2),
                     "head_rms_start": round_sig(stats([c["rms"][0] for c in curves[final, which]
                                                        if c["rms"]])["mean"], 3),
                     "head_rms_end": round_sig(stats([c["rms"][-1] for c in curves[final, which]
                                                      if c["rms"]])["mean"], 3),
                     "head_rms_growth": round_sig(stats(growth)["mean"], 3)})
    conditions = [
        "matches: the same Pre-LN model with and without the norm before the LM head, nothing else changed "
        "(RMSNorm, as in LLaMA)",
        f"matches: the stability runs use {HIGH_LR_FACTOR}x the learning rate, same warmup and schedule",
        "differs: a 4-layer decoder on Shakespeare characters for a few hundred steps (LLaMA: 32-80 layers, "
        "1.4T tokens)",
    ]
    doubling = C.ours("2x: the RMS at least doubles, past seed-to-seed noise of a few percent")
    claims = [
        C.claim("final_norm.loss", "without the final norm, Pre-LN ends with a higher validation loss",
                LLAMA23,
                claim_values(measured, "nofinal_base_val", "final_base_val", "unigram_loss"),
                C.given(trains("final_base_val"), C.above("nofinal_base_val", "final_base_val", paired=True)),
                conditions),
        C.claim("final_norm.head_grows",
                "without the final norm, what the LM head reads grows in training: its RMS "
                "ends at least twice where it started", LLAMA23,
                claim_values(measured, "nofinal_base_head_growth"),
                C.above("nofinal_base_head_growth", 1.0, 1.0, origin=doubling), conditions),
        C.claim("final_norm.high_lr",
                f"at {HIGH_LR_FACTOR}x the learning rate, Pre-LN without the final norm diverges or "
                "ends at least 2% worse than with it, where the model with it trains", LLAMA23,
                claim_values(measured, "nofinal_high_val", "final_high_val", "nofinal_high_diverged",
                             "unigram_loss"),
                C.given(trains("final_high_val"),
                        C.any_of(C.at_least("nofinal_high_diverged", 1, point="a count of diverged seeds",
                                            origin=DIVERGED),
                                 C.above("nofinal_high_val", "final_high_val", 0.02, origin=WORSE,
                                         paired=True))),
                conditions),
    ]
    return {
        "title": "The final norm before the LM head in Pre-LN",
        "question": "What does Pre-LN's final norm do for the loss, the LM head's input and stability?",
        "settings": {"train": {**train_fields, **lab.train_over}, "model": {**model, **lab.model_over},
                     "lrs": lrs,
                     "seeds": seeds},
        "columns": ["final_norm", "lr", "seeds", "diverged", "val_loss", "val_std", "head_rms_start",
                    "head_rms_end",
                    "head_rms_growth"],
        "rows": rows, "claims": claims,
        "series": {"runs": {f"{final}|{which}": [curves_of(r) for r in rs]
                            for (final, which), rs in runs.items()},
                   "head_rms": {f"{final}|{which}": cs for (final, which), cs in curves.items()}},
        "notes": [f"{len(seeds)} seeds per setting. head_rms: the RMS of the LM head's input (the final "
                  f"norm's output, or without it the residual stream) every {train_fields['diag_every']} "
                  "steps; growth: last over first. With the final norm that RMS is about 1 by construction "
                  "(a norm's output): its row is a sanity check, not a claim. Unigram loss "
                  f"{measured['unigram_loss']:.3f}: a model that learned only character frequencies."],
    }
