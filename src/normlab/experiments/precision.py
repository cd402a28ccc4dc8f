"""Preset ``precision``: statistics in fp32 against statistics in the input's fp16/bf16."""

from __future__ import annotations

import statistics

import numpy as np
import torch
import torch.nn.functional as TF

from normlab import claims as C
from normlab import functional as F
from normlab import reference
from normlab.experiments.common import MICIK18, claim_values, round_sig
from normlab.experiments.lab import Lab


def precision_errors(op: str, dtype_name: str, scales, d: int, rows: int, seed: int) -> dict:
    """Max error (relative to the output's largest magnitude) against float64 of normlab's fused
    kernel, torch's own op and a naive version with statistics in the input dtype, at each scale;
    None where an output is not finite."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, d, generator=gen, dtype=torch.float64)
    w = (1 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64)).to(dtype)
    b = (0.1 * torch.randn(d, generator=gen, dtype=torch.float64)).to(dtype)
    eps = 1e-6 if op == "rms_norm" else 1e-5
    impls = {
        "rms_norm": {
            "normlab": lambda x: F.rms_norm(x, w, eps=eps),
            "torch": lambda x: TF.rms_norm(x, (d,), w, eps=eps),
            "naive": lambda x: reference.rms_norm(x, w, eps=eps, upcast=False),
        },
        "layer_norm": {
            "normlab": lambda x: F.layer_norm(x, w, b, eps=eps),
            "torch": lambda x: TF.layer_norm(x, (d,), w, b, eps=eps),
            "naive": lambda x: reference.layer_norm(x, w, b, eps=eps, upcast=False),
        },
    }[op]
    out = {name: [] for name in impls}
    for scale in scales:
        x = (base * scale).to(dtype)
        x64 = x.double()
        truth = (reference.rms_norm(x64, w.double(), eps=eps) if op == "rms_norm"
                 else reference.layer_norm(x64, w.double(), b.double(), eps=eps))
        top = truth.abs().max().item()
        for name, fn in impls.items():
            y = fn(x).double()
            out[name].append((y - truth).abs().max().item() / top if torch.isfinite(y).all() else None)
    return out


EPS16 = {"bf16": 2.0**-7, "fp16": 2.0**-10}  # machine epsilon
BROKEN = 0.1  # an output off by more than 10% of its scale is broken, not imprecise


def _median_eps(errors: list, dtype_name: str) -> float | None:
    """The median error over the scales where the output is finite, in machine epsilons."""
    finite = [v for v in errors if v is not None]
    return statistics.median(finite) / EPS16[dtype_name] if finite else None


def preset_precision(lab: Lab) -> dict:
    exps = lab.pick(np.arange(-4, 4.01, 0.5), np.arange(-4, 4.01, 0.25), tiny=np.arange(-4, 4.01, 1.0))
    scales = [float(10.0**e) for e in exps]
    d, n = lab.pick((4096, 16), (4096, 64), tiny=(1024, 4))
    draws = lab.pick(4, 8, tiny=2)  # independent random inputs: the samples of the median-error claim
    ops, dtypes = ("rms_norm", "layer_norm"), ("bf16", "fp16")
    per_draw = lab.job("errors_per_draw", {"scales": scales, "d": d, "rows": n, "draws": draws},
                       lambda: [{f"{op}|{dt}": precision_errors(op, dt, scales, d, n, seed=7 + i)
                                 for op in ops for dt in dtypes}
                                for i in range(draws)])
    # the plot and the table: the worst error over the draws at each scale (None: not finite in some draw)
    errors = {key: {impl: [None if any(e[key][impl][j] is None for e in per_draw)
                           else max(e[key][impl][j] for e in per_draw)
                           for j in range(len(scales))] for impl in per_draw[0][key]} for key in per_draw[0]}
    rows, measured = [], {}
    for op in ops:
        for dt in dtypes:
            e = errors[f"{op}|{dt}"]
            for impl in ("normlab", "torch", "naive"):
                finite = [v for v in e[impl] if v is not None]
                bad = [s for s, v in zip(scales, e[impl]) if v is None or v > BROKEN]
                medians = [_median_eps(draw[f"{op}|{dt}"][impl], dt) for draw in per_draw]
                rows.append({"op": op, "dtype": dt, "impl": impl,
                             "max_err_in_eps": round_sig(max(finite) / EPS16[dt], 3) if finite else None,
                             "median_err_in_eps": round_sig(statistics.fmean(m for m in medians
                                                                             if m is not None), 3)
                             if any(m is not None for m in medians) else None,
                             "broken_scales": len(bad), "first_broken_scale": bad[0] if bad else None})
                measured[f"{op}_{dt}_{impl}_broken"] = len(bad)
                measured[f"{op}_{dt}_{impl}_max_eps"] = max(finite) / EPS16[dt] if finite else None
                measured[f"{op}_{dt}_{impl}_median_eps"] = medians
    combos = [(op, dt) for op in ops for dt in dtypes]
    conditions = ["matches: fp16/bf16 storage with reductions accumulated in fp32, against the same "
                  "arithmetic in the input dtype (the paper's rule for reductions such as normalization "
                  "statistics)",
                  "differs: the norm alone on random rows at scales 1e-4 to 1e4, not a network in training"]
    count = "a count of scales where some draw broke: one non-finite output is a failure"
    broken_why = C.ours("one broken scale is a failure; 'broken': non-finite, or off by more than 10% of "
                        "the output scale")
    claims = [
        C.claim("precision.fp16_overflow",
                "in fp16, statistics kept in the input dtype break (overflow or underflow: "
                "non-finite or >10% wrong output) over part of the activation range; fp32 statistics do not",
                MICIK18,
                claim_values(measured,
                             *[f"{op}_fp16_{i}_broken" for op in ops for i in ("naive", "normlab")]),
                C.all_of(*[C.at_least(f"{op}_fp16_naive_broken", 1, point=count, origin=broken_why)
                           for op in ops],
                         *[C.at_most(f"{op}_fp16_normlab_broken", 0, point=count, origin=broken_why)
                           for op in ops]),
                conditions),
        C.claim("precision.fp32_stats_exact",
                "with fp32 statistics the fused kernels stay within two machine epsilons of "
                "the float64 result at every scale, in bf16 and fp16", MICIK18,
                claim_values(measured, *[f"{op}_{dt}_normlab_max_eps" for op, dt in combos]),
                C.all_of(*[C.at_most(f"{op}_{dt}_normlab_max_eps", 2.0,
                                     point="the worst case over every scale and draw",
                                     origin=C.ours("2 eps: the output's rounding (0.5 eps) and the weight "
                                                   "multiply's, with "
                                                   "room for the fp32 statistics")) for op, dt in combos]),
                conditions),
        C.claim("precision.naive_bf16_worse",
                "where it does not break, bf16 arithmetic for the statistics still costs "
                "accuracy: the naive version's median error is at least twice the fused kernel's", MICIK18,
                claim_values(measured,
                             *[f"{op}_bf16_{i}_median_eps" for op in ops for i in ("naive", "normlab")]),
                C.all_of(*[C.above(f"{op}_bf16_naive_median_eps", f"{op}_bf16_normlab_median_eps", 1.0,
                                   over="input draws", paired=True,
                                   origin=C.ours("2x: one more rounding of the same size as the "
                                                 "output's own"))
                           for op in ops]), conditions),
    ]
    return {
        "title": "Why statistics are kept in fp32",
        "question": "What happens to RMSNorm and LayerNorm in bf16/fp16 when the statistics are not kept in "
                    "fp32?",
        "settings": {"d": d, "rows": n, "draws": draws, "scales": scales},
        "columns": ["op", "dtype", "impl", "max_err_in_eps", "median_err_in_eps", "broken_scales",
                    "first_broken_scale"],
        "rows": rows, "claims": claims, "series": {"errors": errors, "scales": scales, "eps": EPS16},
        "notes": [f"{draws} independent draws of x = scale * N(0, 1), {n} rows of d features, rounded to the "
                  "dtype; the table and plot show the worst draw, the median-error claim takes one median "
                  "per draw. error: largest |y - y64| over the tensor divided by the largest |y64|, in "
                  "units of the dtype's machine epsilon (bf16 2^-7, fp16 2^-10). naive: normlab's reference "
                  "with upcast=False (squares, mean and rsqrt in the input dtype); 'broken': non-finite or "
                  "more than 10% of the output scale off. fp16's largest value is 65504: a square overflows "
                  "once |x| passes 256.",
                  "normlab's rms_norm error is about twice torch's by design: it follows Llama's cast order "
                  "(the normalized x rounded to the dtype, then times the weight and rounded again: two "
                  "roundings), where torch's F.rms_norm multiplies in fp32 and rounds once, as normlab's "
                  "cast='gemma' does (tests/test_functional.py measures the mean error at 1.33x torch's, "
                  "and 1.00x with gemma). The statistics are fp32 in all three but naive."],
    }


# ======================================================================================= speed
