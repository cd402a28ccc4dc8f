"""The error bound every backend is held to, in one place.

A result computed in some dtype is compared with the float64 reference (the truth) element by
element. When a low-precision reference (the same math computed by :mod:`normlab.reference` in
that dtype) is given, the bound is relative to it, as in flash-attn's tests:

    |fast - truth| <= 2 * |lowp_ref - truth| + atol + rtol * |truth|

so a fast kernel may be at most twice as wrong as plain torch in the same dtype, plus about one
rounding step. Without a low-precision reference the bound is atol + rtol * |truth|. nan must
match nan and inf must match inf (same sign), so bad rows cannot hide.
"""

from __future__ import annotations

import torch
from torch import Tensor

# (atol, rtol) per dtype. rtol is about one unit in the last place of the dtype's output (two
# for bf16: the llama cast rounds twice); fp32 allows for long fp32 sums over 65537 features.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-6, 2e-6),
    torch.float16: (1e-5, 2.0**-10),
    torch.bfloat16: (1e-4, 2.0**-7),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES[dtype]


def assert_close(
    actual: Tensor,
    truth: Tensor,
    *,
    lowp: Tensor | None = None,
    dtype: torch.dtype | None = None,
    name: str = "output",
    scale: float = 1.0,
    reduction: bool = False,
) -> None:
    """Assert ``actual`` is within the bound of ``truth`` (a float64 result).

    ``dtype`` picks the tolerance (default: actual's dtype). ``scale`` widens atol and rtol.
    ``reduction=True`` is for sums over many rows (weight and bias gradients): each element is a
    sum of rounding errors of random sign, so a per-element comparison with the low-precision
    reference is a coin toss; the bound then holds for the largest error over the tensor
    (flash-attn's rule): max|fast - truth| <= 2 max|lowp - truth| + atol + rtol max|truth|.
    """
    if actual.shape != truth.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(truth.shape)}")
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    atol, rtol = atol * scale, rtol * scale
    a = actual.detach().to(torch.float64).cpu()
    t = truth.detach().to(torch.float64).cpu()
    nan_a, nan_t = torch.isnan(a), torch.isnan(t)
    if not torch.equal(nan_a, nan_t):
        where = (nan_a != nan_t).nonzero()[0].tolist()
        raise AssertionError(f"{name}: nan pattern differs from the reference, first at index {where}")
    inf_t = torch.isinf(t)
    if not torch.equal(a[inf_t], t[inf_t]) or torch.isinf(a[~inf_t]).any():
        raise AssertionError(f"{name}: inf pattern differs from the reference")
    fin = torch.isfinite(t)
    a, t = a[fin], t[fin]
    if a.numel() == 0:
        return
    err = (a - t).abs()
    lp_err = (lowp.detach().to(torch.float64).cpu()[fin] - t).abs() if lowp is not None else torch.zeros_like(t)
    if reduction:  # one bound for the whole tensor
        bound = atol + rtol * t.abs().max() + 2 * lp_err.max()
        i = int(err.argmax())
        if err[i] > bound:
            raise AssertionError(
                f"{name}: max error {err[i].item():.3g} > bound {bound.item():.3g} ({dtype or actual.dtype}, "
                f"whole-tensor rule); at the worst element got {a[i].item():.6g}, expected {t[i].item():.6g}"
            )
        return
    bound = atol + rtol * t.abs() + 2 * lp_err
    bad = err > bound
    if bad.any():
        i = int((err - bound).argmax())
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {err.numel()} elements out of bound ({dtype or actual.dtype}); "
            f"worst: got {a[i].item():.6g}, expected {t[i].item():.6g}, error {err[i].item():.3g} "
            f"> bound {bound[i].item():.3g}; max error {err.max().item():.3g}"
        )
