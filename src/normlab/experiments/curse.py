"""Preset ``curse``: the curse of depth. Does the deeper half of a Pre-LN model's layers do less
than the first half, and does LayerNorm Scaling (each layer's norm outputs times 1/sqrt(l)) help?

Sun et al. (2025) find that in Pre-LN LLMs the deeper layers contribute little: the residual
stream's variance grows with depth, so a deep block's output is small against the stream it adds
to and the block is close to the identity. After training, each layer's contribution is measured
here as the rise of the validation loss when that layer's block is skipped (its output replaced
by its input) and as the cosine similarity of the block's input and output; the same for
Post-LN, where each layer's norm takes the stream back to unit scale.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from normlab import claims as C
from normlab import data as D
from normlab.experiments.common import (curves_of, claim_values, round_sig, arm_losses, deep_sizes, stats,
                                        trains, unigram_loss)
from normlab.experiments.lab import Lab
from normlab.train import load_run

SUN25 = ("Sun et al. (2025), The Curse of Depth in Large Language Models, NeurIPS (Pre-LN's deeper layers "
         "are close to the identity; LayerNorm Scaling lowers perplexity by 5-8% from 130M to 7B parameters)")
# arm -> the model fields it varies
ARMS = {"pre": {"placement": "pre"}, "post": {"placement": "post"},
        "lns": {"placement": "pre", "ln_scaling": True}}
HALF = C.ours("0.5: the deeper half's share when every layer contributes alike")
NOT_LESS = C.ours("5 points of share: a deeper half that carries at least 45% of the contribution is not "
                  "the near-identity deep layers of the curse")
CONDITIONS = [
    "matches (Sun et al.): a Llama-style decoder (RMSNorm, SwiGLU, rotary positions); each layer's "
    "contribution measured after training by skipping its block, and by the cosine of its input and output",
    "matches: each arm at its own learning rate (a pilot grid on seeds the test runs do not use, where the "
    "design has one), the same steps, warmup and seeds",
    "differs: a character LM of a few hundred steps (Sun et al.: 130M to 7B parameters on web text); the "
    "share is of the summed rise of the loss, each layer's rise counted from 0 (a layer whose removal "
    "lowers the loss adds none)",
]


@torch.no_grad()
def layer_contributions(run_folder: Path, val_tokens, batch_size: int, seq_len: int, n_batches: int) -> dict:
    """A trained run's validation loss on fixed batches, the rise of that loss when each layer's
    block is skipped (its output replaced by its input), and each block's mean cosine similarity
    of input and output over tokens."""
    model, _ = load_run(run_folder)
    model.eval()
    gen = D.Batches(val_tokens, batch_size, seq_len, seed=606)
    batches = [gen.next() for _ in range(n_batches)]
    cos = [[] for _ in model.blocks]

    def record(i):
        def hook(module, args, out):
            cos[i].append(torch.nn.functional.cosine_similarity(args[0].double(), out.double(),
                                                                dim=-1).mean().item())
        return hook

    hooks = [b.register_forward_hook(record(i)) for i, b in enumerate(model.blocks)]
    base = statistics.fmean(model(x, y)[1].item() for x, y in batches)
    for h in hooks:
        h.remove()
    rises = []
    for block in model.blocks:
        h = block.register_forward_hook(lambda module, args, out: args[0])  # the block as the identity
        rises.append(statistics.fmean(model(x, y)[1].item() for x, y in batches) - base)
        h.remove()
    return {"loss": base, "rise": rises, "cos": [statistics.fmean(c) for c in cos]}


def deep_share(rises: list[float]) -> float | None:
    """The deeper half's share of the summed contribution (each layer's rise counted from 0);
    None when no layer raises the loss."""
    clipped = [max(r, 0.0) for r in rises]
    total = sum(clipped)
    return sum(clipped[len(clipped) // 2:]) / total if total > 0 else None


def preset_curse(lab: Lab) -> dict:
    train_fields, model = deep_sizes(lab, 12, 24)
    # the Llama-style decoder's init
    model = {**model, "init": "gpt2", **lab.pick({}, {}, tiny={"n_layers": 4})}
    tf = {**train_fields, **lab.train_over}
    lr = lab.pick(2e-3, 1e-3, tiny=2e-3)
    warmup = max(1, tf["steps"] // 10)
    seeds = lab.seeds(3, 3)
    runs = {arm: [lab.run(f"{arm}-curse-s{seed}", train_fields, model,
                          {**fields, "lr": lr, "min_lr": lr / 10, "warmup": warmup, "seed": seed}, tune=True)
                  for seed in seeds]
            for arm, fields in ARMS.items()}
    n_batches = lab.pick(4, 10, tiny=2)

    def measure(r):
        if r["status"] == "diverged":
            return None
        return lab.job(f"layers-{r['run']}",
                       {"run": r["run"], "B": tf["batch_size"], "T": tf["seq_len"], "n": n_batches},
                       lambda: layer_contributions(lab.out / "runs" / r["run"], lab.dataset.val,
                                                   tf["batch_size"],
                                                   tf["seq_len"], n_batches))

    layers = {arm: [measure(r) for r in rs] for arm, rs in runs.items()}
    n_layers = {**model, **lab.model_over}["n_layers"]
    half = n_layers // 2
    rows, measured = [], {"unigram_loss": unigram_loss(lab.dataset.train)}
    for arm, rs in runs.items():
        ms = layers[arm]
        measured[f"{arm}_deep_share"] = [None if m is None else deep_share(m["rise"]) for m in ms]
        cos_first = stats([statistics.fmean(m["cos"][:half]) for m in ms if m])
        cos_deep = stats([statistics.fmean(m["cos"][half:]) for m in ms if m])
        rows.append({"arm": arm, "placement": ARMS[arm]["placement"],
                     "ln_scaling": ARMS[arm].get("ln_scaling", False),
                     "lr": lab.arm_lr(f"{arm}-curse"), **arm_losses(arm, rs, measured),
                     "deep_share": round_sig(stats(measured[f"{arm}_deep_share"])["mean"], 3),
                     "cos_first_half": round_sig(cos_first["mean"], 3),
                     "cos_deep_half": round_sig(cos_deep["mean"], 3)})
    claims = [
        C.claim("curse.pre_deep_weaker",
                f"in Pre-LN ({n_layers} layers), the deeper half's layers contribute less than the "
                "first half's: their share of the loss rise when single layers are skipped is below one "
                "half, where "
                "Pre-LN trains", SUN25, claim_values(measured, "pre_deep_share", "pre_val", "unigram_loss"),
                C.given(trains("pre_val"), C.below("pre_deep_share", 0.5, absolute=True, origin=HALF)),
                CONDITIONS),
        C.claim("curse.post_deep_not_weaker",
                "in Post-LN the deeper half's layers do not contribute less: their share is at "
                "least 45%, where Post-LN trains (at its own learning rate)", SUN25,
                claim_values(measured, "post_deep_share", "post_val", "unigram_loss"),
                C.given(trains("post_val"),
                        C.at_least("post_deep_share", 0.5, 0.05, absolute=True, origin=NOT_LESS)),
                CONDITIONS),
        C.claim("curse.lns_deeper",
                "LayerNorm Scaling raises the deeper half's share against Pre-LN without it, where "
                "Pre-LN trains", SUN25,
                claim_values(measured, "lns_deep_share", "pre_deep_share", "pre_val", "unigram_loss"),
                C.given(trains("pre_val"),
                        C.above("lns_deep_share", "pre_deep_share", paired=True, absolute=True)),
                CONDITIONS),
        C.claim("curse.lns_loss",
                "LayerNorm Scaling lowers the validation loss against Pre-LN without it, where Pre-LN "
                "trains", SUN25, claim_values(measured, "lns_val", "pre_val", "unigram_loss"),
                C.given(trains("pre_val"), C.below("lns_val", "pre_val", paired=True)),
                CONDITIONS + ["differs: a directional test (Sun et al.'s 5-8% is in perplexity at 130M-7B, "
                              "about 0.05-0.08 nats; at this size no magnitude is claimed)"]),
    ]
    mean_layers = {arm: {key: [statistics.fmean(v) for v in zip(*[m[key] for m in ms if m])]
                         for key in ("rise", "cos")}
                   for arm, ms in layers.items()}
    return {
        "title": f"The curse of depth: what each of {n_layers} layers contributes, Pre-LN, Post-LN and "
                 "LayerNorm Scaling",
        "question": "Do a Pre-LN model's deeper layers do less than its first ones, and does LayerNorm "
                    "Scaling fix it?",
        "settings": {"train": {**tf, "lr": lr, "warmup": warmup}, "model": {**model, **lab.model_over},
                     "seeds": seeds,
                     "eval_batches": n_batches},
        "columns": ["arm", "placement", "ln_scaling", "lr", "val_loss", "val_std", "seeds", "diverged",
                    "deep_share",
                    "cos_first_half", "cos_deep_half"],
        "rows": rows, "claims": claims,
        "series": {"layers": mean_layers,
                   "runs": {arm: [{"seed": s, **curves_of(r)} for s, r in zip(seeds, rs)]
                            for arm, rs in runs.items()}},
        "notes": [f"deep_share: the deeper half's (layers {half + 1}-{n_layers}) share of the summed rise of "
                  f"the validation loss when one layer's block is skipped at a time ({n_batches} fixed "
                  "validation batches, eval mode; mean over seeds). cos_*: the mean cosine similarity of a "
                  "block's input and output over tokens (1: the block changes nothing's direction). lns: "
                  "Pre-LN with each layer l's norm outputs times 1/sqrt(l)."],
    }
