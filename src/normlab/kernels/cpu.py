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

import functools
import glob
import math
import os
import sys
import threading

import numba
import numpy as np
import torch
from torch import Tensor

from normlab.kernels import _glue
from normlab.kernels import _numba as K
from normlab.kernels._glue import _sum_dtype

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# ------------------------------------------------------------------------------ memory


def _as_numpy(t: Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor in the encoding the kernels expect. (An integer
    view never requires grad, so only float32 needs the detach; each step is a microsecond or
    two of every call.)"""
    if t.dtype == torch.float32:
        return t.detach().numpy()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy()
    raise TypeError(f"cpu kernels take float32, bfloat16 or float16 tensors, got {t.dtype}")


_NP_STORAGE = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.int16, torch.float64: np.float64}


ALIGN = 64  # bytes: a cache line, and what the streaming stores need (torch aligns to 64 too)


def _raw(nbytes: int) -> np.ndarray:
    return np.empty(nbytes + ALIGN, np.uint8)


def _aligned(raw: np.ndarray, nbytes: int, start: int | None = None) -> np.ndarray:
    """The 64-byte-aligned ``nbytes`` of a buffer from ``_raw`` (``start``: where they begin, if
    known). A view, whose base is ``raw`` itself (numpy collapses view chains), so holding it
    holds ``raw``: the pool's reference counts stay right."""
    if start is None:
        start = -raw.__array_interface__["data"][0] % ALIGN
    return raw[start : start + nbytes]


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
        self._buffers: dict[int, list[tuple[np.ndarray, int]]] = {}  # (buffer, where its aligned bytes start)
        self._held = 0
        self._lock = threading.Lock()

    @staticmethod
    def _free(buffers: list[tuple[np.ndarray, int]], i: int) -> bool:
        # Two references when free: the pool's entry and getrefcount's own argument. Any tensor,
        # view or saved activation made from the buffer adds one.
        return sys.getrefcount(buffers[i][0]) == 2

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            buffers = self._buffers.setdefault(nbytes, [])
            for i in range(len(buffers)):
                if self._free(buffers, i):
                    raw, start = buffers[i]
                    return _aligned(raw, nbytes, start)  # a view: holding it holds the buffer
            if self._held + nbytes > self.max_bytes:
                self._evict(self._held + nbytes - self.max_bytes)
            if self._held + nbytes > self.max_bytes:
                return _aligned(_raw(nbytes), nbytes)  # over the cap: not pooled
            raw = _raw(nbytes)
            buffers.append((raw, -raw.__array_interface__["data"][0] % ALIGN))
            self._held += nbytes
            return _aligned(raw, nbytes, buffers[-1][1])

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


def env_setting(name: str, default: str, *, choices: tuple[str, ...] | None = None) -> str | float:
    """A NORMLAB_CPU_* setting: one of ``choices``, or else a finite number >= 0. A bad value is an
    error that names the variable, raised when the backend loads."""
    raw = os.environ.get(name) or default
    if choices is not None:
        if raw not in choices:
            raise ValueError(f"environment variable {name} must be one of {', '.join(choices)}; got {raw!r}")
        return raw
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"environment variable {name} must be a number of MB >= 0; got {raw!r}")
    return value


# How outputs are allocated: "pool" (default, above), "numpy" (numpy's allocator, unpooled) or
# "torch" (torch.empty). NORMLAB_CPU_ALLOC picks one; NORMLAB_CPU_POOL_MB caps the pool.
ALLOCATOR = env_setting("NORMLAB_CPU_ALLOC", "pool", choices=("pool", "numpy", "torch"))
POOL = BufferPool(int(env_setting("NORMLAB_CPU_POOL_MB", "1024")) << 20)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    if ALLOCATOR == "torch" or nbytes < POOL.min_bytes:
        return torch.empty(shape, dtype=dtype)
    if ALLOCATOR == "pool":
        raw = POOL.take(nbytes)
    else:
        raw = _aligned(_raw(nbytes), nbytes)
    buf = torch.from_numpy(raw.view(_NP_STORAGE[dtype]).reshape(shape))
    return buf if buf.dtype == dtype else buf.view(dtype)


def _rows(t: Tensor) -> Tensor:
    """(..., d) -> contiguous (rows, d)."""
    return t.contiguous().view(-1, t.shape[-1]) if t.dim() != 2 or not t.is_contiguous() else t


_numba_threads = threading.local()  # what this thread last set numba's thread count to


_threads_started = False


def _start_numba_threads() -> None:
    """numba's OpenMP layer, when it starts, sets the process's OpenMP thread count to all cores,
    and torch reads that same count: a user's torch.set_num_threads(1) would be undone by the
    first kernel. Start the layer once, before any kernel, and put torch's count back."""
    global _threads_started
    before = torch.get_num_threads()
    K.start_threads(2)
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
    _threads_started = True


def nchunks(rows: int) -> int:
    if not _threads_started:
        _start_numba_threads()
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    # numba's count is per thread. Asking numba for it cost 6 us a call (a tenth of a small
    # call's launcher), so remember what was set instead.
    if getattr(_numba_threads, "count", None) != threads:
        numba.set_num_threads(threads)
        _numba_threads.count = threads
    return max(1, min(rows, threads))


_NP_CODE = {torch.float32: np.float32, torch.bfloat16: np.uint16, torch.float16: np.int16}


@functools.cache
def _rnd(out_dtype: torch.dtype, llama: bool) -> np.ndarray:
    """The kernels' ``rnd``: a 1-element array of the dtype xhat is rounded to before the weight
    multiply (the output dtype in the llama order; float32, no rounding, in the gemma order).
    Only its dtype is read, so one array per key serves every call."""
    return np.zeros(1, _NP_CODE[out_dtype] if llama else np.float32)


def _last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The size of the largest CPU cache (Linux sysfs), or ``default`` where it cannot be read."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=default)


# Outputs of at least this many bytes are written with non-temporal stores (x86 only; why and
# how: _numba.py, "block output"): half the last-level cache, i.e. where input plus output stop
# fitting in it. Measured on the 2-core EPYC (32 MB L3), rms_norm forward, time with plain
# stores / streamed: float32 0.6-1.0 up to 12 MB outputs, 1.55-1.9 from 16 MB; bfloat16 (compute
# bound, so it matters less) 0.99-1.01 up to 12 MB, 1.00-1.06 from 16 MB. NORMLAB_CPU_STREAM_MB
# overrides it (0: always stream, as a test does to compare both paths on small tensors).
STREAM_MIN_BYTES = (
    int(env_setting("NORMLAB_CPU_STREAM_MB", "") * (1 << 20))
    if os.environ.get("NORMLAB_CPU_STREAM_MB")
    else _last_level_cache_bytes() // 2
)


def _stages(out: Tensor, rows: int) -> tuple[np.ndarray, bool]:
    """The kernels' float32 staging rows (one per chunk: their count is the chunk count) and
    whether ``out`` is streamed. The kernels read a row's line of zeros (_numba._narrow_line) and
    write nothing there since they compute output blocks in registers; the rows keep their
    64-byte-aligned 768-byte layout from when each thread staged every block in its row (rows
    that shared a cache line then made the bf16 rms_norm forward 1.6x slower)."""
    stream = K.X86 and out.numel() * out.element_size() >= STREAM_MIN_BYTES
    return _zero_stages(nchunks(rows)), stream


@functools.cache
def _zero_stages(count: int) -> np.ndarray:
    # Nothing writes them, so calls (and threads) share one set per chunk count. Allocating
    # them per call was a tenth of a small call's time (docs/results/cpu-bench-fold-2026-11-29.md).
    # torch's allocator aligns to 64 bytes, so the line of zeros the kernels load is one line.
    return torch.zeros(count, K.STAGE_WIDTH, dtype=torch.float32).numpy()


def _rms_weight(weight: Tensor | None, d: int, out_dtype: torch.dtype, llama: bool, offset: float) -> np.ndarray:
    if weight is None:
        return np.ones(d, np.float32)
    w = weight.detach().float()
    if offset:
        w = w + offset
    if llama:  # the llama order multiplies in the output dtype: the weight is rounded to it
        w = w.to(out_dtype).float()
    return w.contiguous().numpy()


def _f32_vector(t: Tensor | None, d: int, fill: float) -> np.ndarray:
    """A weight or bias as a float32 vector, ``fill`` everywhere when there is none."""
    return np.full(d, fill, np.float32) if t is None else t.detach().float().contiguous().numpy()


def _ln_weights(weight: Tensor | None, bias: Tensor | None, d: int) -> tuple[np.ndarray, np.ndarray]:
    return _f32_vector(weight, d, 1.0), _f32_vector(bias, d, 0.0)


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
            K.rms_fwd(_as_numpy(x2), w, _as_numpy(y.view(n, d)), rstd.view(n).numpy(), eps, inside, k, _rnd(x.dtype, llama),
                      *_stages(y, n))
        else:
            K.add_rms_fwd(
                _as_numpy(x2), _as_numpy(_rows(residual)), w, _as_numpy(y.view(n, d)), _as_numpy(s.view(n, d)),
                rstd.view(n).numpy(), eps, inside, k, _rnd(x.dtype, llama), *_stages(y, n),
            )
    return y, s, rstd


def _weight_grads(grad_dtypes: tuple | None, count: int, d: int, rows: int) -> list[Tensor]:
    """The (d,) outputs the kernels store weight (and bias) gradients into: in ``grad_dtypes``,
    else float32; zeros when there are no rows."""
    dtypes = grad_dtypes or (torch.float32,) * count
    return [torch.empty(d, dtype=t) if rows else torch.zeros(d, dtype=t) for t in dtypes]


def rms_bwd_launch(dy, x, weight, rstd, ds, eps, inside, llama, offset, k, *, grad_dtypes=None):
    """Returns (dx in x's dtype, dw (d,) float32 or in ``grad_dtypes[0]``). ``ds`` (optional) is
    added to dx."""
    shape, d = x.shape, x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    n = x2.shape[0]
    dx = empty(shape, x.dtype)
    stages, stream = _stages(dx, n)
    (dw,) = _weight_grads(grad_dtypes, 1, d, n)
    if n:
        w = _rms_weight(weight, d, dy.dtype, llama, offset)
        ds2 = _as_numpy(_rows(ds)) if ds is not None else None
        K.rms_bwd(
            _as_numpy(dy2), _as_numpy(x2), w, rstd.reshape(n).numpy(), ds2, _as_numpy(dx.view(n, d)),
            _as_numpy(dw), eps, inside, k, _rnd(dy.dtype, llama), stages, stream,
        )
    return dx, dw


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
            K.ln_fwd(_as_numpy(x2), w, b, _as_numpy(y.view(n, d)), *stats, eps, *_stages(y, n))
        else:
            K.add_ln_fwd(
                _as_numpy(x2), _as_numpy(_rows(residual)), w, b, _as_numpy(y.view(n, d)), _as_numpy(s.view(n, d)),
                *stats, eps, *_stages(y, n),
            )
    return y, s, mean, rstd


def ln_bwd_launch(dy, x, weight, mean, rstd, ds, *, grad_dtypes=None):
    """Returns (dx in x's dtype, dw, db), (d,) float32 or in ``grad_dtypes``."""
    shape, d = x.shape, x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    n = x2.shape[0]
    dx = empty(shape, x.dtype)
    stages, stream = _stages(dx, n)
    dw, db = _weight_grads(grad_dtypes, 2, d, n)
    if n:
        w = _f32_vector(weight, d, 1.0)
        ds2 = _as_numpy(_rows(ds)) if ds is not None else None
        K.ln_bwd(
            _as_numpy(dy2), _as_numpy(x2), w, mean.reshape(n).numpy(), rstd.reshape(n).numpy(),
            ds2, _as_numpy(dx.view(n, d)), _as_numpy(dw), _as_numpy(db), stages, stream,
        )
    return dx, dw, db



# ------------------------------------------------------- custom ops, autograd, public functions

_api = _glue.build("cpu", "cpu", sys.modules[__name__], FUSED_DTYPES, torch.float64)
layer_norm, rms_norm = _api.layer_norm, _api.rms_norm
add_layer_norm, add_rms_norm = _api.add_layer_norm, _api.add_rms_norm
rms_norm_out, layer_norm_out = _api.rms_norm_out, _api.layer_norm_out

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
