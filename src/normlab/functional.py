"""The public functional API: validate the inputs, pick a backend, call it.

Every function normalizes over the last dimension of ``x`` (shape (..., d)) with statistics in
float32 (float64 for float64 input). The math is stated once, in :mod:`normlab.reference`.
Errors name the argument, what was given and what was expected, before any kernel runs.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

from normlab import kernels, reference

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "seq_batch_norm", "dyt", "derf"]

CASTS = ("llama", "gemma")
EPS_MODES = ("inside", "outside")


# ---------------------------------------------------------------------------------------------
# validation


def _shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ("," if t.dim() == 1 else "") + ")"


def check_x(x: object, name: str = "x") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (the features), got a scalar")
    if x.shape[-1] == 0:
        raise ValueError(
            f"{name} has shape {_shape(x)}: its last dimension (the features) must be at least 1"
        )
    return x


def _check_param(t: object, name: str, x: Tensor) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    d = x.shape[-1]
    if tuple(t.shape) != (d,):
        raise ValueError(f"{name} has shape {_shape(t)}, expected ({d},) to match the last dimension of x")
    _check_device(t, name, x)


def _check_device(t: Tensor, name: str, x: Tensor) -> None:
    if not (t.is_cpu and x.is_cpu) and t.device != x.device:  # is_cpu first: makes no torch.device
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}; put them on the same device")


def check_eps(eps: object, name: str = "eps") -> float:
    if type(eps) is float and 0 <= eps < math.inf:  # the usual case, without the ABC check below
        return eps
    if isinstance(eps, bool) or not isinstance(eps, Real):
        raise TypeError(f"{name} must be a real number, got {type(eps).__name__}")
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) eps may be a SymFloat,
    # which a comparison guards on and math.isfinite graph-breaks on
    if not 0 <= eps < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {eps}")
    return float(eps)


def check_choice(value: object, name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value  # type: ignore[return-value]


def check_partial(partial: object) -> float | None:
    if partial is None:
        return None
    if isinstance(partial, bool) or not isinstance(partial, Real):
        raise TypeError(f"partial must be a number in (0, 1] or None, got {type(partial).__name__}")
    if not (0.0 < partial <= 1.0):
        raise ValueError("partial must be in (0, 1] (the fraction of features the RMS is taken over), got "
                         f"{partial}")
    return float(partial)


def check_offset(offset: object) -> float:
    if type(offset) is float and -math.inf < offset < math.inf:
        return offset
    if isinstance(offset, bool) or not isinstance(offset, Real) or not -math.inf < offset < math.inf:
        raise ValueError(f"offset must be a finite number (Gemma uses 1.0), got {offset!r}")
    return float(offset)


def check_momentum(momentum: object) -> float:
    if isinstance(momentum, bool) or not isinstance(momentum, Real) or not (0.0 <= momentum <= 1.0):
        raise ValueError(f"momentum must be a number in [0, 1], got {momentum!r}")
    return float(momentum)


def _check_residual(residual: object, x: Tensor) -> None:
    check_x(residual, "residual")
    assert isinstance(residual, Tensor)
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {_shape(residual)}, expected {_shape(x)} (the shape of x)")
    _check_device(residual, "residual", x)


def _check_rms_options(eps: object, eps_mode: object, cast: object, offset: object, partial: object):
    if (type(eps) is float and type(offset) is float and partial is None and eps_mode in EPS_MODES
            and cast in CASTS and 0 <= eps < math.inf and -math.inf < offset < math.inf):
        return eps, eps_mode, cast, offset, None  # the usual call: one test instead of five calls
    return (
        check_eps(eps),
        check_choice(eps_mode, "eps_mode", EPS_MODES),
        check_choice(cast, "cast", CASTS),
        check_offset(offset),
        check_partial(partial),
    )


_backend = kernels.for_tensor


def _check_out(out: object, x: Tensor, *params: Tensor | None) -> Tensor:
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out has shape {_shape(out)}, dtype {out.dtype} on {out.device}; expected {_shape(x)}, "
            f"{x.dtype} on {x.device} (those of x)"
        )
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params)):
        raise RuntimeError("out= does not support autograd; call without out=, or under torch.no_grad()")
    if _overlap_in_part(out, x):
        raise ValueError("out overlaps x in part (a view of the same memory at another offset or stride); "
                         "the kernels read rows that they have already overwritten. Pass out=x itself, or a "
                         "separate tensor")
    return out


def _overlap_in_part(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors share memory without being the same view (exact aliasing is fine: each
    row is read before it is written)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if a.storage_offset() == b.storage_offset() and a.stride() == b.stride() and a.shape == b.shape:
        return False

    def span(t: Tensor) -> tuple[int, int]:  # the elements a view can touch, first to last
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)
        first = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s < 0)
        return t.storage_offset() + first, t.storage_offset() + last

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 <= b1 and b0 <= a1


def _into(module, name: str, out: Tensor, *args, **kwargs) -> Tensor:
    """Run op ``name`` writing into ``out``: straight from the kernel when the backend has an
    ``<name>_out`` entry point, else through a copy."""
    fn = getattr(module, f"{name}_out", None)
    if fn is not None:
        return fn(*args, out=out, **kwargs)
    return out.copy_(getattr(module, name)(*args, **kwargs))


# ---------------------------------------------------------------------------------------------
# the API


def layer_norm(
    x: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """LayerNorm over the last dimension: (x - mean) / sqrt(var + eps) * weight + bias.

    ``weight`` and ``bias`` are optional, each of shape (d,). The output has x's dtype.
    ``out``: a preallocated output (x's shape and dtype; no autograd).
    """
    check_x(x)
    _check_param(weight, "weight", x)
    _check_param(bias, "bias", x)
    eps = check_eps(eps)
    if out is not None:
        return _into(_backend(backend, x), "layer_norm", _check_out(out, x, weight, bias), x, weight, bias,
                     eps)
    return _backend(backend, x).layer_norm(x, weight, bias, eps)


def rms_norm(
    x: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    eps_mode: str = "inside",
    cast: str = "llama",
    offset: float = 0.0,
    partial: float | None = None,
    backend: str | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """RMSNorm over the last dimension: x / rms(x) * (offset + weight).

    ``eps_mode``: "inside" sqrt(ms + eps) (Llama, torch) or "outside" sqrt(ms) + eps (the paper's
    code). ``cast``: "llama" casts the normalized x to x's dtype before the weight multiply,
    "gemma" multiplies in fp32 and casts last. ``offset``: Gemma's 1 + w. ``partial``: pRMSNorm,
    the RMS over the first ceil(partial * d) features. See :func:`normlab.reference.rms_norm`.
    ``out``: a preallocated output (x's shape and dtype; no autograd).
    """
    check_x(x)
    _check_param(weight, "weight", x)
    eps, eps_mode, cast, offset, partial = _check_rms_options(eps, eps_mode, cast, offset, partial)
    if out is not None:
        return _into(_backend(backend, x), "rms_norm", _check_out(out, x, weight), x, weight, eps,
                     eps_mode=eps_mode, cast=cast, offset=offset, partial=partial)
    return _backend(backend, x).rms_norm(x, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset,
                                         partial=partial)


def add_layer_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual_in_fp32: bool = False,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """s = x + residual; returns (layer_norm(s), s).

    The normalized output has x's dtype; the sum has the promoted dtype of x and residual, or
    float32 when ``residual_in_fp32`` (a bf16 model with an fp32 residual stream).
    """
    check_x(x)
    _check_residual(residual, x)
    _check_param(weight, "weight", x)
    _check_param(bias, "bias", x)
    eps = check_eps(eps)
    return _backend(backend, x).add_layer_norm(
        x, residual, weight, bias, eps, residual_in_fp32=bool(residual_in_fp32)
    )


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
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """s = x + residual; returns (rms_norm(s), s). Options as in :func:`rms_norm` and
    :func:`add_layer_norm`."""
    check_x(x)
    _check_residual(residual, x)
    _check_param(weight, "weight", x)
    eps, eps_mode, cast, offset, partial = _check_rms_options(eps, eps_mode, cast, offset, partial)
    return _backend(backend, x).add_rms_norm(
        x, residual, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial,
        residual_in_fp32=bool(residual_in_fp32),
    )


def dyt(
    x: Tensor,
    alpha: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    backend: str | None = None,
) -> Tensor:
    """DyT, the norm-free replacement of a norm (Zhu et al. 2025): weight * tanh(alpha * x) + bias.

    ``alpha``: a one-element tensor (the learned scalar); ``weight`` and ``bias`` optional, (d,).
    The output has x's dtype. See :func:`normlab.reference.dyt`.
    """
    check_x(x)
    _check_scalar(alpha, "alpha", "DyT's learned scalar", x)
    _check_param(weight, "weight", x)
    _check_param(bias, "bias", x)
    return _backend(backend, x).dyt(x, alpha, weight, bias)


def derf(
    x: Tensor,
    alpha: Tensor,
    shift: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    backend: str | None = None,
) -> Tensor:
    """Derf, DyT with erf (Chen et al. 2025): weight * erf(alpha * x + shift) + bias.

    ``alpha`` and ``shift``: one-element tensors (the learned scalars); ``weight`` and ``bias``
    optional, (d,). The output has x's dtype. See :func:`normlab.reference.derf`.
    """
    check_x(x)
    _check_scalar(alpha, "alpha", "Derf's learned scale", x)
    _check_scalar(shift, "shift", "Derf's learned shift", x)
    _check_param(weight, "weight", x)
    _check_param(bias, "bias", x)
    return _backend(backend, x).derf(x, alpha, shift, weight, bias)


def _check_scalar(t, name: str, what: str, x: Tensor) -> None:
    if not isinstance(t, Tensor) or t.numel() != 1 or not t.is_floating_point():
        got = f"a tensor of shape {_shape(t)}, dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a floating-point tensor of one element ({what}), got {got}")
    _check_device(t, name, x)


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
    """BatchNorm over the real (b, t) positions of a (B, T, d) batch; ``mask`` (B, T) is True at
    real tokens (None: all real). Running statistics are updated in place in training and used
    in eval. Reference implementation only (see :func:`normlab.reference.seq_batch_norm`)."""
    check_x(x)
    if x.dim() < 2:
        raise ValueError(f"x has shape {_shape(x)}; seq_batch_norm expects (B, T, d) (at least (N, d))")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"mask must be a bool tensor (True at real tokens), got {got}")
        if mask.shape != x.shape[:-1]:
            raise ValueError(f"mask has shape {_shape(mask)}, expected {tuple(x.shape[:-1])} (x's shape "
                             "without its last dimension)")
        _check_device(mask, "mask", x)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must be given together (or both None)")
    for t, name in ((running_mean, "running_mean"), (running_var, "running_var"), (weight, "weight"),
                    (bias, "bias")):
        _check_param(t, name, x)
    eps = check_eps(eps)
    momentum = check_momentum(momentum)
    if x.numel() == 0:
        return x.clone()
    return reference.seq_batch_norm(
        x, mask, running_mean, running_var, weight, bias,
        training=bool(training), momentum=momentum, eps=eps,
    )
