"""Preset ``invariance``: what LayerNorm and RMSNorm are invariant to (Zhang & Sennrich 2019, Table 1).

LayerNorm removes a row's mean and divides by its spread, so its output does not change when a
constant is added to every input of a row (re-centering) or when the inputs are scaled
(re-scaling). RMSNorm only divides by the root mean square: re-scaling leaves it unchanged,
re-centering does not. The same holds for the weight matrix W that feeds the norm: scaling W
scales its outputs; adding one row vector to every row of W (W + 1 g^T) adds the same number g.z
to every output of a row. Checked exactly (float64) on the op and on a whole model, then in
training: shift noise added to every norm's input leaves LayerNorm's loss where it was and costs
RMSNorm. Two more exact facts the articles derive sit beside them: with weight 1, RMSNorm's output
lies on the sphere of radius sqrt(d) (its rows have RMS 1); and LayerNorm computes the same in
training and evaluation, where BatchNorm switches from the batch's statistics to running ones.
"""

from __future__ import annotations

import math

import torch

from normlab import claims as C
from normlab import data as D
from normlab import functional as F
from normlab.experiments.common import (COMPARABLE, SHEN20, WORSE, ZHANG19, curves_of, claim_values,
                                        round_sig, lm_sizes, stats, trains, unigram_loss)
from normlab.experiments.lab import Lab
from normlab.model import Decoder

KINDS = ("layernorm", "rmsnorm")
# std of the per-row shift added to every norm's input in training, as a fraction of that row's RMS:
# a small and a large re-centering, both below the row's own scale (fixed before any run)
SHIFT_NOISES = (0.1, 0.5)
SCALE, SHIFT = 7.5, 3.0  # the transformations' factor and offset (any nonzero values would do)
OP_TRANSFORMS = ("input_shift", "input_scale", "weight_scale", "weight_recenter")
MODEL_TRANSFORMS = ("weight_scale", "weight_recenter")
# Which transformation leaves which norm unchanged (the paper's Table 1)
INVARIANT = {"layernorm": set(OP_TRANSFORMS), "rmsnorm": {"input_scale", "weight_scale"}}
# eps blurs the invariance by eps / variance (1e-5 of it for a small branch output at init); the paper's
# argument has none
EXACT_EPS = 0.0


def _rel_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def op_changes(norm: str, d: int, rows: int, seed: int) -> dict:
    """Relative change of the norm's output (float64) under each transformation of its input or
    of the matrix W that produces that input (y = norm(z W^T))."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, d, generator=gen, dtype=torch.float64)
    W = torch.randn(d, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
    g = torch.randn(d, generator=gen, dtype=torch.float64) / math.sqrt(d)
    w = 1 + 0.2 * torch.randn(d, generator=gen, dtype=torch.float64)
    b = 0.2 * torch.randn(d, generator=gen, dtype=torch.float64)
    shift = SHIFT * torch.randn(rows, 1, generator=gen, dtype=torch.float64)

    def apply(x):
        if norm == "layernorm":
            return F.layer_norm(x, w, b, EXACT_EPS, backend="reference")
        return F.rms_norm(x, w, EXACT_EPS, backend="reference")

    x = z @ W.T
    y = apply(x)
    return {"input_shift": _rel_change(apply(x + shift), y), "input_scale": _rel_change(apply(SCALE * x), y),
            "weight_scale": _rel_change(apply(z @ (SCALE * W).T), y),
            "weight_recenter": _rel_change(apply(z @ (W + g[None, :]).T), y)}


@torch.no_grad()
def geometry(d: int, rows: int, seed: int) -> dict:
    """Float64: the largest relative distance of an RMSNorm output row (weight 1, eps 0) from the
    sphere of radius sqrt(d), over rows of scales 1e-3 to 1e3; and the relative change of
    LayerNorm's and BatchNorm's outputs (random weights) between train() and eval() on one batch,
    BatchNorm's running statistics updated once by that batch, as in training."""
    from normlab.nn import build_norm

    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 3, rows, dtype=torch.float64)[:, None]
    x = torch.randn(rows, d, generator=gen,
                    dtype=torch.float64) * scales + torch.randn(rows, 1, generator=gen, dtype=torch.float64)
    y = F.rms_norm(x, None, EXACT_EPS, backend="reference")
    out = {"rmsnorm_sphere": (y.norm(dim=-1) / math.sqrt(d) - 1).abs().max().item()}
    batch = torch.randn(4, rows, d, generator=gen, dtype=torch.float64) * 3 + 1  # (B, T, d)
    for kind in ("layernorm", "batchnorm"):
        torch.manual_seed(seed)
        norm = build_norm(kind, d, **({"backend": "reference"} if kind == "layernorm" else {})).double()
        for p in norm.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
        train = norm.train()(batch)
        out[f"{kind}_train_eval"] = _rel_change(norm.eval()(batch), train)
    return out


@torch.no_grad()
def model_changes(cfg, batch, seed: int) -> dict:
    """Relative change of a float64 model's logits when every branch's output projection (the
    matrix feeding the sandwich norm on the branch) is scaled, or re-centered (W + 1 g^T)."""
    torch.manual_seed(seed)
    model = Decoder(cfg).double().eval()
    x, _ = batch
    base, _ = model(x)
    out = {}
    for name in MODEL_TRANSFORMS:
        saved = {}
        gen = torch.Generator().manual_seed(seed + 1)
        for block in model.blocks:
            for proj in (block.attn.wo, block.mlp.down):
                saved[proj] = proj.weight.clone()
                if name == "weight_scale":
                    proj.weight.mul_(SCALE)
                else:
                    d_in = proj.weight.shape[1]
                    proj.weight.add_(torch.randn(d_in, generator=gen,
                                                 dtype=torch.float64)[None, :] / math.sqrt(d_in))
        logits, _ = model(x)
        out[name] = _rel_change(logits, base)
        for proj, weight in saved.items():
            proj.weight.copy_(weight)
    return out


def preset_invariance(lab: Lab) -> dict:
    train_fields, model = lm_sizes(lab)
    seeds = lab.seeds(3, 3)
    runs = {(norm, noise): [lab.run(f"{norm}-s{seed}" if not noise else f"{norm}-shift{noise:g}-s{seed}",
                                    train_fields,
                                    {**model, "placement": "pre"},
                                    {"norm": norm, "seed": seed,
                                     **({"norm_shift_noise": noise} if noise else {})}, tune=True)
                            for seed in lab.arm_seeds(f"{norm}-shift{noise:g}" if noise else norm, seeds, 3)]
            for norm in KINDS for noise in (0.0, *SHIFT_NOISES)}
    for noise in SHIFT_NOISES:
        lab.plan_equivalence(f"layernorm-shift{noise:g}", "layernorm", 0.02)
    d, rows = lab.pick((256, 64), (1024, 256), tiny=(32, 8))
    tf = {**train_fields, **lab.train_over}
    batch = D.Batches(lab.dataset.val, 2, tf["seq_len"], seed=31).next()
    exact_model = {**model, "placement": "sandwich", "norm_eps": EXACT_EPS, "backend": "reference"}
    exact = lab.job("exact", {"d": d, "rows": rows, "model": exact_model, "over": lab.model_over,
                              "scale": SCALE, "shift": SHIFT},
                    lambda: {norm: {"op": op_changes(norm, d, rows, seed=41),
                                    "model": model_changes(lab.model_config({**exact_model, "norm": norm}),
                                                           batch, seed=42)}
                             for norm in KINDS})
    facts = lab.job("geometry", {"d": d, "rows": rows}, lambda: geometry(d, rows, seed=43))
    columns = ["norm", "where", "transform", "relative_change", "invariant_in_theory", "lr", "val_loss",
               "val_std"]
    table, measured = [], {"unigram_loss": unigram_loss(lab.dataset.train)}
    for norm in KINDS:
        changes = {(where, name): exact[norm][where][name]
                   for where, names in (("op", OP_TRANSFORMS), ("model", MODEL_TRANSFORMS)) for name in names}
        for (where, name), change in changes.items():
            table.append({"norm": norm, "where": where, "transform": name,
                          "relative_change": round_sig(change, 3),
                          "invariant_in_theory": name in INVARIANT[norm]})
        measured[f"{norm}_invariant_max_change"] = max(c for (_, n), c in changes.items()
                                                       if n in INVARIANT[norm])
        moved = [c for (_, n), c in changes.items() if n not in INVARIANT[norm]]
        if moved:
            measured[f"{norm}_recentering_min_change"] = min(moved)
        for noise in (0.0, *SHIFT_NOISES):
            rs = runs[norm, noise]
            key = f"{norm}_shift{noise:g}_val" if noise else f"{norm}_val"
            measured[key] = [r["val_loss"] for r in rs]
            val = stats(measured[key])
            table.append({"norm": norm, "where": "training",
                          "lr": lab.arm_lr(f"{norm}-shift{noise:g}" if noise else norm),
                          "transform": f"shift noise {noise:g} x row RMS" if noise else "none",
                          "val_loss": round_sig(val["mean"]), "val_std": round_sig(val["std"], 2)})
    measured.update({f"{k}": v for k, v in facts.items()})
    rounding = C.ours("1e-9: float64 rounding through a model is ~1e-14; a broken invariance moves the "
                      "output by order 1")
    moves = C.ours("1e-3: a million times the rounding bound of the invariance claims, so both cannot hold "
                   "at once")
    exact_conditions = [
        "matches: Table 1's transformations (input re-centering and re-scaling; weight-matrix re-scaling and "
        "re-centering) of the norm alone, in exact (float64) arithmetic with eps = 0",
        "matches: on a whole model, the matrices that feed a norm directly (the branch output projections "
        "under the sandwich placement) scaled or re-centered, and the logits compared",
        "differs: random inputs and a model at initialization (the paper proves the invariances; it does "
        "not measure them)",
    ]
    geometry_conditions = [
        "matches: float64, eps = 0, rows of scales 1e-3 to 1e3 with an offset (the sphere); one batch of "
        f"shape (4, {rows}, {d}) through a LayerNorm and a BatchNorm with random weights in train() and then "
        "eval() mode",
        "differs: the articles derive these facts; the lab computes them on random inputs",
    ]
    trained_conditions = [
        "matches: the norm's input re-centered by a random constant per row, of std "
        f"{' and '.join(f'{n:g}' for n in SHIFT_NOISES)} times that row's own RMS (a small and a large "
        "shift, both below the signal), at every norm, every step, in training only",
        "differs: the paper states the invariance; training with shift noise is the lab's test of what it "
        "buys, on a 4-layer Pre-LN decoder on Shakespeare characters",
    ]
    claims = [
        C.claim("invariance.layernorm_exact",
                "LayerNorm's output does not change when its input is re-centered or "
                "re-scaled, or when the weight matrix feeding it is re-scaled or re-centered", ZHANG19,
                claim_values(measured, "layernorm_invariant_max_change"),
                C.at_most("layernorm_invariant_max_change", 1e-9,
                          point="the largest relative change over the transformations",
                          origin=rounding), exact_conditions),
        C.claim("invariance.rmsnorm_scale",
                "RMSNorm's output does not change when its input or the weight matrix feeding "
                "it is re-scaled", ZHANG19, claim_values(measured, "rmsnorm_invariant_max_change"),
                C.at_most("rmsnorm_invariant_max_change", 1e-9,
                          point="the largest relative change over the re-scalings",
                          origin=rounding), exact_conditions),
        C.claim("invariance.rmsnorm_not_recentering",
                "RMSNorm is not invariant to re-centering: shifting its input, or "
                "re-centering the weight matrix feeding it, changes its output", ZHANG19,
                claim_values(measured, "rmsnorm_recentering_min_change"),
                C.at_least("rmsnorm_recentering_min_change", 1e-3,
                           point="the smallest relative change over the re-centerings",
                           origin=moves), exact_conditions),
        C.claim("invariance.rmsnorm_sphere",
                "with weight 1, RMSNorm's output lies on the sphere of radius sqrt(d): "
                "every row's norm is sqrt(d), whatever the row's scale", ZHANG19,
                claim_values(measured, "rmsnorm_sphere"),
                C.at_most("rmsnorm_sphere", 1e-9,
                          point="the largest relative distance of a row from the sphere",
                          origin=rounding), geometry_conditions),
        C.claim("invariance.layernorm_train_eval",
                "LayerNorm computes the same in training and in evaluation; "
                "BatchNorm does not (it switches to running statistics)", SHEN20,
                claim_values(measured, "layernorm_train_eval", "batchnorm_train_eval"),
                C.all_of(C.at_most("layernorm_train_eval", 1e-9,
                                   point="the relative change of the output, train to eval",
                                   origin=rounding),
                         C.at_least("batchnorm_train_eval", 1e-3,
                                    point="the relative change of the output, train to eval",
                                    origin=moves)), geometry_conditions),
        C.claim("invariance.layernorm_shift_trained",
                "trained with shift noise in every norm's input (at both levels), "
                "LayerNorm ends where it does without it (within 2%), where it trains", ZHANG19,
                claim_values(measured, *[f"layernorm_shift{n:g}_val" for n in SHIFT_NOISES], "layernorm_val",
                             "unigram_loss"),
                C.given(trains("layernorm_val"),
                        C.all_of(*[C.within(f"layernorm_shift{n:g}_val", "layernorm_val", 0.02,
                                            origin=COMPARABLE, paired=True)
                                   for n in SHIFT_NOISES])), trained_conditions),
        C.claim("invariance.rmsnorm_shift_trained",
                f"trained with the larger shift noise ({SHIFT_NOISES[-1]:g} of each "
                "row's RMS), RMSNorm ends at least 2% worse than without it, where it trains", ZHANG19,
                claim_values(measured, f"rmsnorm_shift{SHIFT_NOISES[-1]:g}_val", "rmsnorm_val",
                             "unigram_loss"),
                C.given(trains("rmsnorm_val"),
                        C.above(f"rmsnorm_shift{SHIFT_NOISES[-1]:g}_val", "rmsnorm_val", 0.02,
                                 origin=WORSE, paired=True)), trained_conditions),
    ]
    return {
        "title": "Invariances: re-centering and re-scaling",
        "question": "Which transformations of a norm's input and weights leave LayerNorm and RMSNorm "
                    "unchanged, and does it matter in training?",
        "settings": {"exact": {"d": d, "rows": rows, "scale": SCALE, "shift": SHIFT, "eps": EXACT_EPS,
                               "model": {**exact_model, **lab.model_over}},
                     "train": {**train_fields, **lab.train_over},
                     "model": {**model, **lab.model_over, "placement": "pre"},
                     "shift_noise": list(SHIFT_NOISES), "shift_noise_is": "a fraction of each row's RMS",
                     "seeds": seeds},
        "columns": columns,
        "rows": [{c: r.get(c) for c in columns} for r in table],
        "claims": claims,
        "series": {"exact": exact, "geometry": facts,
                   "invariant": {k: sorted(v) for k, v in INVARIANT.items()},
                   "runs": {f"{norm}|{noise:g}": [curves_of(r) for r in runs[norm, noise]]
                            for norm, noise in runs}},
        "notes": ["relative_change: ||y' - y|| / ||y|| in float64 after the transformation (input shift: a "
                  f"random constant per row, std {SHIFT:g}; scales: x {SCALE:g}; weight re-centering: W + 1 "
                  "g^T, g random). The model rows transform every branch's output projection of a "
                  f"sandwich-placement model and compare its logits. Training rows: {len(seeds)} seeds, "
                  f"without and with shift noise of std {' and '.join(f'{n:g}' for n in SHIFT_NOISES)} times "
                  "each row's RMS in every norm's input."],
    }
