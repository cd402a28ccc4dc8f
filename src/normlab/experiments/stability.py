"""Preset ``stability``: LayerNorm's 1/sqrt(var + eps) on rows of small spread, against RMSNorm.

The articles on RMSNorm say it is the more numerically stable norm: when a row's variance is small,
LayerNorm's rstd = 1/sqrt(var + eps) is huge, and so is its input gradient. A row x = c + s z (mean
c, spread s, z of mean 0 and unit spread) makes this exact. LayerNorm's Jacobian is rstd times a
projection, so ||dx|| <= ||dy|| / sqrt(s^2 + eps), a bound it meets within the few directions the
projection removes: the gain grows as the spread shrinks, until eps caps it at 1/sqrt(eps).
RMSNorm's rstd is 1/sqrt(c^2 + s^2 + eps), so its gain never passes 1/|c| whatever the spread.
Exact (float64) on the op over s/c from 1 down to 1e-6; then the fused kernels in bf16 (with fp32
statistics) on the same rows, held to the library's error bound (normlab.testing): if they stay
within it, the instability is the math, not the precision.
"""

from __future__ import annotations

import math

import torch

from normlab import claims as C
from normlab import functional as F
from normlab.experiments.common import claim_values, round_sig
from normlab.experiments.lab import Lab
from normlab.kernels import available_backends
from normlab.testing import assert_close

EPS = 1e-5  # torch's LayerNorm default, for both norms
MEAN = 1.0  # c: the rows' mean
SPREADS = (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)  # s / c, as the sweep asks
SOURCE = ("the articles on RMSNorm: 'when var + eps is small, 1/sqrt(var + eps) is huge and gradients "
          "explode'; RMSNorm divides by the RMS, which a row's mean keeps away from 0")
NORMS = ("layernorm", "rmsnorm")


def rows(d: int, n: int, spread: float, seed: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of mean MEAN and spread ``spread * MEAN`` (z centred and scaled to unit spread
    exactly, in float64), and an output gradient dy ~ N(0, 1), both cast to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=gen, dtype=torch.float64)
    z = (z - z.mean(-1, keepdim=True)) / z.std(-1, correction=0, keepdim=True)
    dy = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return (MEAN + spread * MEAN * z).to(dtype), dy.to(dtype)


def _call(norm: str, x: torch.Tensor, backend: str) -> torch.Tensor:
    if norm == "layernorm":
        return F.layer_norm(x, None, None, EPS, backend=backend)
    return F.rms_norm(x, None, EPS, backend=backend)


def gains(norm: str, d: int, n: int, seed: int) -> list[float]:
    """The largest input-gradient gain ||dx|| / ||dy|| over the rows at each spread, exact."""
    out = []
    for i, s in enumerate(SPREADS):
        x, dy = rows(d, n, s, seed + i)
        x.requires_grad_()
        (dx,) = torch.autograd.grad(_call(norm, x, "reference"), x, dy)
        out.append((dx.norm(dim=-1) / dy.norm(dim=-1)).max().item())
    return out


def bf16_misses(norm: str, d: int, n: int, seed: int, backend: str) -> list[str]:
    """The fused kernels in bf16 on the sweep's rows: each output or input gradient that leaves
    the library's error bound against the float64 truth (normlab.testing), by name."""
    missed = []
    for i, s in enumerate(SPREADS):
        x, dy = rows(d, n, s, seed + i, torch.bfloat16)
        results = {}
        for how, (dtype, impl) in {"fast": (None, backend), "lowp": (None, "reference"),
                                   "truth": (torch.float64, "reference")}.items():
            xi = (x.to(dtype) if dtype else x).detach().requires_grad_()
            y = _call(norm, xi, impl)
            (dx,) = torch.autograd.grad(y, xi, dy.to(y.dtype))
            results[how] = (y, dx)
        xd = x.double()
        centred = xd - xd.mean(-1, keepdim=True) if norm == "layernorm" else xd
        rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + EPS)
        # LayerNorm's x - mean cancels on rows of close values: its rounding scales with the terms
        # |x| rstd, not with the output (as the kernels' tests bound it: normlab.testing)
        out_terms = (xd.abs() + xd.mean(-1, keepdim=True).abs()) * rstd if norm == "layernorm" else None
        grad_terms = rstd * dy.double().abs()
        for j, (what, terms, rule) in enumerate((("output", out_terms, "element"),
                                                 ("input gradient", grad_terms, "row"))):
            try:
                assert_close(results["fast"][j], results["truth"][j], lowp=results["lowp"][j],
                             dtype=torch.bfloat16,
                             rule=rule, magnitude=terms, name=what)
            except AssertionError as err:
                missed.append(f"s/c {s:g}: {err}")
    return missed


def preset_stability(lab: Lab) -> dict:
    d, n = lab.pick((1024, 16), (4096, 64), tiny=(64, 4))
    backend = "cpu" if "cpu" in available_backends() else "reference"  # without numba: the reference, said so
    exact = lab.job("gains", {"d": d, "rows": n, "eps": EPS, "mean": MEAN, "spreads": list(SPREADS)},
                    lambda: {norm: gains(norm, d, n, seed=51) for norm in NORMS})
    fused = lab.job("bf16", {"d": d, "rows": n, "eps": EPS, "mean": MEAN, "spreads": list(SPREADS),
                             "backend": backend},
                    lambda: {norm: bf16_misses(norm, d, n, seed=61, backend=backend) for norm in NORMS})
    ln, rms = exact["layernorm"], exact["rmsnorm"]
    measured = {
        # LayerNorm's gain against its bound 1/sqrt(s^2 + eps): at most 1 at every spread
        "layernorm_gain_over_bound": max(g * math.sqrt((s * MEAN) ** 2 + EPS) for g, s in zip(ln, SPREADS)),
        "layernorm_gain_growth": ln[-1] / ln[0],  # the smallest spread's gain over the unit spread's
        "rmsnorm_gain_times_mean": max(g * abs(MEAN) for g in rms),  # against RMSNorm's bound 1/|c|
        "bf16_out_of_bound": sum(len(v) for v in fused.values()),
    }
    table = [{"spread": s, "layernorm_gain": round_sig(a),
              "layernorm_bound": round_sig(1 / math.sqrt((s * MEAN) ** 2 + EPS)),
              "rmsnorm_gain": round_sig(b), "rmsnorm_bound": round_sig(1 / abs(MEAN))}
             for s, a, b in zip(SPREADS, ln, rms)]
    conditions = [f"matches: rows of mean {MEAN:g} and spread s from {SPREADS[0]:g} down to {SPREADS[-1]:g} "
                  f"times the mean, eps = {EPS:g} (torch's LayerNorm default) for both norms, the exact "
                  "derivative in float64",
                  f"matches: the fused kernels ({backend} backend) in bf16 with fp32 statistics on the same "
                  "rows, against the float64 truth on the same bf16 inputs",
                  "differs: the norm alone on constructed rows, not the activations of a trained model"]
    derivation = C.ours("the derivative's bound, not a tolerance: LayerNorm's Jacobian is rstd times a "
                        "projection, rstd = 1/sqrt(s^2 + eps); RMSNorm's rstd is 1/sqrt(c^2 + s^2 + eps) <= "
                        "1/|c|; 1e-9 leaves room for float64 rounding")
    growth = C.ours("100: two orders of magnitude, below the 1/sqrt(eps) = 316 that eps caps the gain at, "
                    "so that the claim holds only if the gain really follows 1/sqrt(s^2 + eps)")
    claims = [
        C.claim("stability.layernorm_grows",
                "LayerNorm's input gradient grows as its rows' spread shrinks: it follows "
                "1/sqrt(s^2 + eps), at least 100 times larger at s/c = 1e-6 than at s/c = 1", SOURCE,
                claim_values(measured, "layernorm_gain_over_bound", "layernorm_gain_growth"),
                C.all_of(C.at_most("layernorm_gain_over_bound", 1.0 + 1e-9,
                                   point="the largest gain over its bound",
                                   origin=derivation),
                         C.at_least("layernorm_gain_growth", 100.0, point="the gain's growth over the sweep",
                                    origin=growth)), conditions[::2]),
        C.claim("stability.rmsnorm_bounded",
                "RMSNorm's input gradient stays bounded by 1/|mean| on the same rows, "
                "whatever their spread", SOURCE, claim_values(measured, "rmsnorm_gain_times_mean"),
                C.at_most("rmsnorm_gain_times_mean", 1.0 + 1e-9,
                          point="the largest gain times |c| over the sweep",
                          origin=derivation), conditions[::2]),
        C.claim("stability.bf16_within_bound",
                "in bf16 with fp32 statistics, both norms' fused kernels stay within the "
                "library's error bound on these rows (outputs and input gradients): the instability is the "
                "math, not "
                "the precision", "normlab's aim (DESIGN.md): exact norms",
                claim_values(measured, "bf16_out_of_bound"),
                C.at_most("bf16_out_of_bound", 0, point="outputs and gradients out of bound (a count)",
                          origin=C.ours("none: the bound of every kernel test (normlab.testing)")),
                conditions[1:]),
    ]
    return {
        "title": "Numerical stability: LayerNorm and RMSNorm on rows of small spread",
        "question": "Does LayerNorm's gradient explode when a row's variance is small, while RMSNorm's "
                    "stays bounded, and is that the math or the precision?",
        "settings": {"d": d, "rows": n, "eps": EPS, "mean": MEAN, "spreads": list(SPREADS),
                     "backend": backend},
        "columns": ["spread", "layernorm_gain", "layernorm_bound", "rmsnorm_gain", "rmsnorm_bound"],
        "rows": table, "claims": claims,
        "series": {"gains": exact, "spreads": list(SPREADS), "eps": EPS, "mean": MEAN,
                   "bf16_misses": fused},
        "notes": [f"{n} rows of {d} features at each spread s (as a fraction of the mean {MEAN:g}), dy ~ "
                  "N(0, 1); gain: the largest ||dx|| / ||dy|| over the rows, exact (float64). bounds: "
                  "1/sqrt(s^2 + eps) for LayerNorm, 1/|mean| for RMSNorm. In bf16 a spread below half an "
                  "ulp of the mean (2^-9 at 1) rounds away: those rows are constant, and LayerNorm's gain "
                  "there is its cap, 1/sqrt(eps)."],
    }
