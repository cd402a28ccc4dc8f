"""The Triton backend's launchers: from tensors to a kernel launch.

Each launcher allocates its outputs, views the inputs as rows with unit column stride and picks
the kernel's specialization (a ``Spec``: pointer dtypes, constexpr flags, launch options); the
compile test compiles every spec the public functions can reach (``reachable_specs``) for real
GPUs from the same functions. The backward runs a fixed number of programs for a device (4 per
SM; 4 under the interpreter), so dw/db, summed from per-program fp32 partials in program order,
are bitwise reproducible.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from normlab import reference
from normlab.kernels.triton import kernels as K

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KIND = {torch.float32: K.FP32, torch.bfloat16: K.BF16, torch.float16: K.FP16}
MAX_BLOCK = 4096  # columns per step; wider rows loop


def _rows(t: Tensor) -> Tensor:
    """``t`` (..., d) as a 2-D (rows, d) tensor with any row stride and unit column stride."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _block(d: int) -> int:
    return min(triton.next_power_of_2(max(d, 1)), MAX_BLOCK)


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 2048 else 16


def _tile_rows(block: int, d: int) -> int:
    """Rows per program: several when a row fits one small block (q/k norms over head_dim)."""
    return max(1, min(16, 2048 // block)) if block >= d else 1


# Floating-point contraction is chosen, not left to Triton's default (which flips in 3.10): off,
# for both kernels. An fma in g - mean(g) would leave the rounding error of g where the exact
# answer is 0, and without it the GPU computes what the interpreter tests check, operation for
# operation. The kernels wait on memory, so the fmas would buy no time.
OPTIONS = {"enable_fp_fusion": False}


@dataclass(frozen=True)
class Spec:
    """One compiled specialization of a kernel: the element dtype of each pointer argument, the
    constexprs and the launch options. The launchers launch with it; the compile test compiles
    every spec the public functions can reach, for real GPUs, from the same functions."""

    kernel: str
    pointers: tuple  # (argument, torch dtype) pairs
    constexprs: tuple  # (name, value) pairs
    num_warps: int

    def options(self) -> dict:
        # ptxas may cap registers to fit two blocks on an SM and spill to reach it; one block of
        # the kernel's threads must fit, and spills are what the compile test rules out
        return {"num_warps": self.num_warps, "maxnreg": min(255, 65536 // (32 * self.num_warps)), **OPTIONS}


def fwd_spec(d: int, x: torch.dtype, *, weight: torch.dtype | None, bias: torch.dtype | None,
             residual: torch.dtype | None,
             sum_dtype: torch.dtype | None, is_rms: bool, llama: bool, inside: bool) -> Spec:
    """norm_fwd's specialization for rows of ``d`` features of dtype ``x`` (a missing weight, bias
    or residual is replaced by x itself, whose pointer it then is)."""
    block = _block(d)
    tile = _tile_rows(block, d)
    pointers = (("X", x), ("R", residual or x), ("W", weight or x), ("B", bias or x), ("Y", x),
                ("S", sum_dtype or x),
                ("MEAN", torch.float32 if is_rms else torch.float64), ("RSTD", torch.float32))
    flags = dict(IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=bias is not None,
                 HAS_RES=residual is not None, LLAMA=llama,
                 INSIDE=inside, OUT_KIND=KIND[x], SUM_KIND=KIND.get(sum_dtype, K.FP32),
                 BLOCK=block, SINGLE=block >= d, ROWS=tile)
    return Spec("norm_fwd", pointers, tuple(flags.items()), _warps(block * tile))


def bwd_spec(d: int, dy: torch.dtype, x: torch.dtype, *, weight: torch.dtype | None, ds: torch.dtype | None,
             is_rms: bool,
             llama: bool, inside: bool, want_db: bool) -> Spec:
    """norm_bwd's specialization (``x``: what was normalized, the residual sum s in the add
    variants; a missing weight or ds is replaced by dy)."""
    block = _block(d)
    tile = _tile_rows(block, d)
    pointers = (("DY", dy), ("X", x), ("W", weight or dy),
                ("MEAN", torch.float32 if is_rms else torch.float64),
                ("RSTD", torch.float32), ("DS", ds or dy), ("DX", x), ("DW", torch.float32),
                ("DB", torch.float32))
    flags = dict(IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=want_db, HAS_DS=ds is not None, LLAMA=llama,
                 INSIDE=inside,
                 IN_KIND=KIND[dy], DX_KIND=KIND[x], BLOCK=block, SINGLE=block >= d, ROWS=tile)
    return Spec("norm_bwd", pointers, tuple(flags.items()), _warps(block * tile))


def dyt_spec(kernel: str, d: int, x: torch.dtype, *, weight: torch.dtype | None,
             bias: torch.dtype | None) -> Spec:
    """dyt_fwd's or dyt_bwd's specialization (a missing weight or bias is replaced by x)."""
    block = _block(d)
    if kernel == "dyt_fwd":
        pointers = (("X", x), ("ALPHA", torch.float32), ("W", weight or x), ("B", bias or x), ("Y", x))
        flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, OUT_KIND=KIND[x], BLOCK=block)
    else:
        pointers = (("DY", x), ("X", x), ("ALPHA", torch.float32), ("W", weight or x), ("DX", x),
                    ("DA", torch.float32),
                    ("DW", torch.float32), ("DB", torch.float32))
        flags = dict(HAS_W=weight is not None, DX_KIND=KIND[x], BLOCK=block)
    return Spec(kernel, pointers, tuple(flags.items()), _warps(block))


def reachable_specs(hidden: tuple[int, ...]) -> list[Spec]:
    """Every specialization the public functions can launch at these hidden sizes: each op,
    dtype and option (weight, bias, cast order, eps placement, residual_in_fp32, the residual
    sum's gradient used or not), weights in the input's dtype, through fwd_spec and bwd_spec."""
    specs = {}
    for d, x in itertools.product(hidden, FUSED_DTYPES):
        for is_rms in (True, False):
            options = itertools.product((x, None), (None,) if is_rms else (x, None), (True, False) if is_rms
                                        else (False,),
                                        (True, False) if is_rms else (True,))
            for weight, bias, llama, inside in options:
                # plain, add, add in fp32
                for residual, sum_dtype in ((None, None), (x, x), (x, torch.float32)):
                    kw = dict(is_rms=is_rms, llama=llama, inside=inside)
                    spec = fwd_spec(d, x, weight=weight, bias=bias, residual=residual, sum_dtype=sum_dtype,
                                    **kw)
                    specs[spec] = None
                    for ds in ((None, sum_dtype) if residual is not None else (None,)):
                        specs[bwd_spec(d, x, sum_dtype or x, weight=weight, ds=ds, want_db=not is_rms,
                                       **kw)] = None
        for weight, bias in itertools.product((x, None), (x, None)):  # DyT; alpha is read as fp32
            for kernel in ("dyt_fwd", "dyt_bwd"):
                specs[dyt_spec(kernel, d, x, weight=weight, bias=bias)] = None
    return list(specs)


def _dtype(t: Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


@functools.cache
def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _launch_fwd(x, residual, weight, bias, y, s, mean, rstd, eps, offset, k, is_rms, llama, inside):
    d = x.shape[-1]
    x2 = _rows(x)
    n = x2.shape[0]
    if n == 0:
        return
    r2 = _rows(residual) if residual is not None else x2
    y2, s2 = y.view(n, d), (s.view(n, d) if s is not None else y.view(n, d))
    spec = fwd_spec(d, x.dtype, weight=_dtype(weight), bias=_dtype(bias), residual=_dtype(residual),
                    sum_dtype=_dtype(s),
                    is_rms=is_rms, llama=llama, inside=inside)
    flags = dict(spec.constexprs)
    K.norm_fwd[(triton.cdiv(n, flags["ROWS"]),)](
        x2, r2, weight if weight is not None else x2, bias if bias is not None else x2, y2, s2,
        mean if mean is not None else rstd, rstd,
        n, d, k, x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0), float(eps), float(offset),
        **flags, **spec.options(),
    )


def _sum_out(x, residual, residual_in_fp32):
    """The residual sum's output tensor, or None without a residual."""
    if residual is None:
        return None
    return torch.empty(x.shape, dtype=reference.sum_dtype(x, residual, residual_in_fp32), device=x.device)


def rms_fwd_launch(x, weight, eps, inside, llama, offset, k, *, y=None, residual=None, residual_in_fp32=False,
                   stats=True):
    """Returns (y, s or None, rstd). With ``residual``: s = x + residual is written and normalized.
    The statistics are written whatever ``stats`` says (the caching allocator makes them cheap)."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if y is None else y
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    s = _sum_out(x, residual, residual_in_fp32)
    _launch_fwd(x, residual, weight, None, y, s, None, rstd, eps, offset, k, True, llama, inside)
    return y, s, rstd


def ln_fwd_launch(x, weight, bias, eps, *, y=None, residual=None, residual_in_fp32=False, stats=True):
    """Returns (y, s or None, mean float64, rstd float32), whatever ``stats`` says."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if y is None else y
    mean = torch.empty(x.shape[:-1], dtype=torch.float64, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    s = _sum_out(x, residual, residual_in_fp32)
    _launch_fwd(x, residual, weight, bias, y, s, mean, rstd, eps, 0.0, x.shape[-1], False, False, True)
    return y, s, mean, rstd


def _launch_bwd(dy, x, weight, mean, rstd, ds, offset, k, is_rms, llama, inside, want_db):
    d = x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    n = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    spec = bwd_spec(d, dy.dtype, x.dtype, weight=_dtype(weight), ds=_dtype(ds), is_rms=is_rms, llama=llama,
                    inside=inside,
                    want_db=want_db)
    flags = dict(spec.constexprs)
    programs = max(1, min(triton.cdiv(n, flags["ROWS"]), _programs(x.device)))
    dw = torch.zeros((programs, d), dtype=torch.float32, device=x.device)
    db = torch.zeros((programs, d), dtype=torch.float32, device=x.device) if want_db else dw
    if n:
        ds2 = _rows(ds) if ds is not None else dy2
        dx2 = dx.view(n, d)
        K.norm_bwd[(programs,)](
            dy2, x2, weight if weight is not None else dy2, mean if mean is not None else rstd,
            rstd.reshape(-1), ds2, dx2,
            dw, db, n, d, k, dy2.stride(0), x2.stride(0), ds2.stride(0), dx2.stride(0), float(offset),
            **flags, **spec.options(),
        )
    # programs in order: deterministic for a given device
    return dx, dw.sum(0), (db.sum(0) if want_db else None)


def rms_bwd_launch(dy, x, weight, rstd, ds, eps, inside, llama, offset, k, *, grad_dtypes=None):
    """Returns (dx in x's dtype, dw float32 of shape (d,)). ``ds`` (optional) is added to dx;
    ``grad_dtypes`` is not read (the caller converts)."""
    dx, dw, _ = _launch_bwd(dy, x, weight, None, rstd, ds, offset, k, True, llama, inside, False)
    return dx, dw


def ln_bwd_launch(dy, x, weight, mean, rstd, ds, *, grad_dtypes=None):
    """Returns (dx in x's dtype, dw, db), the last two float32 (d,); ``grad_dtypes`` is not read."""
    return _launch_bwd(dy, x, weight, mean.reshape(-1), rstd, ds, 0.0, x.shape[-1], False, False, True, True)


def dyt_fwd_launch(x, alpha, weight, bias):
    """Returns y in x's dtype."""
    d = x.shape[-1]
    x2 = _rows(x)
    n = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n:
        y2 = y.view(n, d)
        spec = dyt_spec("dyt_fwd", d, x.dtype, weight=_dtype(weight), bias=_dtype(bias))
        flags = dict(spec.constexprs)
        K.dyt_fwd[(n, triton.cdiv(d, flags["BLOCK"]))](
            x2, alpha.float(), weight if weight is not None else x2, bias if bias is not None else x2, y2, n,
            d,
            x2.stride(0), y2.stride(0), **flags, **spec.options(),
        )
    return y


def dyt_bwd_launch(dy, x, alpha, weight, bias):
    """Returns (dx in x's dtype, dalpha float32 in alpha's shape, dw and db float32 (d,)), the
    sums over a fixed number of programs added in program order (deterministic for a device)."""
    d = x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    n = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    programs = max(1, min(n, _programs(x.device)))
    da = torch.zeros(programs, dtype=torch.float32, device=x.device)
    dw = torch.zeros((programs, d), dtype=torch.float32, device=x.device)
    db = torch.zeros((programs, d), dtype=torch.float32, device=x.device)
    if n:
        dx2 = dx.view(n, d)
        spec = dyt_spec("dyt_bwd", d, x.dtype, weight=_dtype(weight), bias=_dtype(bias))
        K.dyt_bwd[(programs,)](
            dy2, x2, alpha.float(), weight if weight is not None else dy2, dx2, da, dw, db, n, d,
            dy2.stride(0), x2.stride(0), dx2.stride(0), **dict(spec.constexprs), **spec.options(),
        )
    return dx, da.sum().reshape(alpha.shape), dw.sum(0), db.sum(0)
