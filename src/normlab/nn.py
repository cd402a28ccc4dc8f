"""Modules: they hold parameters and call :mod:`normlab.functional`; nothing else.

Parameter names and shapes follow torch, so state_dicts move both ways between
``normlab.LayerNorm`` and ``torch.nn.LayerNorm``, and from ``torch.nn.RMSNorm`` or a Hugging
Face ``LlamaRMSNorm`` (key ``weight``) into ``normlab.RMSNorm``. ``build_norm(kind, dim)`` makes
the norm a model asks for by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from normlab import functional as F
from normlab import reference
from normlab.kernels import check_name
from normlab.torch_compat import default_rms_eps, normalized_size

__all__ = ["LayerNorm", "RMSNorm", "L2Norm", "ScaleNorm", "SequenceBatchNorm", "DyT", "Derf", "build_norm",
           "NORM_KINDS"]

NORM_KINDS = ("layernorm", "rmsnorm", "prmsnorm", "l2", "scalenorm", "batchnorm", "dyt", "derf", "none")

# pRMSNorm's p in Zhang & Sennrich's experiments.
DEFAULT_PARTIAL = 0.0625


def _check_dim(dim: object) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int (the size of the last dimension), got {dim!r}")
    return dim


def _check_backend(backend: str | None) -> str | None:
    return None if backend is None else check_name(backend)


def _check_shape(normalized_shape: object) -> tuple[int, ...]:
    """torch's ``normalized_shape``: an int (the last dimension) or a tuple of the trailing ones."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    if not isinstance(shape, Sequence) or not shape or not all(isinstance(s, int) and not isinstance(s, bool)
                                                               and s >= 1
                                                             for s in shape):
        raise ValueError("dim must be a positive int, or a tuple of them (torch's normalized_shape: the "
                         f"trailing dimensions normalized together), got {normalized_shape!r}")
    return tuple(shape)


def _flat(module: nn.Module, x: Tensor) -> Tensor:
    """x with the module's normalized dimensions flattened into one (a view where it can be)."""
    shape = module.normalized_shape
    if len(shape) == 1:
        return x
    normalized_size(shape, x, type(module).__name__)
    return x.reshape(*x.shape[:x.dim() - len(shape)], module.dim)


def _flat_param(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.reshape(-1)


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension (or the trailing ``normalized_shape``), fp32 statistics.

    torch.nn.LayerNorm's arguments, in its order: ``weight`` (ones) and ``bias`` (zeros) of the
    normalized shape; ``bias=False`` drops the bias; ``elementwise_affine=False`` drops both.
    A tuple ``normalized_shape`` runs the fused kernels on those dimensions flattened.
    """

    def __init__(
        self,
        dim: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = _check_shape(dim)
        self.dim = math.prod(self.normalized_shape)
        self.eps = F.check_eps(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.backend = _check_backend(backend)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, **kw)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **kw)) if (elementwise_affine
                                                                               and bias) else None

    def forward(self, x: Tensor) -> Tensor:
        y = F.layer_norm(_flat(self, x), _flat_param(self.weight), _flat_param(self.bias), self.eps,
                         backend=self.backend)
        return y.reshape(x.shape) if len(self.normalized_shape) > 1 else y

    def extra_repr(self) -> str:
        shape = self.dim if len(self.normalized_shape) == 1 else self.normalized_shape
        s = f"{shape}, eps={self.eps:g}, elementwise_affine={self.elementwise_affine}"
        if self.elementwise_affine:
            s += f", bias={self.bias is not None}"
        if self.backend:
            s += f", backend={self.backend!r}"
        return s


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (and pRMSNorm with ``partial``), fp32 statistics.

    ``weight`` (the normalized shape) is initialized to ``1 - offset`` so the effective scale
    starts at one (ones for Llama, zeros for Gemma's ``offset=1``). Options as in
    :func:`normlab.functional.rms_norm`; ``elementwise_affine=False`` is weightless RMSNorm.
    torch.nn.RMSNorm's arguments work in its order, a tuple ``normalized_shape`` and ``eps=None``
    (torch's default: float32's machine epsilon for float16, bfloat16 and float32 input, float64's
    for float64) included; normlab's default eps is 1e-6, and its default cast order Llama's
    (torch's rounds once, as ``cast="gemma"``).
    """

    def __init__(
        self,
        dim: int | Sequence[int],
        eps: float | None = 1e-6,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        cast: str = "llama",
        offset: float = 0.0,
        eps_mode: str = "inside",
        partial: float | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = _check_shape(dim)
        self.dim = math.prod(self.normalized_shape)
        self.eps = None if eps is None else F.check_eps(eps)
        self.cast = F.check_choice(cast, "cast", F.CASTS)
        self.offset = F.check_offset(offset)
        self.eps_mode = F.check_choice(eps_mode, "eps_mode", F.EPS_MODES)
        self.partial = F.check_partial(partial)
        self.elementwise_affine = bool(elementwise_affine)
        self.backend = _check_backend(backend)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.full(self.normalized_shape, 1.0 - self.offset, device=device,
                                                  dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: Tensor) -> Tensor:
        eps = default_rms_eps(x.dtype) if self.eps is None else self.eps
        y = F.rms_norm(_flat(self, x), _flat_param(self.weight), eps, eps_mode=self.eps_mode, cast=self.cast,
                       offset=self.offset, partial=self.partial, backend=self.backend)
        return y.reshape(x.shape) if len(self.normalized_shape) > 1 else y

    def extra_repr(self) -> str:
        shape = self.dim if len(self.normalized_shape) == 1 else self.normalized_shape
        eps = "None" if self.eps is None else f"{self.eps:g}"
        s = f"{shape}, eps={eps}, elementwise_affine={self.elementwise_affine}, cast={self.cast!r}"
        if self.offset:
            s += f", offset={self.offset:g}"
        if self.eps_mode != "inside":
            s += f", eps_mode={self.eps_mode!r}"
        if self.partial is not None:
            s += f", partial={self.partial:g}"
        if self.backend:
            s += f", backend={self.backend!r}"
        return s


class SequenceBatchNorm(nn.Module):
    """BatchNorm over the real (b, t) positions of a (B, T, d) sequence batch.

    ``forward(x, mask=None)``: ``mask`` (B, T) is True at real tokens. Buffers and parameters are
    those of ``torch.nn.BatchNorm1d(dim)`` (weight, bias, running_mean, running_var,
    num_batches_tracked), so its state_dict loads both ways. The baseline that shows why text
    models left BatchNorm; see :func:`normlab.reference.seq_batch_norm`.

    ``per_position=True`` keeps statistics per position instead (the BatchNorm article's figure):
    running statistics of shape (max_positions, dim) and a ``seen`` count of the real tokens each
    came from; in eval a real token at a position that training never reached raises an error
    naming the position. See :func:`normlab.reference.seq_batch_norm_per_position`.
    """

    def __init__(
        self,
        dim: int,
        momentum: float = 0.1,
        eps: float = 1e-5,
        *,
        affine: bool = True,
        track_running_stats: bool = True,
        per_position: bool = False,
        max_positions: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = _check_dim(dim)
        self.momentum = F.check_momentum(momentum)
        self.eps = F.check_eps(eps)
        self.affine = bool(affine)
        self.track_running_stats = bool(track_running_stats)
        self.per_position = bool(per_position)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(dim, **kw)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim, **kw)) if affine else None
        if per_position:
            if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
                raise ValueError("max_positions must be a positive int with per_position=True (the longest "
                                 f"sequence it will see), got {max_positions!r}")
            if not track_running_stats:
                raise ValueError("per_position=True keeps running statistics per position: "
                                 "track_running_stats must be True")
            self.register_buffer("running_mean", torch.zeros(max_positions, dim, **kw))
            self.register_buffer("running_var", torch.ones(max_positions, dim, **kw))
            self.register_buffer("seen", torch.zeros(max_positions, dtype=torch.long, device=device))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        elif max_positions is not None:
            raise ValueError("max_positions applies with per_position=True only")
        elif track_running_stats:
            self.register_buffer("running_mean", torch.zeros(dim, **kw))
            self.register_buffer("running_var", torch.ones(dim, **kw))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.per_position:
            if x.dim() != 3 or x.shape[-1] != self.dim:
                raise ValueError(f"x has shape {tuple(x.shape)}; per-position BatchNorm expects (B, T, "
                                 f"{self.dim})")
            if mask is not None and (mask.dtype != torch.bool or mask.shape != x.shape[:-1]):
                raise ValueError(f"mask must be a bool tensor of shape {tuple(x.shape[:-1])} (True at real "
                                 "tokens)")
            return reference.seq_batch_norm_per_position(
                x, mask, self.running_mean, self.running_var, self.seen, self.weight, self.bias,
                training=self.training, momentum=self.momentum, eps=self.eps,
            )
        return F.seq_batch_norm(
            x, mask, self.running_mean, self.running_var, self.weight, self.bias,
            training=self.training, momentum=self.momentum, eps=self.eps,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.dim}, eps={self.eps:g}, momentum={self.momentum:g}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}"
            + (f", per_position=True, max_positions={self.running_mean.shape[0]}" if self.per_position
               else "")
        )


class L2Norm(nn.Module):
    """The Euclidean norm in place of RMS: weight * x / sqrt(||x||^2 + eps) over the last dimension.

    RMSNorm without its sqrt(d): each row leaves with norm 1 instead of sqrt(d). It is the variant
    the RMSNorm paper reports does not work, kept to show that the scale is what matters. Computed
    by the RMSNorm kernels, since x / sqrt(||x||^2 + eps) = x / sqrt(mean(x^2) + eps / d) / sqrt(d).
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        elementwise_affine: bool = True,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = _check_dim(dim)
        self.eps = F.check_eps(eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.backend = _check_backend(backend)
        self.weight = nn.Parameter(torch.ones(dim, device=device,
                                              dtype=dtype)) if elementwise_affine else None
        # the 1/sqrt(d) that turns RMS into the norm; not saved: it follows from dim
        self.register_buffer("root", torch.full((dim,), dim**-0.5, device=device, dtype=dtype),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.root if self.weight is None else self.weight * self.root
        return F.rms_norm(x, scale, self.eps / self.dim, backend=self.backend)

    def extra_repr(self) -> str:
        s = f"{self.dim}, eps={self.eps:g}, elementwise_affine={self.elementwise_affine}"
        return s + (f", backend={self.backend!r}" if self.backend else "")


class ScaleNorm(nn.Module):
    """ScaleNorm (Nguyen & Salazar 2019): g * x / sqrt(||x||^2 + eps) with one learned scalar g.

    ``g`` (1,) starts at sqrt(dim), so at initialization ScaleNorm is weightless RMSNorm: it keeps
    RMSNorm's scale and drops its per-feature weights. Computed by the RMSNorm kernels.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = _check_dim(dim)
        self.eps = F.check_eps(eps)
        self.backend = _check_backend(backend)
        self.g = nn.Parameter(torch.full((1,), dim**0.5, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        # the per-feature scale in fp32 (at least), so that g's gradient sums d fp32 partial sums,
        # not d values each rounded to a 16-bit dtype first
        scale = (self.g.to(torch.promote_types(self.g.dtype,
                                               torch.float32)) * self.dim**-0.5).expand(self.dim).contiguous()
        return F.rms_norm(x, scale, self.eps / self.dim, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps:g}" + (f", backend={self.backend!r}" if self.backend else "")


class DyT(nn.Module):
    """DyT (Zhu et al. 2025): weight * tanh(alpha * x) + bias over the last dimension, in place of a norm.

    Parameters as in the paper's module: ``alpha`` (1,), initialized to ``alpha0`` (0.5 by
    default; their language models tune it), ``weight`` (ones) and ``bias`` (zeros), each (dim,).
    ``elementwise_affine=False`` drops weight and bias.
    """

    def __init__(
        self,
        dim: int,
        alpha0: float = 0.5,
        *,
        elementwise_affine: bool = True,
        backend: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = _check_dim(dim)
        if isinstance(alpha0, bool) or not isinstance(alpha0,
                                                      (int, float)) or not (0 < alpha0 < float("inf")):
            raise ValueError(f"alpha0 must be a finite number > 0 ({type(self).__name__}'s initial alpha), "
                             f"got {alpha0!r}")
        self.alpha0 = float(alpha0)
        self.elementwise_affine = bool(elementwise_affine)
        self.backend = _check_backend(backend)
        kw = {"device": device, "dtype": dtype}
        self.alpha = nn.Parameter(torch.full((1,), self.alpha0, **kw))
        self.weight = nn.Parameter(torch.ones(dim, **kw)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(dim, **kw)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        return F.dyt(x, self.alpha, self.weight, self.bias, backend=self.backend)

    def extra_repr(self) -> str:
        s = f"{self.dim}, alpha0={self.alpha0:g}, elementwise_affine={self.elementwise_affine}"
        return s + (f", backend={self.backend!r}" if self.backend else "")


class Derf(DyT):
    """Derf (Chen et al. 2025, "Stronger Normalization-Free Transformers"): weight * erf(alpha * x +
    shift) + bias over the last dimension, DyT with erf and a learned shift.

    ``shift`` (1,) starts at ``shift0`` (0: the function is centred on zero at the start, the first
    of the properties the paper's search asks of a point-wise function); the rest as :class:`DyT`.
    """

    def __init__(self, dim: int, alpha0: float = 0.5, shift0: float = 0.0, **kwargs) -> None:
        super().__init__(dim, alpha0, **kwargs)
        if isinstance(shift0, bool) or not isinstance(shift0, (int, float)) or not math.isfinite(shift0):
            raise ValueError(f"shift0 must be a finite number (Derf's initial shift), got {shift0!r}")
        self.shift0 = float(shift0)
        self.shift = nn.Parameter(torch.full((1,), self.shift0, device=self.alpha.device,
                                             dtype=self.alpha.dtype))

    def forward(self, x: Tensor) -> Tensor:
        return F.derf(x, self.alpha, self.shift, self.weight, self.bias, backend=self.backend)

    def extra_repr(self) -> str:
        return super().extra_repr().replace(", elementwise", f", shift0={self.shift0:g}, elementwise", 1)


def build_norm(kind: str, dim: int, **options) -> nn.Module:
    """The norm a model asks for by name.

    kind: "layernorm" (options: eps, bias, elementwise_affine, backend), "rmsnorm" (eps,
    elementwise_affine, cast, offset, eps_mode, backend), "prmsnorm" (as rmsnorm plus
    ``partial``, default 0.0625), "l2" (eps, elementwise_affine, backend), "scalenorm" (eps,
    backend), "batchnorm" (eps, momentum, affine, track_running_stats), "dyt" (alpha0,
    elementwise_affine, backend), "derf" (as dyt plus shift0),
    "none" (identity; no options). ``weightless=True`` is accepted by every norm with weights as
    ``elementwise_affine=False`` (``affine=False`` for batchnorm). Unknown options are errors.
    """
    kind = F.check_choice(kind, "kind", NORM_KINDS)
    options = dict(options)
    if options.pop("weightless", False) and kind != "none":
        if kind == "scalenorm":
            raise ValueError("weightless: a scalenorm has one scalar gain and no per-feature weights to drop")
        options.setdefault("affine" if kind == "batchnorm" else "elementwise_affine", False)
    allowed = {
        "layernorm": {"eps", "bias", "elementwise_affine", "backend", "device", "dtype"},
        "rmsnorm": {"eps", "elementwise_affine", "cast", "offset", "eps_mode", "backend", "device", "dtype"},
        "prmsnorm": {"eps", "elementwise_affine", "cast", "offset", "eps_mode", "partial", "backend",
                     "device", "dtype"},
        "l2": {"eps", "elementwise_affine", "backend", "device", "dtype"},
        "scalenorm": {"eps", "backend", "device", "dtype"},
        "batchnorm": {"eps", "momentum", "affine", "track_running_stats", "device", "dtype"},
        "dyt": {"alpha0", "elementwise_affine", "backend", "device", "dtype"},
        "derf": {"alpha0", "shift0", "elementwise_affine", "backend", "device", "dtype"},
        "none": set(),
    }[kind]
    unknown = sorted(set(options) - allowed)
    if unknown:
        if kind == "rmsnorm" and "partial" in unknown:
            raise ValueError("partial is an option of kind='prmsnorm'; use build_norm('prmsnorm', dim, "
                             "partial=p)")
        valid = ", ".join(sorted(allowed)) or "none"
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for norm kind {kind!r}; valid options: "
                         f"{valid}")
    if kind == "layernorm":
        return LayerNorm(dim, **options)
    if kind == "rmsnorm":
        return RMSNorm(dim, **options)
    if kind == "prmsnorm":
        options.setdefault("partial", DEFAULT_PARTIAL)
        return RMSNorm(dim, **options)
    if kind == "l2":
        return L2Norm(dim, **options)
    if kind == "scalenorm":
        return ScaleNorm(dim, **options)
    if kind == "batchnorm":
        return SequenceBatchNorm(dim, **options)
    if kind == "dyt":
        return DyT(dim, **options)
    if kind == "derf":
        return Derf(dim, **options)
    _check_dim(dim)
    return nn.Identity()
