"""What every kernel does per row and per chunk of rows, whatever the op.

Every kernel takes 2-D C-contiguous (rows, d) arrays (from the launchers, as the address triples
that ``at`` turns into arrays) and splits the rows into ``nchunks`` contiguous chunks, one
``prange`` iteration each. A chunk owns its slice of the outputs and its own row of the
weight-gradient partials, so the same inputs and chunk count give bitwise-identical outputs and
gradients, whichever thread ran which chunk. Each row is worked in two passes: its statistics
(streaming it from memory), then its outputs (reading it again from cache), by the same loops
whatever the rest of the call, so a row's result does not depend on the batch it came in.

The chunk loop is the same in all eight kernels, written out in each so that a kernel reads top
to bottom (each row's work differs in its arguments, pairs of rows and partial rows)::

    for c in prange(nchunks):
        r0, r1 = chunk_span(c, nchunks, n)
        for r in range(r0, r1):
            ...                                   # the row's two passes
            if (r - r0) % FLUSH == FLUSH - 1:     # backward: the chunk's float32 partial rows
                flush_into(dwc, dw_sum[c])            # (dw, db) into its float64 rows, every FLUSH rows
        flush_into(dwc, dw_sum[c])                    # backward: and at the chunk's end
        if stream:                                # after non-temporal stores, the fence that
            store_fence()                        # orders them before the call returns

The float64 rows are then summed in chunk order (``sum_partials``), so the gradients do not
depend on which thread ran which chunk.
"""

from __future__ import annotations

import math

import numpy as np
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .cache import kernel
from .codecs import load_at, pair_unorder, round_like, store_at
from .simd import AVX512, BLOCK, EMIT, HALF, HW_BF16


@kernel
def start_threads(n):
    """A trivial parallel loop: the first one a process runs starts numba's threading layer."""
    total = 0
    for i in prange(n):
        total += i
    return total


@njit
def all_finite(v):
    """Whether every value of vector ``v`` (a weight, a bias) is finite."""
    for i in range(v.shape[0]):
        if not math.isfinite(v[i]):
            return False
    return True


@njit
def nan_free(params_finite, row_rstd, mean):
    """Whether a forward's outputs for a row are free of nan (forward_block's ``finite``): with
    finite weights, a finite row ``mean`` (0 for RMSNorm) and a finite, positive ``row_rstd``.
    That rstd means every value in the statistic was finite (an inf or nan makes the sum of
    squares inf or nan, and rstd 0 or nan) and bounds |(x - mean) * rstd| by about sqrt(d), so
    times a weight and plus a bias the outputs may overflow to inf but never become nan."""
    return params_finite and math.isfinite(mean) and 0.0 < row_rstd < math.inf


@njit
def grad_nan_free(row_rstd, s0, s1, c0, c1):
    """Whether a backward's paired dx blocks for a row are free of nan (backward_block's
    ``finite``, where grad_select_optional): with pass 1's sums ``s0``, ``s1`` and the row's
    coefficients ``c0``, ``c1`` finite, and a finite ``row_rstd``. A sum is finite only if every
    term was (an inf or nan term makes it inf or nan), and each term is g * x (RMSNorm; g = dy * w)
    or g and g * xhat (LayerNorm): so every g and x, or x - mean, that pass 2 reads is finite, and
    each dx is fmas of finite values (an fma's product is exact), which may overflow to inf but
    never make a nan."""
    return (math.isfinite(row_rstd) and math.isfinite(s0) and math.isfinite(s1)
            and math.isfinite(c0) and math.isfinite(c1))


@njit
def chunk_span(c, nchunks, n):
    return c * n // nchunks, (c + 1) * n // nchunks


@njit
def value_at(xr, rr, sr, i):
    """Element i of the row being normalized: x, or in the add variants (rr given) the residual
    sum x + r rounded to sr's dtype, which is stored in sr on the way."""
    if rr is None:
        return load_at(xr, i)
    v = round_like(sr, load_at(xr, i) + load_at(rr, i))
    store_at(sr, i, v)
    return v


@njit
def recip(x):
    """1 / x as float32, inf at 0 (eps = 0 on a zero row) where numba would raise ZeroDivisionError."""
    return np.float32(math.inf) if x == 0.0 else np.float32(1.0 / x)


@intrinsic
def _address(typingctx, address):
    """An integer address as a pointer."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(address), codegen


def at(a):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(at, inline="always")
def _ov_at(a):
    """A kernel argument as the array it reads: an array (or None) as it is, or an (address,
    shape, dtype witness) triple as the C-contiguous array at that address. The launchers pass
    tensors' memory as triples: a numpy view of a tensor costs several torch calls, which at
    small sizes took longer than the kernel (docs/cpu-kernels.md, "Fixed costs of a call")."""
    if isinstance(a, types.BaseTuple):
        return lambda a: carray(_address(a[0]), a[1], a[2].dtype)
    return lambda a: a


def widened(w):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(widened)
def _ov_widened(w):
    """A weight vector as the float32 the kernels compute with: as it is, or widened (exactly)
    from the 16-bit dtype in which the llama order's launcher passes it: that order multiplies
    in the output's dtype, so the weight arrives already in it, and a bf16 model's weight needs
    no conversion before the call."""
    if w.dtype == types.float32:
        return lambda w: w

    def impl(w):
        out = np.empty(w.shape[0], np.float32)
        for i in range(w.shape[0]):
            out[i] = load_at(w, i)
        return out

    return impl


def row_of(a, r):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(row_of, inline="always")
def _ov_row(a, r):
    """a[r], or None when a is None (an optional input such as the residual gradient). An
    overload rather than an ``if a is None`` branch: numba would type that value Optional.

    A row of a C-contiguous matrix comes without a reference to the matrix's memory: ``a[r]``
    takes one and drops it, two calls into numba's runtime a row, around which the vector
    registers are spilled (docs/cpu-kernels.md, "Row views without references"). A kernel's
    arguments outlive its rows, so nothing is freed under them."""
    if _is_none(a):
        return lambda a, r: None
    if isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.mutable:
        return lambda a, r: _row_view(a, r)
    return lambda a, r: a[r]


@intrinsic
def _row_view(typingctx, a, r):
    """Row r of the C-contiguous matrix a, as an array that holds no reference (no meminfo)."""
    row = types.Array(a.dtype, 1, "C")

    def codegen(context, builder, signature, args):
        matrix = context.make_array(a)(context, builder, args[0])
        out = context.make_array(row)(context, builder)
        d = builder.extract_value(matrix.shape, 1)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(a.dtype)))
        context.populate_array(out, data=builder.gep(matrix.data, [builder.mul(args[1], d)]),
                               shape=cgutils.pack_array(builder, [d]),
                               strides=cgutils.pack_array(builder, [itemsize]), itemsize=itemsize,
                               meminfo=None)
        return out._getvalue()

    return row(a, types.intp), codegen


@njit
def block_spans(out, i0, i1, stream):
    """Split [i0, i1) of an output row into a plain head [i0, a), whole blocks [a, b) and a plain
    tail [b, i1). With ``stream`` the blocks start at the row's first 64-byte boundary, as
    non-temporal stores need."""
    a = i0
    if stream:
        size = out.itemsize
        misalign = (np.int64(out.ctypes.data) + i0 * size) % 64
        a = i0 + min(i1 - i0, ((64 - misalign) % 64) // size)
    return a, a + (i1 - a) // EMIT * EMIT


# ------------------------------------------------------------------------- typing-time choices


def _is_none(t):
    """Whether a numba argument type is None (or the argument was left out)."""
    return t is None or isinstance(t, (types.NoneType, types.Omitted))


def is_llama(round_to):
    return not _is_none(round_to) and round_to.dtype != types.float32


def pair_types(x, dy, ds=None):
    """Whether numba array types x and dy (and ds, when given) are all bf16: the rows the
    backward reads in pairs (bf16_pair)."""
    return x.dtype == dy.dtype == types.uint16 and (_is_none(ds) or ds.dtype == types.uint16)


def reads_pairs(x, dy, ds=None):  # pragma: no cover - replaced by the overload below
    """Whether the backward reads its rows in bf16 pairs with w in pair_order."""
    raise NotImplementedError


@overload(reads_pairs)
def _ov_paired(x, dy, ds=None):
    every = pair_types(x, dy, ds)
    return lambda x, dy, ds=None: every


def writes_pairs(x, y):  # pragma: no cover - replaced by the overload below
    """Whether a forward reads bf16 row x and writes bf16 row y in pairs (forward_block's
    ``paired``): where bf16 is rounded with integer arithmetic (no AVX512-BF16), which then
    needs no shuffle to put values back in place; with the instruction the in-order path is
    kept."""
    raise NotImplementedError


def pairs_fit(x, y) -> bool:
    """writes_pairs on numba array types, at typing time."""
    return pair_types(x, y) and not HW_BF16


@overload(writes_pairs)
def _ov_writes_pairs(x, y):
    both = pairs_fit(x, y)
    return lambda x, y: both


def grad_select_optional(x, dy, ds):  # pragma: no cover - replaced by the overload below
    """Whether the backward's paired dx blocks round bf16 with integer arithmetic (no
    AVX512-BF16), where a row proven nan-free may skip the nan select (grad_nan_free), and read
    no ds: the residual's gradient is in no sum of pass 1, so nothing proves it finite."""
    raise NotImplementedError


def select_optional(x, dy, ds) -> bool:
    """grad_select_optional on numba array types, at typing time."""
    return _is_none(ds) and pair_types(x, dy) and not HW_BF16


@overload(grad_select_optional)
def _ov_grad_select_optional(x, dy, ds):
    optional = select_optional(x, dy, ds)
    return lambda x, dy, ds: optional


def vector_sums(a):  # pragma: no cover - replaced by the overload below
    """Whether pass 1 over row ``a`` takes the vector loops (simd._row_sums): 16-bit rows,
    where the sums set the pace. A float32 row waits on memory, and there they were slower."""
    raise NotImplementedError


@overload(vector_sums)
def _ov_vector_sums(a):
    vector = a.dtype != types.float32
    return lambda a: vector


def sums_block(xr, dyr, loop):  # pragma: no cover - replaced by the overload below
    """What a backward's pass-1 whole blocks end at a multiple of: HALF for the vector pass of
    bf16 rows (simd._for_blocks), ``loop`` (the element loops' block) for other dtypes."""
    raise NotImplementedError


@overload(sums_block, prefer_literal=True)
def _ov_sums_block(xr, dyr, loop):
    # a constant (``loop`` a literal): returned as a value, it changed layer_norm's float32 dx
    # bits (the element loops' reassociated sums compiled another way)
    block = HALF if pair_types(xr, dyr) else loop.literal_value
    return lambda xr, dyr, loop: block


# Row pairs: the bf16 backward's pass 1 takes two rows at once where a row's whole blocks span at
# least PAIR_ROWS_MIN values: its float32 partial rows outgrow L1 there, and two rows halve that
# traffic. Below it, rows read side by side slowed the stream prefetcher (docs/cpu-kernels.md).
PAIR_ROWS_MIN = 4096


@njit
def row_pairs(x, dy, k, fit):
    """Whether the backward takes its rows in pairs (see PAIR_ROWS_MIN); ``fit``: pair_registers."""
    return fit and reads_pairs(x, dy) and k - k % BLOCK >= max(PAIR_ROWS_MIN, BLOCK)


# Short 16-bit rows go through a forward in groups of ROW_GROUP: pass 1 of every row of the group,
# then their scales, then pass 2 of each, so that one row's chain of division and square roots
# overlaps the other rows' work instead of holding up its own writes. Only where x's row takes at
# most GROUP_ROW_BYTES: from memory, longer rows ran slower grouped, and float32 rows (already at
# memory speed) slower at 64-256 features (docs/cpu-kernels.md, "Short rows in groups").
ROW_GROUP = 8
GROUP_ROW_BYTES = 512


def grouped_rows(x, d):  # pragma: no cover - replaced by the overload below
    """Whether a forward takes rows of ``d`` values of x in groups of ROW_GROUP."""
    raise NotImplementedError


@overload(grouped_rows)
def _ov_grouped_rows(x, d):
    able = x.dtype != types.float32
    size = x.dtype.bitwidth // 8
    return lambda x, d: able and d * size <= GROUP_ROW_BYTES


# LayerNorm's bf16 forward, converted by AVX512-BF16, takes its rows in pairs above
# FORWARD_PAIRS_ABOVE features, where the float32 weight and bias (8 bytes a value) outgrow a 32 KB
# L1: pass 2 then reads them from L2 once for two rows. With integer rounding (AVX2, plain
# AVX-512) two rows' blocks spilled and ran 0.4-0.8x; fp32 and fp16 rows, and the residual-add
# variant, gained nothing (docs/cpu-kernels.md, "Row pairs in the bf16 forward").
FORWARD_PAIRS_ABOVE = 4096


def forward_pairs(x, d):  # pragma: no cover - replaced by the overload below
    """Whether a forward over rows of ``d`` values of x takes them in pairs (FORWARD_PAIRS_ABOVE)."""
    raise NotImplementedError


def forward_pairs_fit(x) -> bool:
    """Whether rows of x can go in pairs at all (forward_pairs), on numba array types at typing
    time: where not, the kernels leave the pair code out."""
    return x.dtype == types.uint16 and HW_BF16


@overload(forward_pairs)
def _ov_forward_pairs(x, d):
    able = forward_pairs_fit(x)
    return lambda x, d: able and d > FORWARD_PAIRS_ABOVE


def pair_registers(round_to, one_sum):  # pragma: no cover - replaced by the overload below
    """Whether two rows' pass-1 accumulators fit the vector registers together: always with
    AVX-512; with a quarter of its register lanes (AVX2, NEON) only for one sum a row
    (``one_sum``, RMSNorm with eps inside the root) without the llama order's rounding. Pairs
    that spill ran 4-44% slower than single rows in AVX2 code (docs/cpu-kernels.md)."""
    raise NotImplementedError


@overload(pair_registers)
def _ov_pair_registers(round_to, one_sum):
    if AVX512:
        return lambda round_to, one_sum: True
    if is_llama(round_to):
        return lambda round_to, one_sum: False
    return lambda round_to, one_sum: one_sum


# ------------------------------------------------------------------ weight-gradient partials


@njit
def partial_rows(nchunks, d):
    """Zeroed float32 rows, one per chunk, 128 bytes or more apart. numba aligns an array to 32
    bytes only, so two chunks' rows could share a cache line, which the threads then took from
    each other on every row (rms_norm's bf16 backward at 64 features ran 7 or 12 ms by where the
    array fell; docs/cpu-kernels.md, "Short rows"). (Its own function: in a parallel kernel's
    body numba turns np.zeros into a parallel loop, more compile time for every signature.)"""
    return np.zeros((nchunks, (d + 15) // 16 * 16 + 32), np.float32)


@njit
def partial_row_pairs(nchunks, d):
    """Zeroed float32 rows, two per chunk (rows 2c and 2c + 1: dw's and db's), each starting half
    a 4 KiB page from its partner. A loop that updates both at the same index loads one just
    after it stored the other, and where the two sit at the same address modulo 4 KiB (as two
    allocations of one size do) the CPU holds the load as a possible reload of the store: "4K
    aliasing" (docs/cpu-kernels.md, "The backward's weight gradients")."""
    stride = (d + 1023) // 1024 * 1024 + 512
    return np.zeros((2 * nchunks, stride), np.float32)


# The hot loops add a chunk's weight-gradient terms to a float32 partial row; every FLUSH rows that
# row is added to a float64 one and zeroed. One float32 sum over all of a chunk's rows lost
# accuracy with their count (16384 rows: 17 times the error of torch's float32 sum).
FLUSH = 64  # even, so that a pair of rows never straddles a flush


@njit
def partial_sums(nchunks, d):
    """Zeroed float64 rows, one per chunk: the flushed partial rows."""
    return np.zeros((nchunks, d), np.float64)


@njit
def flush_into(part, total):
    """total += part in float64, and part = 0 (part may run past total's end: padding)."""
    for i in range(total.shape[0]):
        total[i] += part[i]
        part[i] = 0.0


@njit
def sum_partials(part, span, out):
    """out = the float64 partial rows summed in chunk order (deterministic for a chunk count),
    rounded to float32, put back in place from pair order over [0, span) and stored in out's
    dtype (rounded to nearest even, as torch converts)."""
    total = part[0].copy()
    for c in range(1, part.shape[0]):
        total += part[c]
    total = pair_unorder(total.astype(np.float32), span)
    for i in range(total.shape[0]):
        store_at(out, i, total[i])
