"""Where the CPU kernels' outputs live: a pool of large aligned buffers, and when to stream.

Allocating a fresh large tensor costs more than the kernel on a small machine (every first touch
of a new page faults), so large outputs come from a pool that keeps its pages (BufferPool).
Outputs larger than half the last-level cache (at most 16 MiB) are written with non-temporal
stores, which skip the read-for-ownership of each line (STREAM_MIN_BYTES), and rows too wide for
L1 are prefetched into L2 (PREFETCH_L2_MIN_BYTES; docs/cpu-kernels.md has the measurements).
"""

from __future__ import annotations

import functools
import glob
import math
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from llvmlite import binding as llvm
from torch import Tensor

from .simd import STAGE_WIDTH


# How each dtype travels to the kernels: its numpy dtype (bfloat16 and float16 as their bits) and
# the torch dtype of the integer view that exposes those bits (None: numpy has the dtype itself).
KERNEL_CODE = {torch.float32: np.float32, torch.float64: np.float64, torch.bfloat16: np.uint16,
               torch.float16: np.int16}
_BITS = {torch.float32: None, torch.float64: None, torch.bfloat16: torch.uint16, torch.float16: torch.int16}


def as_numpy(t: Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor in the encoding the kernels expect. (An integer
    view never requires grad, so only the float types need the detach; each step is a microsecond
    or two of every call.)"""
    dtype = t.dtype
    if dtype not in _BITS:
        raise TypeError(f"cpu kernels take float32, bfloat16 or float16 tensors, got {dtype}")
    bits = _BITS[dtype]
    return t.detach().numpy() if bits is None else t.view(bits).numpy()


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

    Why: a fresh large tensor's pages fault on first touch, inside the kernel, and glibc returns
    large blocks to the OS on free, so every call would fault again (docs/cpu-kernels.md,
    "Output buffers"). This pool keeps the pages: a buffer goes back into use when
    its reference count shows that no tensor, view or autograd graph holds it (the tensor
    returned keeps its numpy view, and the view its buffer, alive). Smaller outputs come from
    torch's allocator (per-row statistics from numpy's), which recycle small blocks themselves.

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


def env_setting(name: str, default: str, *, choices: tuple[str, ...] | None = None,
                unit: str = "MB") -> str | float:
    """A NORMLAB_CPU_* setting: one of ``choices``, or else a finite number >= 0 (of ``unit``). A bad
    value is an error that names the variable, raised when the backend loads."""
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
        raise ValueError(f"environment variable {name} must be a number of {unit} >= 0; got {raw!r}")
    return value


# How outputs are allocated: "pool" (default, above), "numpy" (numpy's allocator, unpooled) or
# "torch" (torch.empty). NORMLAB_CPU_ALLOC picks one; NORMLAB_CPU_POOL_MB caps the pool.
ALLOCATOR = env_setting("NORMLAB_CPU_ALLOC", "pool", choices=("pool", "numpy", "torch"))
POOL = BufferPool(int(env_setting("NORMLAB_CPU_POOL_MB", "1024")) << 20)


def _buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of 64-byte-aligned memory: from the pool, or unpooled (NORMLAB_CPU_ALLOC=numpy)."""
    return POOL.take(nbytes) if ALLOCATOR == "pool" else _aligned(_raw(nbytes), nbytes)


def empty(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A new C-contiguous output of ``like``'s shape in ``dtype`` (like's if None): from the pool
    from POOL.min_bytes, below it from torch's allocator."""
    nbytes = like.numel() * (like.itemsize if dtype is None else dtype.itemsize)
    if ALLOCATOR == "torch" or nbytes < POOL.min_bytes:
        # like is contiguous, so empty_like's preserved layout is too; without keywords when it
        # can, a few microseconds less (docs/cpu-kernels.md, "Fixed costs of a call")
        return torch.empty_like(like) if dtype is None else torch.empty_like(like, dtype=dtype)
    dtype = like.dtype if dtype is None else dtype
    return _with_tensor(_buffer(nbytes).view(KERNEL_CODE[dtype]), like.shape, dtype)[0]


def vector(shape: tuple[int, ...], dtype: torch.dtype, length: int) -> tuple[Tensor, np.ndarray]:
    """A result the kernel writes as a vector of ``length`` (a per-row statistic, a weight
    gradient): the tensor of ``shape`` and the same memory as a numpy array. Below the pool's
    size from numpy's allocator: kernels write these a value at a time, so numpy's alignment
    serves, and a numpy array becomes a tensor faster than torch.empty's tensor becomes an array."""
    if ALLOCATOR == "torch":
        t = torch.empty(shape, dtype=dtype)
        return t, as_numpy(t).reshape(length)
    nbytes = length * dtype.itemsize
    array = (_buffer(nbytes).view(KERNEL_CODE[dtype]) if nbytes >= POOL.min_bytes
             else np.empty(length, KERNEL_CODE[dtype]))
    return _with_tensor(array, shape, dtype)


_SCRATCH = threading.local()


def scratch(length: int, dtype: torch.dtype) -> np.ndarray:
    """At least ``length`` values of ``dtype`` that nothing reads: where a forward records no
    graph, the kernels write its per-row statistics here (the first ``length``), so that such a
    call makes no tensor for them. One array per thread and dtype, grown to the most rows a call
    has had (a statistic is 1/d of its input's size); not cut to ``length``, as a numpy slice
    costs a small call more than its kernel's writes."""
    array = _SCRATCH.__dict__.get(dtype)  # this thread's
    if array is None or array.shape[0] < length:
        array = _SCRATCH.__dict__[dtype] = np.empty(max(length, 256), KERNEL_CODE[dtype])
    return array


def _with_tensor(array: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, np.ndarray]:
    """(the tensor of ``shape`` and ``dtype`` over ``array``'s memory, ``array``)."""
    t = torch.from_numpy(array)
    if t.dtype != dtype:  # bfloat16 and float16 arrive as their bits
        t = t.view(dtype)
    return (t if t.shape == shape else t.view(shape)), array


@functools.cache  # read once for both thresholds
def _caches(root: str = "/sys/devices/system/cpu/cpu0/cache") -> tuple[tuple[int, str, int], ...]:
    """(level, type, bytes) of each of the first CPU's caches (Linux sysfs; empty elsewhere)."""
    caches = []
    for index in glob.glob(f"{root}/index*"):
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            level, kind, text = (Path(index, name).read_text().strip() for name in ("level", "type", "size"))
            text = text.upper()
            caches.append((int(level), kind, int(text[:-1]) * units[text[-1]] if text[-1] in units
                           else int(text)))
        except (OSError, ValueError, IndexError):  # an entry that is missing or not a size: skipped
            continue
    return tuple(caches)


def _last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The size of the largest CPU cache, or ``default`` where it cannot be read."""
    return max((size for _, _, size in _caches()), default=default)


def _l1_data_bytes(default: int = 32 << 10) -> int:
    """The size of one core's L1 data cache, or ``default`` where it cannot be read."""
    return next((size for level, kind, size in _caches() if level == 1 and kind == "Data"), default)


# Outputs of at least this many bytes are written with non-temporal stores (x86 only): half the
# last-level cache, where input plus output stop fitting in it, and at most 16 MiB: a VM or a
# many-core socket reports the whole socket's L3, of which one process holds a share (on a VM
# reporting 480 MiB, streaming won from 16 MiB outputs, cached or not). Below it streaming is
# slower (docs/cpu-kernels.md, "Streaming stores"). NORMLAB_CPU_STREAM_MB overrides it (0: always
# stream, as a test does to compare both paths on small tensors).
STREAM_CAP_BYTES = 16 << 20


def stream_min_bytes() -> int:
    """The output size from which stores stream, by this CPU's caches (not NORMLAB_CPU_STREAM_MB)."""
    return min(_last_level_cache_bytes() // 2, STREAM_CAP_BYTES)


STREAM_MIN_BYTES = (
    int(env_setting("NORMLAB_CPU_STREAM_MB", "") * (1 << 20))
    if os.environ.get("NORMLAB_CPU_STREAM_MB")
    else stream_min_bytes()
)


# The next row is prefetched into L2 instead of L1 where one row of the inputs a pass reads takes a
# quarter of L1 or more: this row, the next and the weights then no longer fit there together, and
# prefetches into L1 evicted what the second pass reads back (docs/cpu-kernels.md, "Prefetch").
# NORMLAB_CPU_PREFETCH_L2_KB overrides it (0: always into L2).
PREFETCH_L2_MIN_BYTES = (
    int(env_setting("NORMLAB_CPU_PREFETCH_L2_KB", "", unit="KB") * (1 << 10))
    if os.environ.get("NORMLAB_CPU_PREFETCH_L2_KB")
    else _l1_data_bytes() // 4
)


def prefetch_far(row_bytes: int) -> bool:
    """The kernels' ``far``: whether the next row, ``row_bytes`` over the inputs a pass reads,
    is prefetched into L2 rather than L1."""
    return row_bytes >= PREFETCH_L2_MIN_BYTES


# Rows whose x takes at most SHORT_ROW_BYTES (qk-norm's heads) prefetch the row SHORT_ROWS_AHEAD
# rows on, not the next one, where that was measured to gain: on the Intel Xeon of the records a
# short row took too little time for the next row's lines to arrive (8 rows on: 1.06-1.35x at
# 64-128 features). On a Zen 4 it gained nothing and cost up to 30% in float32 backwards, so
# AMD's CPUs (LLVM names them znver*) keep the next row (docs/cpu-kernels.md, "Short rows").
# NORMLAB_CPU_PREFETCH_ROWS overrides it (1: the next row).
SHORT_ROW_BYTES = 512


def short_rows_ahead(cpu_name: str) -> int:
    """How many rows on short rows prefetch on a CPU that LLVM names ``cpu_name``."""
    return 1 if cpu_name.startswith("znver") else 8


SHORT_ROWS_AHEAD = (
    max(1, int(env_setting("NORMLAB_CPU_PREFETCH_ROWS", "", unit="rows")))
    if os.environ.get("NORMLAB_CPU_PREFETCH_ROWS")
    else short_rows_ahead(llvm.get_host_cpu_name())
)


def prefetch_skip(row_bytes: int) -> int:
    """The kernels' ``skip``: how many rows past the next one the prefetches reach, for rows whose
    x takes ``row_bytes``."""
    return SHORT_ROWS_AHEAD - 1 if row_bytes <= SHORT_ROW_BYTES else 0


def describe(x86: bool) -> str:
    """What ``normlab info`` says of streaming and prefetching here, and what sets each."""
    stream = (f"outputs from {STREAM_MIN_BYTES / (1 << 20):g} MiB streamed past the caches "
              "(NORMLAB_CPU_STREAM_MB)" if x86 else
              "outputs never streamed past the caches (non-temporal stores: x86 only)")
    ahead = "the next row" if SHORT_ROWS_AHEAD == 1 else f"the row {SHORT_ROWS_AHEAD} on"
    return (f"{stream}; the next row prefetched into L2, not L1, from rows of "
            f"{PREFETCH_L2_MIN_BYTES / (1 << 10):g} KiB (NORMLAB_CPU_PREFETCH_L2_KB); rows of x up to "
            f"{SHORT_ROW_BYTES} bytes prefetch {ahead} (NORMLAB_CPU_PREFETCH_ROWS)")


_SERIAL_MB = env_setting("NORMLAB_CPU_SERIAL_MB", "") if os.environ.get("NORMLAB_CPU_SERIAL_MB") else None


def serial_max_bytes(passive: bool) -> int:
    """Calls whose output is smaller than this run on the calling thread alone: waking numba's
    idle workers costs more than they save there. Where they sleep when idle (``passive``:
    OMP_WAIT_POLICY=PASSIVE, or the tbb and workqueue layers) a wake costs 40-80 us and one
    thread wins up to about 2 MiB; where they spin (GNU OpenMP's default), up to about 128 KiB
    (docs/cpu-kernels.md, "Fixed costs of a call"). NORMLAB_CPU_SERIAL_MB overrides both (0:
    every call may use all threads)."""
    if _SERIAL_MB is not None:
        return int(_SERIAL_MB * (1 << 20))
    return (2 << 20) if passive else (128 << 10)


@functools.cache
def zero_stages(count: int) -> np.ndarray:
    """The kernels' staging rows, one per chunk (simd.STAGE_WIDTH). Nothing writes them, so calls
    and threads share one set per chunk count; torch aligns them to 64 bytes, so the line of
    zeros the kernels load is one cache line."""
    return torch.zeros(count, STAGE_WIDTH, dtype=torch.float32).numpy()
