"""torch.nn.functional's norms with torch's signatures, on normlab's backends.

``import normlab.torch_compat as F`` in place of ``torch.nn.functional`` for these two calls:

    F.layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5)
    F.rms_norm(input, normalized_shape, weight=None, eps=None)

as torch defines them: ``normalized_shape`` of any rank (the trailing dimensions normalized
together: the fused kernels run on them flattened into one), ``eps=None`` in rms_norm meaning
the machine epsilon of the dtype its statistics are computed in (float32's for float16, bfloat16
and float32 input, float64's for float64: not the input dtype's, 0.0078 in bfloat16), weight and
bias of the normalized shape, an input with no elements giving an empty result, a negative eps
taken as torch takes it (by the reference math: normlab's own API refuses it). rms_norm rounds
once, after the weight (normlab's ``cast="gemma"``), as torch's does. The dtypes torch refuses
on CPU, normlab refuses too: layer_norm's weight and bias must have the input's dtype, or
float32 for a bfloat16 or float16 input, and the same dtype as each other; rms_norm takes any
float weight and returns the input's dtype.

normlab's own API (:mod:`normlab.functional`) keeps its extra options (cast orders, offsets, eps
outside the root, partial RMSNorm, fused residual adds, ``out=``); ``backend=`` works here too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from normlab import functional as F
from normlab import reference

__all__ = ["layer_norm", "rms_norm", "normalized_size", "default_rms_eps"]

_HALF = (torch.bfloat16, torch.float16)


def default_rms_eps(dtype: torch.dtype) -> float:
    """torch's rms_norm epsilon when none is given: that of the dtype it computes in (float32 for
    half-precision input), as its kernels and its decomposition take it."""
    return torch.finfo(reference.stat_dtype(dtype)).eps


def normalized_size(normalized_shape: int | Sequence[int], input: Tensor,
                    what: str) -> tuple[tuple[int, ...], int]:
    """``normalized_shape`` as a tuple, checked against the input's trailing dimensions, and the
    number of elements it spans."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError(f"{what}: normalized_shape must be an int or a non-empty sequence of ints >= 0, "
                         f"got {normalized_shape!r}")
    if not isinstance(input, Tensor) or not input.is_floating_point():
        got = f"dtype {input.dtype}" if isinstance(input, Tensor) else type(input).__name__
        raise TypeError(f"{what}: input must be a floating-point torch.Tensor, got {got}")
    if input.dim() < len(shape) or tuple(input.shape[input.dim() - len(shape):]) != shape:
        raise ValueError(f"{what}: normalized_shape {list(shape)} must be the trailing dimensions of input, "
                         f"whose shape is {list(input.shape)}")
    return shape, math.prod(shape)


def _flat_param(t: Tensor | None, name: str, shape: tuple[int, ...], what: str) -> Tensor | None:
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{what}: {name} has shape {list(t.shape)}, expected normalized_shape {list(shape)}")
    return t.reshape(-1)


def _empty(input: Tensor, *params: Tensor | None) -> Tensor:
    """The result for an input with no elements: empty, in the graph of every input."""
    out = input.clone()
    for p in params:
        if p is not None:
            out = out + p.sum().to(input.dtype) * 0
    return out


def layer_norm(input: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5, *, backend: str | None = None) -> Tensor:
    """torch.nn.functional.layer_norm, fused."""
    shape, d = normalized_size(normalized_shape, input, "layer_norm")
    w, b = _flat_param(weight, "weight", shape, "layer_norm"), _flat_param(bias, "bias", shape, "layer_norm")
    for name, p in (("weight", w), ("bias", b)):
        if p is not None and p.dtype != input.dtype and not (input.dtype in _HALF
                                                             and p.dtype == torch.float32):
            raise TypeError(f"layer_norm: {name} has dtype {p.dtype} and input {input.dtype}; they must "
                            "match, or the parameters be float32 for a bfloat16 or float16 input (as torch "
                            "requires)")
    if w is not None and b is not None and w.dtype != b.dtype:
        raise TypeError(f"layer_norm: weight has dtype {w.dtype} and bias {b.dtype}; they must match "
                        "(as torch requires on CPU)")
    if input.numel() == 0:
        return _empty(input, weight, bias)
    x = input.reshape(*input.shape[:input.dim() - len(shape)], d)
    if eps < 0:  # torch takes it (rows whose variance is below -eps give nan); normlab's API does not
        return reference.layer_norm(x, w, b, eps).reshape(input.shape)
    return F.layer_norm(x, w, b, eps, backend=backend).reshape(input.shape)


def rms_norm(input: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
             eps: float | None = None, *, backend: str | None = None) -> Tensor:
    """torch.nn.functional.rms_norm, fused: ``eps=None`` is the statistics dtype's machine epsilon."""
    shape, d = normalized_size(normalized_shape, input, "rms_norm")
    w = _flat_param(weight, "weight", shape, "rms_norm")
    if input.numel() == 0:
        return _empty(input, weight)
    eps = default_rms_eps(input.dtype) if eps is None else eps
    x = input.reshape(*input.shape[:input.dim() - len(shape)], d)
    if eps < 0:
        return reference.rms_norm(x, w, eps, cast="gemma").reshape(input.shape)
    return F.rms_norm(x, w, eps, cast="gemma", backend=backend).reshape(input.shape)
