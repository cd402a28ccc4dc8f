"""The ``cpu`` backend: fused numba kernels behind torch.library custom ops.

Layers, in order (STYLE.md 3): the kernels (``_numba.py``) compute; the launchers here allocate,
make inputs contiguous, fold options into a float32 weight vector and pick the chunk count; the
custom ops (``normlab::cpu_*``) carry fake implementations and ``register_autograd`` so that
``torch.compile(fullgraph=True)`` traces models that use them; the public functions at the
bottom have the signatures of :mod:`normlab.reference` (inputs validated by functional.py).

dtypes: float32, bfloat16 and float16 are fused; float64 (and any mix that involves it) runs the
reference, where the extra precision is the point. Weights of any float dtype are folded into a
float32 vector: ``offset + w`` for the gemma order, ``(offset + w)`` rounded to the output dtype
for the llama order (which multiplies in that dtype), ones when there is no weight (exact).

Threads follow ``torch.get_num_threads()`` (capped by numba's pool), so normlab never runs more
threads than torch would. Rows are split into that many contiguous chunks; weight-gradient
partials are one float32 row per chunk, summed in chunk order: the same inputs and thread count
give bitwise-identical gradients.
"""

from __future__ import annotations

import math
import os
import sys
import threading

import numba
import numpy as np
import torch
from torch import Tensor

from normlab import reference
from normlab.kernels import _numba as K

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# ------------------------------------------------------------------------------ memory


def _as_numpy(t: Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor in the encoding the kernels expect."""
    t = t.detach()
    if t.dtype == torch.float32:
        return t.numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy()
    raise TypeError(f"cpu kernels take float32, bfloat16 or float16 tensors, got {t.dtype}")


_NP_STORAGE = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.int16, torch.float64: np.float64}


class BufferPool:
    """Large output buffers, reused once nothing refers to them any more.

    Why: allocating a fresh large tensor costs more than the kernel on this kind of machine.
    The allocator hands back new pages, and each first touch faults in the kernel (glibc returns
    large blocks to the OS on free, so every call faults again). Measured on 2 cores for a
    32 MB output: prealloc 1.8 ms, torch.empty 10.6 ms, numpy's allocator (huge pages) 3.3 ms;
    docs/results/cpu-allocation.md. This pool keeps the pages: a buffer goes back into use when
    its reference count shows that no tensor, view or autograd graph holds it (the tensor
    returned keeps its numpy view, and the view its buffer, alive). Buffers smaller than
    ``min_bytes`` come from torch's allocator, which recycles small blocks itself.

    ``max_bytes`` caps what the pool holds (in use or free); past it, outputs come from numpy's
    allocator unpooled, and free buffers are dropped oldest first to make room.
    """

    def __init__(self, max_bytes: int, min_bytes: int = 1 << 20) -> None:
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._buffers: dict[int, list[np.ndarray]] = {}
        self._held = 0
        self._lock = threading.Lock()

    @staticmethod
    def _free(buffers: list[np.ndarray], i: int) -> bool:
        # Two references when free: the pool's list and getrefcount's own argument. Any tensor,
        # view or saved activation made from the buffer adds one.
        return sys.getrefcount(buffers[i]) == 2

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            buffers = self._buffers.setdefault(nbytes, [])
            for i in range(len(buffers)):
                if self._free(buffers, i):
                    return buffers[i][:]  # a view: holding it holds the buffer
            if self._held + nbytes > self.max_bytes:
                self._evict(self._held + nbytes - self.max_bytes)
            if self._held + nbytes > self.max_bytes:
                return np.empty(nbytes, np.uint8)  # over the cap: not pooled
            buffers.append(np.empty(nbytes, np.uint8))
            self._held += nbytes
            return buffers[-1][:]

    def _evict(self, need: int) -> None:
        for size, buffers in self._buffers.items():
            i = 0
            while i < len(buffers) and need > 0:
                if self._free(buffers, i):
                    del buffers[i]
                    need -= size
                    self._held -= size
                else:
                    i += 1

    def clear(self) -> None:
        """Drop every free buffer."""
        with self._lock:
            self._evict(self._held)

    def stats(self) -> dict[str, int]:
        with self._lock:
            in_use = sum(not self._free(b, i) for b in self._buffers.values() for i in range(len(b)))
            count = sum(len(b) for b in self._buffers.values())
            return {"buffers": count, "held_bytes": self._held, "in_use": in_use}


# How outputs are allocated: "pool" (default, above), "numpy" (numpy's allocator, unpooled) or
# "torch" (torch.empty). NORMLAB_CPU_ALLOC picks one; NORMLAB_CPU_POOL_MB caps the pool.
ALLOCATOR = os.environ.get("NORMLAB_CPU_ALLOC", "pool")
POOL = BufferPool(int(os.environ.get("NORMLAB_CPU_POOL_MB", "1024")) << 20)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    nbytes = math.prod(shape) * (torch.finfo(dtype).bits // 8)
    if ALLOCATOR == "torch" or nbytes < POOL.min_bytes:
        return torch.empty(shape, dtype=dtype)
    if ALLOCATOR == "pool":
        raw = POOL.take(nbytes)
    else:
        raw = np.empty(nbytes, np.uint8)
    buf = torch.from_numpy(raw.view(_NP_STORAGE[dtype]).reshape(shape))
    return buf if buf.dtype == dtype else buf.view(dtype)


def _rows(t: Tensor) -> Tensor:
    """(..., d) -> contiguous (rows, d)."""
    return t.contiguous().view(-1, t.shape[-1]) if t.dim() != 2 or not t.is_contiguous() else t


def nchunks(rows: int) -> int:
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return max(1, min(rows, threads))


_NP_CODE = {torch.float32: np.float32, torch.bfloat16: np.uint16, torch.float16: np.int16}


def _rnd(out_dtype: torch.dtype, llama: bool) -> np.ndarray:
    """The kernels' ``rnd``: a 1-element array of the dtype xhat is rounded to before the weight
    multiply (the output dtype in the llama order; float32, no rounding, in the gemma order)."""
    return np.zeros(1, _NP_CODE[out_dtype] if llama else np.float32)


def _rms_weight(weight: Tensor | None, d: int, out_dtype: torch.dtype, llama: bool, offset: float) -> np.ndarray:
    if weight is None:
        return np.ones(d, np.float32)
    w = weight.detach().float()
    if offset:
        w = w + offset
    if llama:  # the llama order multiplies in the output dtype: the weight is rounded to it
        w = w.to(out_dtype).float()
    return w.contiguous().numpy()


def _ln_weights(weight: Tensor | None, bias: Tensor | None, d: int) -> tuple[np.ndarray, np.ndarray]:
    w = np.ones(d, np.float32) if weight is None else weight.detach().float().contiguous().numpy()
    b = np.zeros(d, np.float32) if bias is None else bias.detach().float().contiguous().numpy()
    return w, b


def _sum_dtype(x: Tensor, residual: Tensor, residual_in_fp32: bool) -> torch.dtype:
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return torch.promote_types(dtype, torch.float32) if residual_in_fp32 else dtype


# -------------------------------------------------------------------------------- launchers


def rms_fwd_launch(x, weight, eps, inside, llama, offset, k, *, y=None, residual=None, residual_in_fp32=False):
    """Returns (y, s or None, rstd). With ``residual``: s = x + residual is written and normalized."""
    shape, d = x.shape, x.shape[-1]
    x2 = _rows(x)
    n = x2.shape[0]
    y = empty(shape, x.dtype) if y is None else y
    rstd = empty(shape[:-1], torch.float32)
    w = _rms_weight(weight, d, x.dtype, llama, offset)
    s = None
    if residual is not None:
        s = empty(shape, _sum_dtype(x, residual, residual_in_fp32))
    if n:
        if s is None:
            K.rms_fwd(_as_numpy(x2), w, _as_numpy(y.view(n, d)), rstd.view(n).numpy(), eps, inside, k, _rnd(x.dtype, llama), nchunks(n))
        else:
            K.add_rms_fwd(
                _as_numpy(x2), _as_numpy(_rows(residual)), w, _as_numpy(y.view(n, d)), _as_numpy(s.view(n, d)),
                rstd.view(n).numpy(), eps, inside, k, _rnd(x.dtype, llama), nchunks(n),
            )
    return y, s, rstd


def rms_bwd_launch(dy, x, weight, rstd, ds, eps, inside, llama, offset, k):
    """Returns (dx in x's dtype, dw float32 of shape (d,)). ``ds`` (optional) is added to dx."""
    shape, d = x.shape, x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    n = x2.shape[0]
    dx = empty(shape, x.dtype)
    chunks = nchunks(n)
    dw_part = np.zeros((chunks, d), np.float32)
    if n:
        w = _rms_weight(weight, d, dy.dtype, llama, offset)
        ds2 = _as_numpy(_rows(ds)) if ds is not None else None
        K.rms_bwd(
            _as_numpy(dy2), _as_numpy(x2), w, rstd.contiguous().view(n).numpy(), ds2, _as_numpy(dx.view(n, d)),
            dw_part, eps, inside, k, _rnd(dy.dtype, llama), chunks,
        )
    return dx, torch.from_numpy(_sum_chunks(dw_part))


def ln_fwd_launch(x, weight, bias, eps, *, y=None, residual=None, residual_in_fp32=False):
    """Returns (y, s or None, mean float64, rstd float32)."""
    shape, d = x.shape, x.shape[-1]
    x2 = _rows(x)
    n = x2.shape[0]
    y = empty(shape, x.dtype) if y is None else y
    mean = empty(shape[:-1], torch.float64)
    rstd = empty(shape[:-1], torch.float32)
    w, b = _ln_weights(weight, bias, d)
    s = None
    if residual is not None:
        s = empty(shape, _sum_dtype(x, residual, residual_in_fp32))
    if n:
        stats = (mean.view(n).numpy(), rstd.view(n).numpy())
        if s is None:
            K.ln_fwd(_as_numpy(x2), w, b, _as_numpy(y.view(n, d)), *stats, eps, nchunks(n))
        else:
            K.add_ln_fwd(
                _as_numpy(x2), _as_numpy(_rows(residual)), w, b, _as_numpy(y.view(n, d)), _as_numpy(s.view(n, d)),
                *stats, eps, nchunks(n),
            )
    return y, s, mean, rstd


def ln_bwd_launch(dy, x, weight, mean, rstd, ds):
    """Returns (dx in x's dtype, dw, db), the last two float32 (d,)."""
    shape, d = x.shape, x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    n = x2.shape[0]
    dx = empty(shape, x.dtype)
    chunks = nchunks(n)
    dw_part = np.zeros((chunks, d), np.float32)
    db_part = np.zeros((chunks, d), np.float32)
    if n:
        w, _ = _ln_weights(weight, None, d)
        ds2 = _as_numpy(_rows(ds)) if ds is not None else None
        K.ln_bwd(
            _as_numpy(dy2), _as_numpy(x2), w, mean.contiguous().view(n).numpy(), rstd.contiguous().view(n).numpy(),
            ds2, _as_numpy(dx.view(n, d)), dw_part, db_part, chunks,
        )
    return dx, torch.from_numpy(_sum_chunks(dw_part)), torch.from_numpy(_sum_chunks(db_part))


def _sum_chunks(part: np.ndarray) -> np.ndarray:
    # Chunk order, left to right: deterministic for a given chunk count.
    total = part[0].copy()
    for c in range(1, part.shape[0]):
        total += part[c]
    return total


# ------------------------------------------------------------------------------ custom ops
# Options travel as plain scalars (float, bool, int) so the schema stays simple and traceable.

lib = "normlab"


@torch.library.custom_op(f"{lib}::cpu_rms_norm", mutates_args=(), device_types="cpu")
def _rms_norm_op(
    x: Tensor, weight: Tensor | None, eps: float, inside: bool, llama: bool, offset: float, k: int
) -> tuple[Tensor, Tensor]:
    y, _, rstd = rms_fwd_launch(x, weight, eps, inside, llama, offset, k)
    return y, rstd


@_rms_norm_op.register_fake
def _(x, weight, eps, inside, llama, offset, k):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{lib}::cpu_add_rms_norm", mutates_args=(), device_types="cpu")
def _add_rms_norm_op(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, inside: bool, llama: bool, offset: float,
    k: int, residual_in_fp32: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    y, s, rstd = rms_fwd_launch(x, weight, eps, inside, llama, offset, k, residual=residual, residual_in_fp32=residual_in_fp32)
    return y, s, rstd


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, inside, llama, offset, k, residual_in_fp32):
    s = x.new_empty(x.shape, dtype=_sum_dtype(x, residual, residual_in_fp32))
    return x.new_empty(x.shape), s, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{lib}::cpu_rms_norm_backward", mutates_args=(), device_types="cpu")
def _rms_norm_bwd_op(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, ds: Tensor | None, eps: float, inside: bool,
    llama: bool, offset: float, k: int,
) -> tuple[Tensor, Tensor]:
    return rms_bwd_launch(dy, x, weight, rstd, ds, eps, inside, llama, offset, k)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, ds, eps, inside, llama, offset, k):
    return x.new_empty(x.shape), x.new_empty(x.shape[-1:], dtype=torch.float32)


@torch.library.custom_op(f"{lib}::cpu_layer_norm", mutates_args=(), device_types="cpu")
def _layer_norm_op(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    y, _, mean, rstd = ln_fwd_launch(x, weight, bias, eps)
    return y, mean, rstd


@_layer_norm_op.register_fake
def _(x, weight, bias, eps):
    rows = x.shape[:-1]
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float64), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op(f"{lib}::cpu_add_layer_norm", mutates_args=(), device_types="cpu")
def _add_layer_norm_op(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, residual_in_fp32: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y, s, mean, rstd = ln_fwd_launch(x, weight, bias, eps, residual=residual, residual_in_fp32=residual_in_fp32)
    return y, s, mean, rstd


@_add_layer_norm_op.register_fake
def _(x, residual, weight, bias, eps, residual_in_fp32):
    rows = x.shape[:-1]
    s = x.new_empty(x.shape, dtype=_sum_dtype(x, residual, residual_in_fp32))
    return x.new_empty(x.shape), s, x.new_empty(rows, dtype=torch.float64), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op(f"{lib}::cpu_layer_norm_backward", mutates_args=(), device_types="cpu")
def _layer_norm_bwd_op(
    dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor, ds: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    return ln_bwd_launch(dy, x, weight, mean, rstd, ds)


@_layer_norm_bwd_op.register_fake
def _(dy, x, weight, mean, rstd, ds):
    d = x.shape[-1:]
    return x.new_empty(x.shape), x.new_empty(d, dtype=torch.float32), x.new_empty(d, dtype=torch.float32)


# -------------------------------------------------------------------------------- autograd
# Two doors to the same launchers. Under torch.compile the custom ops above are traced (their
# fake implementations give shapes, register_autograd gives the backward). In eager mode a plain
# autograd.Function calls the launchers directly: a custom op's first call imports
# torch._dynamo (about a second, measured) and every call pays the op dispatcher, neither of
# which eager users should pay. The gradient code (``_*_grads``) is shared; ``bwd`` is the
# backward custom op or the backward launcher.


def _grad_like(g: Tensor | None, t: Tensor | None, needed: bool) -> Tensor | None:
    if t is None or not needed or g is None:
        return None
    return g.to(t.dtype)


def _rms_setup(ctx, inputs, output):
    x, weight, eps, inside, llama, offset, k = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.opts = (eps, inside, llama, offset, k)


def _rms_grads(ctx, dy, bwd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = bwd(dy, x, weight, rstd, None, *ctx.opts)
    need = ctx.needs_input_grad
    return _grad_like(dx, x, need[0]), _grad_like(dw, weight, need[1]), None, None, None, None, None


def _add_rms_setup(ctx, inputs, output):
    x, residual, weight, eps, inside, llama, offset, k, _ = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.opts = (eps, inside, llama, offset, k)
    ctx.dtypes = (x.dtype, residual.dtype)


def _add_rms_grads(ctx, dy, ds, bwd):
    s, weight, rstd = ctx.saved_tensors
    dsum, dw = bwd(dy, s, weight, rstd, ds, *ctx.opts)
    need = ctx.needs_input_grad
    dx = dsum.to(ctx.dtypes[0]) if need[0] else None
    dres = dsum.to(ctx.dtypes[1]) if need[1] else None
    return dx, dres, _grad_like(dw, weight, need[2]), None, None, None, None, None, None


def _ln_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])


def _ln_grads(ctx, dy, bwd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = bwd(dy, x, weight, mean, rstd, None)
    need = ctx.needs_input_grad
    return _grad_like(dx, x, need[0]), _grad_like(dw, weight, need[1]), _grad_like(db, bias, need[2]), None


def _add_ln_setup(ctx, inputs, output):
    x, residual, weight, bias, _, _ = inputs
    ctx.save_for_backward(output[1], weight, bias, output[2], output[3])
    ctx.dtypes = (x.dtype, residual.dtype)


def _add_ln_grads(ctx, dy, ds, bwd):
    s, weight, bias, mean, rstd = ctx.saved_tensors
    dsum, dw, db = bwd(dy, s, weight, mean, rstd, ds)
    need = ctx.needs_input_grad
    dx = dsum.to(ctx.dtypes[0]) if need[0] else None
    dres = dsum.to(ctx.dtypes[1]) if need[1] else None
    return dx, dres, _grad_like(dw, weight, need[2]), _grad_like(db, bias, need[3]), None, None


_rms_norm_op.register_autograd(lambda ctx, dy, _: _rms_grads(ctx, dy, _rms_norm_bwd_op), setup_context=_rms_setup)
_add_rms_norm_op.register_autograd(
    lambda ctx, dy, ds, _: _add_rms_grads(ctx, dy, ds, _rms_norm_bwd_op), setup_context=_add_rms_setup
)
_layer_norm_op.register_autograd(lambda ctx, dy, _m, _r: _ln_grads(ctx, dy, _layer_norm_bwd_op), setup_context=_ln_setup)
_add_layer_norm_op.register_autograd(
    lambda ctx, dy, ds, _m, _r: _add_ln_grads(ctx, dy, ds, _layer_norm_bwd_op), setup_context=_add_ln_setup
)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *inputs):
        y, _, rstd = rms_fwd_launch(*inputs)
        _rms_setup(ctx, inputs, (y, rstd))
        return y

    @staticmethod
    def backward(ctx, dy):
        return _rms_grads(ctx, dy, rms_bwd_launch)


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, inside, llama, offset, k, residual_in_fp32):
        y, s, rstd = rms_fwd_launch(x, weight, eps, inside, llama, offset, k, residual=residual, residual_in_fp32=residual_in_fp32)
        _add_rms_setup(ctx, (x, residual, weight, eps, inside, llama, offset, k, residual_in_fp32), (y, s, rstd))
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        return _add_rms_grads(ctx, dy, ds, rms_bwd_launch)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, _, mean, rstd = ln_fwd_launch(x, weight, bias, eps)
        _ln_setup(ctx, (x, weight, bias, eps), (y, mean, rstd))
        return y

    @staticmethod
    def backward(ctx, dy):
        return _ln_grads(ctx, dy, ln_bwd_launch)


class _AddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, residual_in_fp32):
        y, s, mean, rstd = ln_fwd_launch(x, weight, bias, eps, residual=residual, residual_in_fp32=residual_in_fp32)
        _add_ln_setup(ctx, (x, residual, weight, bias, eps, residual_in_fp32), (y, s, mean, rstd))
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        return _add_ln_grads(ctx, dy, ds, ln_bwd_launch)


# ------------------------------------------------------------------- the backend's functions


def _fused(*tensors: Tensor | None) -> bool:
    return all(t is None or t.dtype in FUSED_DTYPES for t in tensors)


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    if not _fused(x, weight, bias):
        return reference.layer_norm(x, weight, bias, eps)
    if torch.compiler.is_compiling():
        return _layer_norm_op(x, weight, bias, eps)[0]
    return _LayerNorm.apply(x, weight, bias, eps)


def rms_norm(x, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0, partial=None):
    if not _fused(x, weight):
        return reference.rms_norm(x, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial)
    args = (x, weight, eps, eps_mode == "inside", cast == "llama", offset, reference.partial_size(x.shape[-1], partial))
    if torch.compiler.is_compiling():
        return _rms_norm_op(*args)[0]
    return _RMSNorm.apply(*args)


def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, residual_in_fp32=False):
    if not _fused(x, residual, weight, bias):
        return reference.add_layer_norm(x, residual, weight, bias, eps, residual_in_fp32=residual_in_fp32)
    if torch.compiler.is_compiling():
        y, s, _, _ = _add_layer_norm_op(x, residual, weight, bias, eps, residual_in_fp32)
        return y, s
    return _AddLayerNorm.apply(x, residual, weight, bias, eps, residual_in_fp32)


def add_rms_norm(
    x, residual, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0, partial=None,
    residual_in_fp32=False,
):
    if not _fused(x, residual, weight):
        return reference.add_rms_norm(
            x, residual, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial,
            residual_in_fp32=residual_in_fp32,
        )
    args = (x, residual, weight, eps, eps_mode == "inside", cast == "llama", offset, reference.partial_size(x.shape[-1], partial), residual_in_fp32)
    if torch.compiler.is_compiling():
        y, s, _ = _add_rms_norm_op(*args)
        return y, s
    return _AddRMSNorm.apply(*args)


# ``out=`` variants: eager, no autograd, the kernel writes straight into ``out``.


def rms_norm_out(x, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0, partial=None, out):
    if not (_fused(x, weight) and out.is_contiguous()):
        return out.copy_(reference.rms_norm(x, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial))
    k = reference.partial_size(x.shape[-1], partial)
    rms_fwd_launch(x, weight, eps, eps_mode == "inside", cast == "llama", offset, k, y=out)
    return out


def layer_norm_out(x, weight=None, bias=None, eps=1e-5, *, out):
    if not (_fused(x, weight, bias) and out.is_contiguous()):
        return out.copy_(reference.layer_norm(x, weight, bias, eps))
    ln_fwd_launch(x, weight, bias, eps, y=out)
    return out


# -------------------------------------------------------------------------- compile cache

KERNELS = (K.rms_fwd, K.add_rms_fwd, K.ln_fwd, K.add_ln_fwd, K.rms_bwd, K.ln_bwd)


def cache_status() -> dict[str, object]:
    """Where numba's on-disk cache lives and whether every kernel has an entry there."""
    entries = {}
    cache_dir = None
    for kernel in KERNELS:
        cache = getattr(kernel, "_cache", None)  # numba internals: guarded, info only
        index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
        cache_dir = getattr(cache, "_cache_path", cache_dir)
        entries[kernel.__name__] = bool(index and os.path.exists(index))
    return {"dir": cache_dir, "kernels": entries, "warm": all(entries.values())}
