"""Preset ``eps``: RMSNorm's eps inside or outside the square root, on rows of tiny RMS.

rstd = 1 / sqrt(mean(x^2) + eps) (inside) or 1 / (sqrt(mean(x^2)) + eps) (outside). The input
gradient's Jacobian is rstd * (I - x x^T rstd^2 / d) inside the root, whose norm is at most rstd, so
||dx|| <= ||dy|| / sqrt(eps) on every row; outside, on an all-zero row (padding) it is exactly
||dy|| / eps, sqrt(1/eps) times more. Exact (float64), no training; the fused kernels are checked
against it in float32 on the same rows.
"""

from __future__ import annotations

import math

import torch

from normlab import claims as C
from normlab import functional as F
from normlab.experiments.common import claim_values, round_sig
from normlab.experiments.lab import Lab

EPS = 1e-6
SOURCE = ("where RMSNorm's eps goes: outside the square root in Zhang & Sennrich's (2019) own code, inside "
          "it in Llama, T5 and Gemma (normlab.reference, eps_mode)")


def eps_response(mode: str, scale: float, d: int, rows: int, seed: int, backend: str,
                 dtype: torch.dtype) -> dict:
    """The largest input-gradient gain ||dx|| / ||dy|| over rows of RMS ``scale`` (0: all-zero
    rows), and the output's RMS, for RMSNorm with eps ``mode`` ("inside" or "outside")."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, d, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    dy = torch.randn(rows, d, generator=gen, dtype=torch.float64).to(dtype)
    y = F.rms_norm(x, None, EPS, eps_mode=mode, backend=backend)
    (dx,) = torch.autograd.grad(y, x, dy)
    gain = (dx.double().norm(dim=-1) / dy.double().norm(dim=-1)).max().item()
    return {"gain": gain, "output_rms": y.double().pow(2).mean(-1).sqrt().max().item()}


def preset_eps(lab: Lab) -> dict:
    d, rows = lab.pick((1024, 16), (4096, 64), tiny=(64, 4))
    scales = [0.0, 1e-8, 1e-6, 1e-4, 1e-3, 1e-2, 1.0]
    results = lab.job("responses", {"d": d, "rows": rows, "scales": scales, "eps": EPS}, lambda: {
        f"{mode}|{impl}": [eps_response(mode, s, d, rows, 11 + i, *how) for i, s in enumerate(scales)]
        for mode in ("inside", "outside")
        for impl, how in (("exact", ("reference", torch.float64)), ("normlab", ("cpu", torch.float32)))
    })
    table, measured = [], {}
    for mode in ("inside", "outside"):
        exact, fused = results[f"{mode}|exact"], results[f"{mode}|normlab"]
        for s, e, f in zip(scales, exact, fused):
            table.append({"eps": mode, "row_rms": s, "gain": round_sig(e["gain"]),
                          "gain_normlab_fp32": round_sig(f["gain"]),
                          "output_rms": round_sig(e["output_rms"])})
        measured[f"{mode}_max_gain_sqrt_eps"] = max(e["gain"] for e in exact) * math.sqrt(EPS)
        measured[f"{mode}_zero_row_gain_eps"] = exact[0]["gain"] * EPS
        measured[f"{mode}_normlab_gain_rel_err"] = max(abs(f["gain"] - e["gain"]) / e["gain"]
                                                       for e, f in zip(exact, fused))
    conditions = ["matches: the exact derivative, computed in float64 on all-zero rows (padding) and on "
                  "rows of RMS 1e-8 to 1, with eps = 1e-6 as in Llama",
                  "differs: the norm alone on random rows, not the padded positions of a model in training"]
    derivation = C.ours("the derivative's bound, not a tolerance: the Jacobian rstd (I - x x^T rstd^2 / d) "
                        "has norm at most rstd <= 1/sqrt(eps) inside the root, and on a zero row outside it "
                        "rstd = 1/eps; 1e-9 leaves room for float64 rounding")
    claims = [
        C.claim("eps.inside_bounded",
                "with eps inside the square root, the input gradient is at most 1/sqrt(eps) times "
                "the output gradient on every row, all-zero padding rows included", SOURCE,
                claim_values(measured, "inside_max_gain_sqrt_eps"),
                C.at_most("inside_max_gain_sqrt_eps", 1.0 + 1e-9,
                          point="the largest gain over every row, exact (float64)",
                          origin=derivation), conditions),
        C.claim("eps.outside_amplifies",
                "with eps outside the square root, an all-zero row's input gradient is 1/eps "
                "times its output gradient: sqrt(1/eps) = 1000 times the bound inside", SOURCE,
                claim_values(measured, "outside_zero_row_gain_eps", "outside_max_gain_sqrt_eps"),
                C.at_least("outside_zero_row_gain_eps", 1.0 - 1e-9,
                           point="the zero rows' gain, exact (float64)",
                           origin=derivation), conditions),
        C.claim("eps.fused_matches",
                "normlab's fused kernels (float32) give these gains on the same rows, zero rows "
                "included, to within 1e-4", "normlab's aim (DESIGN.md): exact norms",
                claim_values(measured, "inside_normlab_gain_rel_err", "outside_normlab_gain_rel_err"),
                C.all_of(*[C.at_most(f"{m}_normlab_gain_rel_err", 1e-4,
                                     point="the worst relative difference over the rows",
                                     origin=C.ours("1e-4: float32 rounding of a gain near 1e6 leaves about "
                                                   "1e-7; a wrong eps placement or a lost zero row is off "
                                                   "by orders of magnitude"))
                           for m in ("inside", "outside")]), conditions),
    ]
    return {
        "title": "eps inside or outside the square root",
        "question": "How large can RMSNorm's input gradient get on rows of tiny RMS, padding rows included?",
        "settings": {"d": d, "rows": rows, "eps": EPS, "scales": scales},
        "columns": ["eps", "row_rms", "gain", "gain_normlab_fp32", "output_rms"],
        "rows": table, "claims": claims, "series": {"results": results, "scales": scales, "eps": EPS},
        "notes": [f"{rows} rows of {d} features at each RMS (0: all-zero rows), dy ~ N(0, 1); gain: the "
                  "largest ||dx|| / ||dy|| over the rows, in float64 (exact) and through normlab's fused "
                  "kernels in float32. Inside the root the gain stays at or below 1/sqrt(eps) = 1000 and "
                  "the output of a row far below sqrt(eps) is damped; outside it, such a row is scaled up "
                  "to RMS near 1 and the gain reaches 1/eps."],
    }
