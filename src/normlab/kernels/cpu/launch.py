"""The launchers: from torch tensors to a kernel call, and the outputs back as tensors.

They make inputs contiguous (rows, d), allocate outputs (memory.py), fold the options into the
weight vector (``offset + w`` in float32 for the gemma order; in the output dtype for the llama
order, which multiplies in that dtype; ones when there is no weight, exact), and pick the chunk
count: torch's thread count, capped by numba's pool, so normlab never runs more threads than
torch would. Tensors travel as (address, shape, dtype witness) triples that the kernels read as
arrays (rows.at): float32 as is, bfloat16 as uint16 bits, float16 as int16 bits; per-row
statistics and weight gradients, made by numpy, as numpy arrays.
"""

from __future__ import annotations

import functools
import os
import threading

import numba
import numpy as np
import torch
from torch import Tensor

from normlab import reference

from .pointwise import pointwise_bwd, pointwise_fwd, table_for
from .layernorm import add_ln_fwd, ln_fwd
from .layernorm_bwd import ln_bwd
from .memory import (KERNEL_CODE, STREAM_MIN_BYTES, empty, prefetch_far, prefetch_skip, scratch,
                     serial_max_bytes, vector, zero_stages)
from .rmsnorm import add_rms_fwd, rms_bwd, rms_fwd
from .rows import start_threads
from .simd import X86

_numba_threads = threading.local()  # what this thread last set numba's thread count to


_threads_started = False
_serial_limit = 0  # memory.serial_max_bytes for how the threads wait, known once they start
SERIAL_MAX_BYTES: int | None = None  # that limit's override (tests)
_forked_from_openmp = False  # forked after the parent started GNU OpenMP: only serial kernels run here


def _start_numba_threads() -> None:
    """numba's OpenMP layer, when it starts, sets the process's OpenMP thread count to all cores,
    and torch reads that same count: a user's torch.set_num_threads(1) would be undone by the
    first kernel. Start the layer once, before any kernel, and put torch's count back."""
    global _threads_started, _serial_limit
    before = torch.get_num_threads()
    start_threads(2)
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
    _threads_started = True
    # GNU OpenMP read its wait policy from the environment as it loaded
    passive = numba.threading_layer() != "omp" or os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    _serial_limit = serial_max_bytes(passive)


def threading_layer() -> str | None:
    """numba's threading layer, once a kernel has started it."""
    return numba.threading_layer() if _threads_started else None


def thread_plan() -> tuple[str, int, int]:
    """(numba's threading layer, the threads a large call uses, the output size in bytes below
    which a call runs on one thread), starting the layer if no kernel has yet."""
    big = nchunks(1 << 30, 1 << 62)
    return numba.threading_layer(), big, _one_thread_below()


def _one_thread_below() -> int:
    """The output size in bytes below which a call runs on one thread (threads started)."""
    return _serial_limit if SERIAL_MAX_BYTES is None else SERIAL_MAX_BYTES


def _after_fork() -> None:
    # GNU OpenMP cannot run in a child forked after it started (numba's omp layer kills the child
    # at its first parallel loop: a DataLoader's fork workers): the child runs the same kernels
    # compiled serially, one chunk (a DataLoader worker has one torch thread anyway)
    global _forked_from_openmp
    _forked_from_openmp = _forked_from_openmp or threading_layer() == "omp"


os.register_at_fork(after_in_child=_after_fork)


def serial() -> bool:
    """Whether this process runs the serial kernels (forked after its parent started OpenMP)."""
    return _forked_from_openmp


def _k(kernel):
    return kernel.serial() if _forked_from_openmp else kernel


def nchunks(rows: int, nbytes: int) -> int:
    """The chunk count of a call whose output is ``nbytes``, and numba's thread count set to it."""
    if _forked_from_openmp:
        return 1
    if not _threads_started:
        _start_numba_threads()
    if nbytes < _one_thread_below():
        threads = 1
    else:
        threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    # numba's count is per thread. Asking numba for it cost 6 us a call (a tenth of a small
    # call's launcher), so remember what was set instead.
    if getattr(_numba_threads, "count", None) != threads:
        numba.set_num_threads(threads)
        _numba_threads.count = threads
    return max(1, min(rows, threads))


# The kernels' ``round_to``: a 1-element array of the dtype xhat is rounded to before the weight
# multiply (the output dtype in the llama order; float32, no rounding, in the gemma order). Only
# its dtype is read, so one array per dtype serves every call.
_ROUND_TO = {True: {dtype: np.zeros(1, code) for dtype, code in KERNEL_CODE.items()},
             False: dict.fromkeys(KERNEL_CODE, np.zeros(1, np.float32))}


def _round_to(out_dtype: torch.dtype, llama: bool) -> np.ndarray:
    return _ROUND_TO[llama][out_dtype]


def _stages(nbytes: int, rows: int) -> tuple[np.ndarray, bool]:
    """The kernels' float32 staging rows (one per chunk: their count is the chunk count) and
    whether an output of ``nbytes`` is streamed."""
    return zero_stages(nchunks(rows, nbytes)), X86 and nbytes >= STREAM_MIN_BYTES


# Tensors reach the kernels as (address, shape, dtype witness) triples (rows.at), not as numpy
# views: a view costs several torch calls, each a microsecond hot and 10-30 us after a large
# matmul has evicted the caches, more than a small call's kernel (docs/cpu-kernels.md, "Fixed
# costs of a call"). The tensor must stay referenced until the kernel returns: the launchers
# keep it in a local. The witnesses are 0-length arrays of the kernels' encoding of each dtype.
_WITNESS = {dtype: np.empty(0, code) for dtype, code in KERNEL_CODE.items()}


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _prefetch(d: int, x: Tensor, other: Tensor | None = None) -> tuple[bool, int]:
    """The kernels' (far, skip) for rows of ``d`` values of x and of the ``other`` input a pass reads."""
    x_bytes = d * x.itemsize
    return prefetch_far(x_bytes if other is None else x_bytes + d * other.itemsize), prefetch_skip(x_bytes)


def _at(t: Tensor, shape: tuple[int, ...]) -> tuple:
    """Contiguous ``t`` as the triple a kernel reads as an array of ``shape``."""
    return t.data_ptr(), shape, _WITNESS[t.dtype]


@functools.lru_cache(maxsize=64)
def _filled(d: int, fill: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """A vector of ``fill``: the weight (1) or bias (0) of a norm that has none. Nothing writes
    it, so calls share one per width and dtype."""
    return torch.full((d,), fill, dtype=dtype)


def _f32_vector(t: Tensor | None, d: int, fill: float) -> Tensor:
    """A weight or bias as a contiguous float32 vector, ``fill`` everywhere when there is none."""
    if t is None:
        return _filled(d, fill)
    if t.dtype != torch.float32:
        t = t.detach().float()
    return _contiguous(t)


def _rms_weight(weight: Tensor | None, d: int, out_dtype: torch.dtype, llama: bool,
                offset: float) -> Tensor:
    """RMSNorm's weight in the dtype the kernel multiplies in: the output's in the llama order
    (rounded to it; the kernel widens it exactly), float32 in the gemma order; plus ``offset``.
    A bf16 model's weight in the llama order goes as it is, with no torch call."""
    kind = out_dtype if llama else torch.float32
    if weight is None:
        return _filled(d, 1.0, kind)
    w = weight
    if offset:  # not + 0.0, which would turn a -0.0 weight into +0.0
        w = w.detach().float() + offset
    if w.dtype != kind:
        w = w.detach().to(kind)
    return _contiguous(w)


def _ln_weights(weight: Tensor | None, bias: Tensor | None, d: int) -> tuple[Tensor, Tensor]:
    return _f32_vector(weight, d, 1.0), _f32_vector(bias, d, 0.0)


# -------------------------------------------------------------------------------- launchers
# Each launcher names every tensor it passes (x, w, y, ...) in a local until its kernel returns.


def _per_row(x: Tensor, dtype: torch.dtype, rows: int, stats: bool) -> tuple[Tensor | None, np.ndarray]:
    """A per-row statistic of ``x`` (None when the caller does not keep ``stats``) and the array
    the kernel writes it to."""
    return vector(x.shape[:-1], dtype, rows) if stats else (None, scratch(rows, dtype))


def rms_fwd_launch(x, weight, eps, inside, llama, offset, k, *, y=None, residual=None, residual_in_fp32=False,
                   stats=True):
    """Returns (y, s or None, rstd; rstd is None without ``stats``). With ``residual``: s = x +
    residual is written and normalized."""
    x, d = _contiguous(x), x.shape[-1]
    n = x.numel() // d
    rows = (n, d)
    y = empty(x) if y is None else y
    rstd, rn = _per_row(x, torch.float32, n, stats)
    w = _rms_weight(weight, d, x.dtype, llama, offset)
    s = None
    if residual is not None:
        s = empty(x, reference.sum_dtype(x, residual, residual_in_fp32))
    if n:
        rnd, stages = _round_to(x.dtype, llama), _stages(n * d * y.itemsize, n)
        if s is None:
            _k(rms_fwd)(_at(x, rows), _at(w, (d,)), _at(y, rows), rn, eps, inside, k, rnd, *stages,
                        *_prefetch(d, x))
        else:
            residual = _contiguous(residual)
            _k(add_rms_fwd)(_at(x, rows), _at(residual, rows), _at(w, (d,)), _at(y, rows), _at(s, rows), rn,
                            eps, inside, k, rnd, *stages, *_prefetch(d, x, residual))
    return y, s, rstd


def _weight_grads(grad_dtypes: tuple | None, count: int, d: int,
                  rows: int) -> list[tuple[Tensor, np.ndarray]]:
    """The (d,) outputs the kernels store weight (and bias) gradients into, with their arrays: in
    ``grad_dtypes``, else float32; zeros when there are no rows (no kernel runs)."""
    grads = [vector((d,), t, d) for t in grad_dtypes or (torch.float32,) * count]
    if not rows:
        for _, array in grads:
            array.fill(0)
    return grads


def rms_bwd_launch(dy, x, weight, rstd, ds, eps, inside, llama, offset, k, *, grad_dtypes=None):
    """Returns (dx in x's dtype, dw (d,) float32 or in ``grad_dtypes[0]``). ``ds`` (optional) is
    added to dx."""
    x, dy, d = _contiguous(x), _contiguous(dy), x.shape[-1]
    n = x.numel() // d
    rows = (n, d)
    dx = empty(x)
    ((dw, dwn),) = _weight_grads(grad_dtypes, 1, d, n)
    if n:
        w, rstd = _rms_weight(weight, d, dy.dtype, llama, offset), _contiguous(rstd)
        ds = None if ds is None else _contiguous(ds)
        _k(rms_bwd)(
            _at(dy, rows), _at(x, rows), _at(w, (d,)), _at(rstd, (n,)), None if ds is None else _at(ds, rows),
            _at(dx, rows), dwn, eps, inside, k, _round_to(dy.dtype, llama), *_stages(n * d * dx.itemsize, n),
            *_prefetch(d, x, dy),
        )
    return dx, dw


def ln_fwd_launch(x, weight, bias, eps, *, y=None, residual=None, residual_in_fp32=False, stats=True):
    """Returns (y, s or None, mean float64, rstd float32; both None without ``stats``)."""
    x, d = _contiguous(x), x.shape[-1]
    n = x.numel() // d
    rows = (n, d)
    y = empty(x) if y is None else y
    mean, mn = _per_row(x, torch.float64, n, stats)
    rstd, rn = _per_row(x, torch.float32, n, stats)
    w, b = _ln_weights(weight, bias, d)
    s = None
    if residual is not None:
        s = empty(x, reference.sum_dtype(x, residual, residual_in_fp32))
    if n:
        stages = _stages(n * d * y.itemsize, n)
        if s is None:
            _k(ln_fwd)(_at(x, rows), _at(w, (d,)), _at(b, (d,)), _at(y, rows), mn, rn, eps, *stages,
                       *_prefetch(d, x))
        else:
            residual = _contiguous(residual)
            _k(add_ln_fwd)(_at(x, rows), _at(residual, rows), _at(w, (d,)), _at(b, (d,)), _at(y, rows),
                           _at(s, rows), mn, rn, eps, *stages,
                           *_prefetch(d, x, residual))
    return y, s, mean, rstd


def ln_bwd_launch(dy, x, weight, mean, rstd, ds, *, grad_dtypes=None):
    """Returns (dx in x's dtype, dw, db), (d,) float32 or in ``grad_dtypes``."""
    x, dy, d = _contiguous(x), _contiguous(dy), x.shape[-1]
    n = x.numel() // d
    rows = (n, d)
    dx = empty(x)
    (dw, dwn), (db, dbn) = _weight_grads(grad_dtypes, 2, d, n)
    if n:
        w, mean, rstd = _f32_vector(weight, d, 1.0), _contiguous(mean), _contiguous(rstd)
        ds = None if ds is None else _contiguous(ds)
        _k(ln_bwd)(
            _at(dy, rows), _at(x, rows), _at(w, (d,)), _at(mean, (n,)), _at(rstd, (n,)),
            None if ds is None else _at(ds, rows), _at(dx, rows), dwn, dbn, *_stages(n * d * dx.itemsize, n),
            *_prefetch(d, x, dy),
        )
    return dx, dw, db


def _pointwise_fwd(x, alpha, shift, weight, bias):
    x, d = _contiguous(x), x.shape[-1]
    n = x.numel() // d
    rows = (n, d)
    y = empty(x)
    w, b = _ln_weights(weight, bias, d)
    if n:
        s = None if shift is None else np.float32(float(shift.float()))
        _k(pointwise_fwd)(_at(x, rows), float(alpha.float()), s, _at(w, (d,)), _at(b, (d,)), _at(y, rows),
                          *_stages(n * d * y.itemsize, n), table_for(x, grad=False),
                          *_prefetch(d, x))
    return y


def _pointwise_bwd(dy, x, alpha, shift, weight):
    x, dy, d = _contiguous(x), _contiguous(dy), x.shape[-1]
    n = x.numel() // d
    rows = (n, d)
    dx = empty(x)
    stages, stream = _stages(n * d * dx.itemsize, n)
    chunks = stages.shape[0]
    das, dw, db = np.zeros((chunks, 2)), np.zeros((chunks, d)), np.zeros((chunks, d))
    if n:
        w = _f32_vector(weight, d, 1.0)
        s = None if shift is None else np.float32(float(shift.float()))
        _k(pointwise_bwd)(_at(dy, rows), _at(x, rows), float(alpha.float()), s, _at(w, (d,)), _at(dx, rows),
                          das, dw, db, stages, stream, table_for(x, grad=True),
                          *_prefetch(d, x, dy))
    # the chunks' float64 sums, added in chunk order (deterministic for a thread count)
    da, ds = das.sum(0)
    return (dx, da, ds, torch.from_numpy(dw.sum(0).astype(np.float32)),
            torch.from_numpy(db.sum(0).astype(np.float32)))


def dyt_fwd_launch(x, alpha, weight, bias):
    """Returns y in x's dtype."""
    return _pointwise_fwd(x, alpha, None, weight, bias)


def dyt_bwd_launch(dy, x, alpha, weight, bias):
    """Returns (dx in x's dtype, dalpha float32 in alpha's shape, dw (d,) float32, db (d,) float32)."""
    dx, da, _, dw, db = _pointwise_bwd(dy, x, alpha, None, weight)
    return dx, torch.tensor(da, dtype=torch.float32).reshape(alpha.shape), dw, db


def derf_fwd_launch(x, alpha, shift, weight, bias):
    """Returns y in x's dtype."""
    return _pointwise_fwd(x, alpha, shift, weight, bias)


def derf_bwd_launch(dy, x, alpha, shift, weight, bias):
    """Returns (dx in x's dtype, dalpha and dshift float32 in their shapes, dw (d,) float32,
    db (d,) float32)."""
    dx, da, ds, dw, db = _pointwise_bwd(dy, x, alpha, shift, weight)
    return (dx, torch.tensor(da, dtype=torch.float32).reshape(alpha.shape),
            torch.tensor(ds, dtype=torch.float32).reshape(shift.shape),
            dw, db)
