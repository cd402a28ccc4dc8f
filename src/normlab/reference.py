"""The math of every normalization layer, in plain torch: the truth every backend is tested against.

Everything here runs on any device and dtype and is differentiable by autograd. Statistics are
per row (over the last dimension) and, with ``upcast=True`` (the default), accumulated in float32,
or float64 for float64 input, whatever the input dtype. ``upcast=False`` computes in the input
dtype throughout: it is the naive implementation the ``precision`` experiment compares against,
not something to train with.

No input validation happens here; :mod:`normlab.functional` validates and then dispatches.

Notation: x has shape (..., d); w is the weight, b the bias; rstd = 1 / sqrt(var + eps).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "layer_norm",
    "rms_norm",
    "add_layer_norm",
    "add_rms_norm",
    "seq_batch_norm",
    "dyt",
    "derf",
    "partial_size",
    "stat_dtype",
]


def stat_dtype(dtype: torch.dtype, upcast: bool = True) -> torch.dtype:
    """The dtype statistics are accumulated in: float64 for float64, else float32 (or ``dtype``
    itself when ``upcast`` is False)."""
    if not upcast:
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def partial_size(d: int, partial: float | None) -> int:
    """Number of leading features pRMSNorm estimates the RMS from: k = ceil(p * d).

    Zhang & Sennrich's own code rounds down (int(d * p)); we round up so that k >= 1 for every
    0 < p <= 1 and p = 1 is exactly RMSNorm. The two agree whenever p * d is an integer, e.g. the
    paper's p = 6.25% with d a multiple of 16.
    """
    if partial is None:
        return d
    # The small tolerance keeps p * d that is an integer up to float rounding (0.07 * 100) at it.
    return max(1, min(d, math.ceil(partial * d - 1e-9)))


def layer_norm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    upcast: bool = True,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """LayerNorm (Ba et al., 2016): y = (x - mean) * rstd * w + b, biased variance.

    The variance is computed in two passes, mean((x - mean)^2), never as E[x^2] - E[x]^2, which
    cancels catastrophically for rows with a large mean. The affine part runs in the statistics
    dtype and the result is cast last (as torch's fused kernels do). ``out_dtype`` defaults to
    x's dtype; the fused add+norm uses it to normalize an fp32 sum into a bf16 output.
    """
    out_dtype = out_dtype or x.dtype
    xs = x.to(stat_dtype(x.dtype, upcast))
    mean = xs.mean(dim=-1, keepdim=True)
    xc = xs - mean
    var = (xc * xc).mean(dim=-1, keepdim=True)
    y = xc * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(y.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(out_dtype)


def rms_norm(
    x: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    eps_mode: str = "inside",
    cast: str = "llama",
    offset: float = 0.0,
    partial: float | None = None,
    upcast: bool = True,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """RMSNorm (Zhang & Sennrich, 2019) and its partial variant pRMSNorm.

    ms = mean(x[..., :k]^2) with k = d, or k = ceil(partial * d) for pRMSNorm; all d features
    are scaled.

    - ``eps_mode="inside"`` (Llama, torch): rstd = 1 / sqrt(ms + eps).
      ``eps_mode="outside"`` (the paper's own code): rstd = 1 / (sqrt(ms) + eps).
    - ``cast="llama"`` (Llama, Mistral, Qwen2/3): xhat = x * rstd in fp32, cast to the output
      dtype, then multiplied by (w + offset) in the output dtype:
      ``w * (x.float() * rstd).to(dtype)``.
      ``cast="gemma"`` (Gemma 1/2/3, OLMo 2, and torch's F.rms_norm): the multiply happens in
      fp32 and the cast is last: ``(x.float() * rstd * (offset + w.float())).to(dtype)``.
    - ``offset`` is added to the weight: Gemma stores w and applies 1 + w (weights init to 0).
    """
    out_dtype = out_dtype or x.dtype
    sdt = stat_dtype(x.dtype, upcast)
    xs = x.to(sdt)
    k = partial_size(x.shape[-1], partial)
    head = xs if k == x.shape[-1] else xs[..., :k]
    ms = (head * head).mean(dim=-1, keepdim=True)
    if eps_mode == "inside":
        rstd = torch.rsqrt(ms + eps)
    else:
        # sqrt's derivative is infinite at 0 and autograd multiplies it by 0 on an all-zero row
        # (padding): nan. y = x / (rms + eps) has the derivative 1 / eps there, which taking the
        # root only where ms != 0 gives; the values are sqrt's (0 stays 0, so eps = 0 stays nan;
        # a nan ms stays nan, which "ms > 0" would have made 0).
        rms = torch.where(ms == 0, torch.zeros_like(ms), torch.sqrt(ms.clamp_min(torch.finfo(sdt).tiny)))
        rstd = 1.0 / (rms + eps)
    xhat = xs * rstd
    if weight is None:
        return xhat.to(out_dtype)
    if cast == "llama":
        w = weight if offset == 0.0 else weight.to(sdt) + offset
        return xhat.to(out_dtype) * w.to(out_dtype)
    w = weight.to(sdt)
    if offset != 0.0:
        w = w + offset
    return (xhat * w).to(out_dtype)


def sum_dtype(x: Tensor, residual: Tensor, residual_in_fp32: bool) -> torch.dtype:
    """The dtype of the add variants' residual sum, here and in every fused backend.

    The sum keeps the residual stream's precision: the promoted dtype of the two inputs, or
    float32 (float64 stays float64) when residual_in_fp32 is set, as in flash-attn's fused
    add+norm, so a bf16 model can carry an fp32 residual stream."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return torch.promote_types(dtype, torch.float32) if residual_in_fp32 else dtype


def _residual_sum(x: Tensor, residual: Tensor, residual_in_fp32: bool) -> Tensor:
    dtype = sum_dtype(x, residual, residual_in_fp32)
    return x.to(dtype) + residual.to(dtype)


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual_in_fp32: bool = False,
    upcast: bool = True,
) -> tuple[Tensor, Tensor]:
    """Fused residual add + LayerNorm: s = x + residual, returns (layer_norm(s), s).

    The normalized output has x's dtype; s has the residual dtype (see ``sum_dtype``).
    """
    s = _residual_sum(x, residual, residual_in_fp32)
    return layer_norm(s, weight, bias, eps, upcast=upcast, out_dtype=x.dtype), s


def add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    eps_mode: str = "inside",
    cast: str = "llama",
    offset: float = 0.0,
    partial: float | None = None,
    residual_in_fp32: bool = False,
    upcast: bool = True,
) -> tuple[Tensor, Tensor]:
    """Fused residual add + RMSNorm: s = x + residual, returns (rms_norm(s), s).

    The normalized output has x's dtype; s has the residual dtype (see ``sum_dtype``).
    """
    s = _residual_sum(x, residual, residual_in_fp32)
    y = rms_norm(
        s, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial,
        upcast=upcast, out_dtype=x.dtype,
    )
    return y, s


def seq_batch_norm(
    x: Tensor,
    mask: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    training: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """BatchNorm over the (batch, time) positions of a sequence batch, honouring a padding mask.

    x is (B, T, d) (any leading shape works) and ``mask`` has x's leading shape, True at real
    tokens (None means every position is real). In training, per-feature mean and biased
    variance are taken over the real positions only, and the running statistics are updated in
    place: running = (1 - momentum) * running + momentum * batch, with the unbiased variance as
    torch's BatchNorm does (a batch of one real token, which has none, leaves the running variance
    as it was; torch's refuses such a batch). In eval the running statistics are used (batch
    statistics when there are none). Padded positions are normalized like the others; they do
    not influence anything.

    It is the baseline that shows why text models left BatchNorm: a token's output depends on
    its batch-mates, differs between train and eval mode, and in a causal LM sees statistics of
    future positions.
    """
    d = x.shape[-1]
    sdt = stat_dtype(x.dtype)
    xs = x.to(sdt).reshape(-1, d)  # (N, d), N = B * T
    use_batch_stats = training or running_mean is None or running_var is None
    if use_batch_stats:
        if mask is None:
            rows = xs
        else:
            rows = xs[mask.reshape(-1)]  # (n_real, d)
        n = rows.shape[0]
        if n == 0:
            raise ValueError("seq_batch_norm: mask selects no positions; need at least one real token")
        mean = rows.mean(dim=0)
        var = ((rows - mean) ** 2).mean(dim=0)
        if training and running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(momentum * mean.detach().to(running_mean.dtype))
                # one token has no unbiased variance (torch's BatchNorm refuses it): keep the running one
                if n > 1:
                    unbiased = var * (n / (n - 1))
                    running_var.mul_(1 - momentum).add_(momentum * unbiased.detach().to(running_var.dtype))
    else:
        mean = running_mean.to(sdt)
        var = running_var.to(sdt)
    y = (xs - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(sdt)
    if bias is not None:
        y = y + bias.to(sdt)
    return y.reshape(x.shape).to(x.dtype)


def seq_batch_norm_per_position(
    x: Tensor,
    mask: Tensor | None,
    running_mean: Tensor,
    running_var: Tensor,
    seen: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    training: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """BatchNorm with statistics per position, as the BatchNorm article's figure draws it: position
    t of a (B, T, d) batch is normalized over the batch's real tokens at t alone. ``running_mean``
    and ``running_var`` are (max_positions, d) and ``seen`` (max_positions,) counts the real
    tokens each position's running statistics came from; all three are updated in place in
    training (a position without real tokens in the batch keeps its statistics, one with a single
    real token its variance). In eval a position that never saw a real token in training has no
    statistics, and a real token there raises an error that names it. Padded positions are
    normalized like the others."""
    B, T, d = x.shape
    if T > running_mean.shape[0]:
        raise ValueError(f"position {running_mean.shape[0]} (of {T}) is past the last position with "
                         "statistics: per-position BatchNorm was built for "
                         f"max_positions={running_mean.shape[0]}")
    sdt = stat_dtype(x.dtype)
    xs = x.to(sdt)
    m = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask
    if training:
        w = m.to(sdt).unsqueeze(-1)  # (B, T, 1)
        n = w.sum(dim=0)  # (T, 1): real tokens at each position
        mean = (xs * w).sum(dim=0) / n.clamp(min=1)
        var = (((xs - mean) ** 2) * w).sum(dim=0) / n.clamp(min=1)
        has = n.squeeze(-1) > 0
        with torch.no_grad():
            unbiased = var * n / (n - 1).clamp(min=1)
            pairs = n.squeeze(-1) > 1  # a position with one real token has no unbiased variance
            rm, rv = running_mean[:T], running_var[:T]
            rm[has] = ((1 - momentum) * rm[has] + momentum * mean[has].detach().to(rm.dtype))
            rv[pairs] = ((1 - momentum) * rv[pairs] + momentum * unbiased[pairs].detach().to(rv.dtype))
            seen[:T] += n.squeeze(-1).to(seen.dtype)
        mean = torch.where(has.unsqueeze(-1), mean, torch.zeros_like(mean))
        var = torch.where(has.unsqueeze(-1), var, torch.ones_like(var))
    else:
        unseen = (seen[:T] == 0) & m.any(dim=0)
        if bool(unseen.any()):
            t = int(unseen.nonzero()[0])
            longest = int((seen > 0).nonzero().max()) + 1 if bool((seen > 0).any()) else 0
            raise ValueError(f"position {t} has no running statistics: no training batch had a real token "
                             f"there (the longest training sequence had {longest} positions)")
        mean, var = running_mean[:T].to(sdt), running_var[:T].to(sdt)
    y = (xs - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(sdt)
    if bias is not None:
        y = y + bias.to(sdt)
    return y.to(x.dtype)


def dyt(x: Tensor, alpha: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, *,
        upcast: bool = True) -> Tensor:
    """DyT (Zhu et al. 2025, "Transformers without Normalization"): weight * tanh(alpha * x) + bias,
    elementwise, with one learned scalar ``alpha`` (shape (1,) or ()). No statistics: computed in
    float32 (float64 for float64 input) and cast to x's dtype."""
    dt = stat_dtype(x.dtype, upcast)
    y = torch.tanh(alpha.to(dt) * x.to(dt))
    if weight is not None:
        y = y * weight.to(dt)
    if bias is not None:
        y = y + bias.to(dt)
    return y.to(x.dtype)


def derf(x: Tensor, alpha: Tensor, shift: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, *,
         upcast: bool = True) -> Tensor:
    """Derf (Chen et al. 2025, "Stronger Normalization-Free Transformers"): weight * erf(alpha * x +
    shift) + bias, elementwise, with two learned scalars ``alpha`` and ``shift`` (shape (1,) or ()).
    Computed as :func:`dyt` is, in float32 (float64 for float64 input), cast to x's dtype."""
    dt = stat_dtype(x.dtype, upcast)
    y = torch.erf(alpha.to(dt) * x.to(dt) + shift.to(dt))
    if weight is not None:
        y = y * weight.to(dt)
    if bias is not None:
        y = y + bias.to(dt)
    return y.to(x.dtype)
