"""The error bound every backend is held to, in one place.

A result computed in some dtype is compared with the float64 reference (the truth) element by
element. When a low-precision reference (the same math computed by :mod:`normlab.reference` in
that dtype) is given, the bound is relative to it, as in flash-attn's tests:

    |fast - truth| <= 2 * |lowp_ref - truth| + atol + rtol * |truth|

so a fast kernel may be at most twice as wrong as plain torch in the same dtype, plus about one
rounding step. Without a low-precision reference the bound is atol + rtol * |truth|. nan must
match nan and inf must match inf (same sign), so bad rows cannot hide; a finite truth too large
for the dtype counts as the inf it rounds to.
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


RULES = ("element", "row", "tensor")


def assert_close(
    actual: Tensor,
    truth: Tensor,
    *,
    lowp: Tensor | None = None,
    dtype: torch.dtype | None = None,
    name: str = "output",
    scale: float = 1.0,
    rule: str = "element",
    magnitude: Tensor | None = None,
) -> None:
    """Assert ``actual`` is within the bound of ``truth`` (a float64 result).

    ``dtype`` picks the tolerance (default: actual's dtype); ``scale`` widens atol and rtol.

    ``magnitude`` (truth's shape): the size of the terms the result is a difference of, used
    instead of |truth| in the rtol term where it is larger. Floating point guarantees accuracy
    relative to the terms, not to their difference: a norm's input gradient
    rstd * (g - xhat * mean(g * xhat)) nearly cancels when g is parallel to x (always, for d = 1),
    and then both the fast kernel and the low-precision reference carry errors of a few ulps of
    rstd * |g| on a tiny result.

    ``rule`` says over what the bound holds. "element": every element (outputs). "row": the
    largest error in each row (last dimension) against the largest low-precision error in that
    row, for input gradients; "tensor": over the whole tensor (flash-attn's rule), for weight and
    bias gradients. Why not per element there: gradients are sums over a row (or over rows) of
    terms that carry roundings which are part of the op's definition in low precision (the llama
    cast of xhat and of the weight, the residual sum kept in bf16). The fast kernel and the
    low-precision reference share those, the float64 truth does not, and where the reference's
    own rounding happens to cancel them for one element, a per-element bound is a coin toss.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if actual.shape != truth.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(truth.shape)}")
    dtype = dtype or actual.dtype
    atol, rtol = TOLERANCES[dtype]
    atol, rtol = atol * scale, rtol * scale
    a = actual.detach().to(torch.float64).cpu()
    t = truth.detach().to(torch.float64).cpu()
    nan_a, nan_t = torch.isnan(a), torch.isnan(t)
    if not torch.equal(nan_a, nan_t):
        where = (nan_a != nan_t).nonzero()[0].tolist()
        raise AssertionError(f"{name}: nan pattern differs from the reference, first at index {where}")
    inf_t = torch.isinf(t)
    # A finite truth beyond the dtype's range rounds to inf there, so that inf is a correct result
    rounded = t.to(dtype).to(torch.float64)
    overflow = torch.isfinite(t) & torch.isinf(rounded) & (a == rounded)
    if not torch.equal(a[inf_t], t[inf_t]) or torch.isinf(a[~inf_t & ~overflow]).any():
        raise AssertionError(f"{name}: inf pattern differs from the reference")
    if a.numel() == 0:
        return
    fin = torch.isfinite(t) & ~overflow
    zero = torch.zeros((), dtype=torch.float64)
    err = torch.where(fin, (a - t).abs(), zero)
    mag = t.abs()
    if magnitude is not None:
        mag = torch.maximum(mag, magnitude.detach().to(torch.float64).cpu().abs())
    mag = torch.where(fin & torch.isfinite(mag), mag, zero)
    lp_err = zero.expand_as(t)
    if lowp is not None:
        lp_err = torch.where(fin, (lowp.detach().to(torch.float64).cpu() - t).abs(), zero)
    if rule == "element":
        bound = atol + rtol * mag + 2 * lp_err
    else:
        dims = (-1,) if rule == "row" and t.dim() > 0 else tuple(range(t.dim()))

        def amax(v):
            return v.amax(dim=dims, keepdim=True) if t.dim() else v

        bound = (atol + rtol * amax(mag) + 2 * amax(lp_err)).expand_as(t)
    bad = err > bound
    if bad.any():
        i = int((err - bound).argmax())
        a, t, err, bound = a.reshape(-1), t.reshape(-1), err.reshape(-1), bound.reshape(-1)
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {err.numel()} elements out of bound ({dtype}, rule {rule!r}); "
            f"worst: got {a[i].item():.6g}, expected {t[i].item():.6g}, error {err[i].item():.3g} "
            f"> bound {bound[i].item():.3g}; max error {err.max().item():.3g}"
        )
