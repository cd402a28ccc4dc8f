"""Preset ``warmup``: learning-rate sweeps of Post-LN and Pre-LN with and without warmup, qk-norm,
a norm after the embedding and Sandwich-LN."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch

from normlab import claims as C
from normlab import data as D
from normlab.experiments.common import (
    BLOOM22,
    COMPARABLE,
    GLM22,
    WORTSMAN23,
    XIONG20,
    XIONG_MODEL,
    claim_values,
    round_sig,
    stats,
    trains,
    unigram_loss,
)
from normlab.experiments.lab import Lab
from normlab.train import load_run

# The settings of the stability sweep: (placement, warmup on, qk-norm, a norm after the embedding).
SWEEP = {"post|warm": ("post", True, False, False), "post|nowarm": ("post", False, False, False),
         "pre|warm": ("pre", True, False, False), "pre|nowarm": ("pre", False, False, False),
         "pre|warm|qknorm": ("pre", True, True, False), "pre|warm|embednorm": ("pre", True, False, True),
         "pre|warm|sandwich": ("sandwich", True, False, False)}


def stability_conditions(n_layers: int, d_model: int, steps: int) -> list[str]:
    """What the sweep matches and where it differs, at the width and steps its runs trained (a
    ladder rung's or the size's, not the quick size's)."""
    return [
        "matches (Xiong et al.): Post-LN and Pre-LN Transformers with LayerNorm, a ReLU FFN, learned "
        "positions and xavier init; Adam beta2 = 0.98; no gradient clipping (clipping hides the instability "
        "measured); warmup against none",
        "matches (Wortsman et al.): a learning-rate sweep over more than 1.5 orders of magnitude; LR "
        "sensitivity = mean over the sweep of min(loss, loss at init) minus the best loss",
        f"differs: a decoder-only character LM, {n_layers} layers of width {d_model}, {steps} steps (Xiong "
        "et al.: translation and BERT for ~100k steps; Wortsman et al.: decoders of 10M to 1B+ parameters)",
        "differs: cosine decay after the warmup (Xiong et al.: inverse square root)",
    ]


EMBED_NORM_CONDITIONS = [
    "differs (Bloom): a 176B-parameter model with ALiBi, where the norm sees the token embeddings alone; "
    "here it sees the embeddings plus learned positions, in Xiong et al.'s model (embed_norm=true)",
]

# The divergence claims' unit: one outcome per seed at each rate, so their counts are not of seeds.
PAIRS = "(seed, rate) pairs"

TRAINS_ON_GRID = ("precondition: the baseline's best learning rate on the grid trains (10% below the "
                  "unigram loss); a sensitivity of runs that learned nothing measures nothing")


def parse_lrs(text: str | None) -> tuple[float, ...] | None:
    """--lrs "1e-4,1e-3,1e-2": at least two distinct positive learning rates, sorted."""
    if text is None:
        return None
    try:
        lrs = tuple(sorted({float(v) for v in text.split(",") if v.strip()}))
    except ValueError as err:
        raise ValueError(f"--lrs must be comma-separated numbers, e.g. 1e-4,1e-3,1e-2; got {text!r}") from err
    if len(lrs) < 2 or lrs[0] <= 0 or not all(math.isfinite(v) for v in lrs):
        raise ValueError(f"--lrs needs at least two distinct positive learning rates; got {text!r}")
    return lrs


def stability_sizes(lab: Lab) -> tuple[dict, dict, tuple]:
    """Training and model fields of the learning-rate sweep, and the learning rates."""
    train_fields = dict(preset="small", tokenizer="char", ckpt_every=0, schedule="cosine", diverge_factor=3.0,
                        beta2=0.98, grad_clip=0.0)
    model = {**XIONG_MODEL, "n_heads": 4}
    if lab.size == "tiny":
        train_fields.update(steps=6, batch_size=4, seq_len=16, eval_every=3, eval_batches=2, warmup=2)
        return train_fields, {**model, "d_model": 16, "n_heads": 2, "n_layers": 2,
                              "max_seq_len": 16}, (1e-3, 5e-2)
    if lab.quick:
        train_fields.update(steps=200, batch_size=8, seq_len=64, eval_every=50, eval_batches=4, warmup=50)
        return train_fields, {**model, "d_model": 64, "n_layers": 6,
                              "max_seq_len": 64}, (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
    train_fields.update(steps=2000, batch_size=16, seq_len=128, eval_every=200, eval_batches=10, warmup=400)
    lrs = tuple(float(f"{10 ** (e / 3):.3g}") for e in range(-12, -2))  # 1e-4 to 4.6e-2, 3 points a decade
    return train_fields, {**model, "d_model": 256, "n_layers": 6, "max_seq_len": 128}, lrs


@torch.no_grad()
def max_attention_logit(run_folder: Path, val_tokens, batch_size: int, seq_len: int) -> float:
    """The largest attention logit over layers of a trained run, on one fixed validation batch."""
    model, _ = load_run(run_folder)
    x, _ = D.Batches(val_tokens, batch_size, seq_len, seed=777).next()
    model.record_attention_logits()
    model(x)
    return max(model.attention_logits())


def lr_sensitivity(losses: list, init: float | None) -> float | None:
    """Wortsman et al. (2023): the mean over the sweep of min(loss, loss at init) minus the best
    loss; a diverged run (None) counts as the loss at init. None without a loss at init."""
    if init is None:
        return None
    capped = [init if v is None or not math.isfinite(v) else min(v, init) for v in losses]
    return statistics.fmean(capped) - min(capped)


def preset_warmup(lab: Lab) -> dict:
    train_fields, model, lrs = stability_sizes(lab)
    lrs = lab.s.lrs or lrs
    warm = train_fields.pop("warmup")
    seeds = lab.seeds(3, 3)
    tf = {**train_fields, **lab.train_over}
    # the steps, warmup and width the runs train with: a ladder rung or the gpu size scales them
    run_tf, run_model = lab.sized({**tf, "warmup": warm}, {**model, **lab.model_over}, model)
    conditions = stability_conditions(run_model["n_layers"], run_model["d_model"], run_tf["steps"])
    runs = {}  # (setting, lr) -> one result per seed
    for key, (placement, warmup, qk, embed_norm) in SWEEP.items():
        for lr in lrs:
            runs[key, lr] = [lab.run(f"{key.replace('|', '-')}-lr{lr:g}-s{seed}", train_fields, model,
                                     {"placement": placement, "lr": lr, "min_lr": lr / 10, "warmup": warm
                                      if warmup else 0,
                                      "qk_norm": qk, "seed": seed,
                                      **({"embed_norm": True} if embed_norm else {})})
                             for seed in seeds]
    logits = {}  # the largest attention logit of every pre|warm run, with and without qk-norm
    for key in ("pre|warm", "pre|warm|qknorm"):
        for lr in lrs:
            logits[key, lr] = [lab.job(f"logit-{r['run']}",
                                       {"run": r["run"], "B": tf["batch_size"], "T": tf["seq_len"]},
                                       lambda r=r: max_attention_logit(lab.out / "runs" / r["run"],
                                                                       lab.dataset.val,
                                                                       tf["batch_size"], tf["seq_len"]))
                               for r in runs[key, lr]]
    # the rate each sweep point trained at: the sweep's own, or on a ladder rung the size rule's
    at = {lr: runs["pre|warm", lr][0].get("lr") or lr for lr in lrs}
    rows, measured, curves = [], {}, {}
    for key in SWEEP:
        sens, best, best_val = [], [], []
        for i in range(len(seeds)):
            losses = [runs[key, lr][i]["val_loss"] for lr in lrs]
            init = runs[key, lrs[0]][i]["init_val_loss"]
            sens.append(lr_sensitivity(losses, init))
            done = [j for j in range(len(lrs)) if losses[j] is not None]
            # None: all diverged
            best.append(math.log10(at[lrs[min(done, key=lambda j: losses[j])]]) if done else None)
            best_val.append(min(losses[j] for j in done) if done else None)
        measured[f"{key.replace('|', '_')}_sensitivity"] = sens
        measured[f"{key.replace('|', '_')}_best_log10_lr"] = best
        measured[f"{key.replace('|', '_')}_best_val"] = best_val
        curves[key] = {"lr": [at[lr] for lr in lrs],
                       "loss": [[r["val_loss"] for r in runs[key, lr]] for lr in lrs],
                       "init": stats([r["init_val_loss"] for r in runs[key, lrs[0]]])["mean"]}
        mean_best = stats(best)["mean"]  # one value per setting, shown on each of its rows
        per_setting = {"sensitivity": round_sig(stats(sens)["mean"], 3),
                       "best_lr": round_sig(10**mean_best, 3) if mean_best is not None else None}
        for lr in lrs:
            val = stats([r["val_loss"] for r in runs[key, lr]])
            rows.append({"setting": key, "lr": at[lr],
                         "diverged": sum(r["status"] == "diverged" for r in runs[key, lr]),
                         "val_loss": round_sig(val["mean"]), "val_std": round_sig(val["std"], 2),
                         "max_logit": round_sig(statistics.fmean(logits[key, lr]), 4) if (key, lr) in logits
                         else None,
                         **per_setting})
    measured["unigram_loss"] = unigram_loss(lab.dataset.train)
    high = lrs[len(lrs) // 2:]  # "the high learning rates": the sweep's top half, fixed with the grid
    # one entry per (seed, high rate), in the same order: the pairs
    for key in ("pre|warm", "pre|warm|embednorm"):
        measured[f"{key.replace('|', '_')}_diverged_high"] = [int(runs[key, lr][i]["status"] == "diverged")
                                                              for lr in high for i in range(len(seeds))]
    # every (seed, rate) of the sweep, in the same order: the pairs
    for key in ("pre|warm", "pre|warm|sandwich"):
        measured[f"{key.replace('|', '_')}_diverged"] = [int(runs[key, lr][i]["status"] == "diverged")
                                                         for lr in lrs for i in range(len(seeds))]
    top = lrs[-1]
    measured["pre_warm_max_logit_top_lr"] = logits["pre|warm", top]
    measured["pre_warm_qknorm_max_logit_top_lr"] = logits["pre|warm|qknorm", top]
    no_more = C.ours("10%: 'no more sensitive' allows a tenth of warmup's own sensitivity, no more")
    claims = [
        C.claim("warmup.post_sensitive",
                "without warmup, Post-LN is more sensitive to the learning rate than with it",
                XIONG20, claim_values(measured, "post_nowarm_sensitivity", "post_warm_sensitivity",
                                      "post_warm_best_val", "unigram_loss"),
                C.given(trains("post_warm_best_val"),
                        C.above("post_nowarm_sensitivity", "post_warm_sensitivity", paired=True)),
                conditions + [TRAINS_ON_GRID]),
        C.claim("warmup.pre_not",
                "Pre-LN without warmup is no more sensitive to the learning rate than with it",
                XIONG20, claim_values(measured, "pre_nowarm_sensitivity", "pre_warm_sensitivity",
                                      "pre_warm_best_val", "unigram_loss"),
                C.given(trains("pre_warm_best_val"),
                        C.at_most("pre_nowarm_sensitivity", "pre_warm_sensitivity", 0.1, origin=no_more,
                                  paired=True)),
                conditions + [TRAINS_ON_GRID]),
        C.claim("warmup.post_lower_lr",
                "Post-LN's best learning rate is lower than Pre-LN's (both with warmup)", XIONG20,
                claim_values(measured, "post_warm_best_log10_lr", "pre_warm_best_log10_lr"),
                C.below("post_warm_best_log10_lr", "pre_warm_best_log10_lr", paired=True, absolute=True,
                        test="sign"),
                conditions
                + ["measured: log10 of the best learning rate on the grid per seed, a discrete outcome: "
                   "judged by the exact sign test over seeds (3 seeds cannot reach p < 0.05: 6 can)"]),
        C.claim("warmup.qk_norm_logits",
                f"qk-norm keeps the attention logits bounded: at the highest learning rate ({at[top]:g}) "
                "the largest logit is at least 2x lower with it", WORTSMAN23,
                claim_values(measured, "pre_warm_qknorm_max_logit_top_lr", "pre_warm_max_logit_top_lr"),
                C.below("pre_warm_qknorm_max_logit_top_lr", "pre_warm_max_logit_top_lr", 0.5, paired=True,
                        origin=C.ours("the papers show logits growing without a number to quote; 2x is the "
                                      "lab's margin")),
                conditions
                + ["differs: qk-norm is RMSNorm over head_dim (Wortsman et al.: LayerNorm)"]),
        C.claim("warmup.qk_norm_sensitivity",
                "qk-norm lowers the learning-rate sensitivity (Pre-LN with warmup)", WORTSMAN23,
                claim_values(measured, "pre_warm_qknorm_sensitivity", "pre_warm_sensitivity",
                             "pre_warm_best_val", "unigram_loss"),
                C.given(trains("pre_warm_best_val"),
                        C.below("pre_warm_qknorm_sensitivity", "pre_warm_sensitivity", paired=True)),
                conditions
                + ["differs: qk-norm is RMSNorm over head_dim (Wortsman et al.: LayerNorm)", TRAINS_ON_GRID]),
        C.claim("warmup.embed_norm_stable",
                "a LayerNorm after the embedding (Bloom's) makes fewer runs diverge at the high "
                f"learning rates ({', '.join(f'{at[v]:g}' for v in high)}; Pre-LN with warmup)", BLOOM22,
                claim_values(measured, "pre_warm_embednorm_diverged_high", "pre_warm_diverged_high"),
                C.below("pre_warm_embednorm_diverged_high", "pre_warm_diverged_high", paired=True,
                        absolute=True, test="sign", over=PAIRS),
                conditions + EMBED_NORM_CONDITIONS + [
                    "measured: diverged (1) or not (0) for each seed at each rate of the sweep's top half, "
                    "paired by seed and rate; judged by the exact sign test over the pairs that differ"]),
        C.claim("warmup.embed_norm_quality",
                "a LayerNorm after the embedding keeps the quality: at each setting's best learning rate on "
                "the grid its loss is within 2% of Pre-LN's without it (the article: Bloom's, possibly at "
                "some loss of quality; failing above the margin is that loss)", BLOOM22,
                claim_values(measured, "pre_warm_embednorm_best_val", "pre_warm_best_val", "unigram_loss"),
                C.given(trains("pre_warm_best_val"),
                        C.within("pre_warm_embednorm_best_val", "pre_warm_best_val", 0.02, origin=COMPARABLE,
                                 paired=True)),
                conditions + EMBED_NORM_CONDITIONS + [TRAINS_ON_GRID]),
        C.claim("warmup.sandwich_unstable",
                "Sandwich-LN (a norm on each branch's input and output) makes more runs diverge than Pre-LN "
                "over the learning-rate sweep (both with warmup): the article's 'Sandwich-LN can make "
                "training unstable and collapse'", GLM22,
                claim_values(measured, "pre_warm_sandwich_diverged", "pre_warm_diverged"),
                C.above("pre_warm_sandwich_diverged", "pre_warm_diverged", paired=True, absolute=True,
                        test="sign", over=PAIRS),
                conditions + [
                    "measured: diverged (1) or not (0) for each seed at each rate of the sweep, paired by "
                    "seed and rate (the table's diverged column: the exact count at each rate); judged by "
                    "the exact sign test over the pairs that differ",
                    "differs (GLM-130B): a 130B-parameter model whose collapse came after many steps; here "
                    "a 6-layer model over a few hundred steps"]),
    ]
    return {
        "title": f"Stability: learning-rate sweeps with and without warmup ({model['n_layers']} layers, "
                 "Xiong et al.'s model)",
        "question": "Does Post-LN need warmup where Pre-LN does not, do qk-norm and a norm after the "
                    "embedding keep high learning rates stable, and does Sandwich-LN?",
        "settings": {"train": tf, "model": {**model, **lab.model_over}, "lrs": [at[lr] for lr in lrs],
                     "warmup_steps": run_tf["warmup"],
                     "seeds": seeds, "beta2": tf["beta2"], "grad_clip": tf["grad_clip"],
                     "sweep": {k: list(v) for k, v in SWEEP.items()}},
        "columns": ["setting", "lr", "diverged", "val_loss", "val_std", "max_logit", "sensitivity",
                    "best_lr"],
        "rows": rows, "claims": claims,
        "series": {"curves": curves, "logits": {f"{k}|{at[lr]:g}": v for (k, lr), v in logits.items()}},
        "notes": [f"Each point: {len(seeds)} seeds; Adam beta2 = {tf['beta2']}, gradient clipping off "
                  f"({tf['grad_clip']}). 'diverged': the loss left 3x its first value or became non-finite; "
                  "it counts as the loss at init in the sensitivity. sensitivity and best_lr: per setting, "
                  "mean over seeds (best_lr: geometric mean). max_logit: the largest q.k / sqrt(head_dim) "
                  "over layers on a fixed validation batch, after training."],
    }
