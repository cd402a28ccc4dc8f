"""numba kernels for the CPU backend: the compute layer only (launchers live in cpu.py).

One file on purpose, although it passes STYLE.md's 600 lines: numba's on-disk cache checks only
the timestamp of the file that defines a kernel, so helpers split into another module could
change while cached kernels that inlined them stay stale.

Every kernel takes 2-D C-contiguous (rows, d) arrays and splits the rows into ``nchunks``
contiguous chunks, one ``prange`` iteration each. A chunk owns its slice of the outputs and its
own row of the weight-gradient partials, so results do not depend on which thread ran which
chunk: the same inputs and chunk count give bitwise-identical outputs and gradients.

dtypes travel as numpy arrays: float32 as is, bfloat16 as uint16 bit patterns and float16 as
int16 bit patterns (numba has neither type). ``_load`` widens an element to float32, ``_store``
narrows a float32 with round-to-nearest-even (bf16 by integer arithmetic, fp16 by LLVM's
fptrunc); whole output blocks are narrowed as vectors by ``_emit`` ("block output" below). numba
compiles one specialization per dtype combination.

Statistics: the row sums (sum x, sum x^2, sum g*x) accumulate in float64, which is free on a
memory-bound kernel and keeps long rows (65537 features) accurate to a few fp32 ulps; the
per-element math and the weight-gradient partials are float32. LayerNorm's saved mean is float64
so that rows with a large mean (1e4) keep their centred values exact in the backward.
"""

from __future__ import annotations

import math
import platform

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

# Reassociation lets LLVM vectorize the reductions. No nnan/ninf: inf and nan rows must behave as
# IEEE says (and stay in their row). No contraction either: an FMA in g - mean(g) leaves the
# rounding error of g (times rstd, up to 1/sqrt(eps)) where the exact answer is 0.
FASTMATH = {"reassoc"}
JIT = dict(cache=True, fastmath=FASTMATH, nogil=True)


# ------------------------------------------------------------------------------ dtype codecs


@intrinsic
def _u32_as_f32(typingctx, v):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _f32_as_u32(typingctx, v):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _f16_bits_to_f32(typingctx, v):
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


@intrinsic
def _f32_to_f16_bits(typingctx, v):
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.int16(types.float32), codegen


@intrinsic
def _fma32(typingctx, a, b, c):
    """a * b + c for float32 scalars, rounded once (the vector blocks' fma, element by element)."""

    def codegen(context, builder, signature, args):
        return _fma(builder, *args)

    f = types.float32
    return f(f, f, f), codegen


@njit
def _bf16_bits_to_f32(b):
    return _u32_as_f32(np.uint32(b) << np.uint32(16))


@njit
def _f32_to_bf16_bits(v):
    b = _f32_as_u32(v)
    # round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate
    rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    # nan becomes the canonical quiet nan (as torch's conversion does). Written as a select on
    # v == v: this form vectorizes (measured: other branch-free forms ran at half the speed).
    return np.uint16(rounded if v == v else np.uint32(0x7FC0))


def _load(a, i):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


def _store(a, i, v):  # pragma: no cover
    raise NotImplementedError


def _round_like(a, v):  # pragma: no cover
    raise NotImplementedError


# Indices go through np.uint64: numba wraps negative signed indices around (i += n when i < 0),
# which makes the address non-affine and turned the blocked loops into AVX-512 gathers and
# scatters at a fraction of the speed. An unsigned index has no wraparound.


@overload(_load)
def _ov_load(a, i):
    if a.dtype == types.float32:
        return lambda a, i: a[np.uint64(i)]
    if a.dtype == types.uint16:
        return lambda a, i: _bf16_bits_to_f32(a[np.uint64(i)])
    if a.dtype == types.int16:
        return lambda a, i: _f16_bits_to_f32(a[np.uint64(i)])


@njit
def _store_f32(a, i, v):
    a[np.uint64(i)] = v


@njit
def _store_bf16(a, i, v):
    a[np.uint64(i)] = _f32_to_bf16_bits(v)


@njit
def _store_f16(a, i, v):
    a[np.uint64(i)] = _f32_to_f16_bits(v)


@njit
def _accumulate(a, i, v):
    a[np.uint64(i)] += v


@overload(_store)
def _ov_store(a, i, v):
    if a.dtype == types.float32:
        return lambda a, i, v: _store_f32(a, i, v)
    if a.dtype == types.uint16:
        return lambda a, i, v: _store_bf16(a, i, v)
    if a.dtype == types.int16:
        return lambda a, i, v: _store_f16(a, i, v)


@overload(_round_like)
def _ov_round_like(a, v):
    """v rounded to a's dtype and widened back to float32 (the llama cast of xhat)."""
    if a.dtype == types.float32:
        return lambda a, v: v
    if a.dtype == types.uint16:
        return lambda a, v: _bf16_bits_to_f32(_f32_to_bf16_bits(v))
    if a.dtype == types.int16:
        return lambda a, v: _f16_bits_to_f32(_f32_to_f16_bits(v))


@njit
def _chunk(c, nchunks, n):
    return c * n // nchunks, (c + 1) * n // nchunks


# ------------------------------------------------------------------------------- row helpers
# Every kernel works a row at a time in two passes: first the row's statistics (streaming it
# from memory), then its outputs (reading it again from L1/L2). A row's sums are formed by the
# same loops whatever the rest of the call looks like, so a row's result does not depend on the
# batch it came in, on where the chunk boundaries fall, or on the store path below.
#
# Row sums run in float32 over blocks of BLOCK elements and add the block sums in float64: as
# fast as a plain float32 sum (a float64 sum ran at half the speed and made the bf16 kernels
# compute-bound) and as accurate as a float64 one for any row length. The forward's sums of a
# row's whole blocks are explicit vector loops ("row sums" below); the rest are element loops
# that LLVM vectorizes.
#
# ``rnd`` is a 1-element array whose dtype says where the normalized value is rounded before the
# weight multiply: the output dtype for the llama cast order, float32 (no rounding) for gemma.
# Making it a type keeps the choice out of the element loops.
#
# The row helpers are inlined into their kernels (numba's inline="always"), and each kernel takes
# its row views (x[r], ...) once per row: a call per row with a dozen array arguments cost
# rms_norm 10%-18% at d=1024 (bf16, interleaved A/B; none at d=16384, nor in float32, which waits
# on memory), and every view is a reference count taken and dropped (atomic operations).
# layer_norm bf16 in cache: 1.17x at d=1024 (0.96x-1.34x), 1.35x at d=256; its backward 1.08x.

BLOCK = 256


@njit
def _value(xr, rr, sr, i):
    """Element i of the row being normalized: x, or in the add variants (rr given) the residual
    sum x + r rounded to sr's dtype, which is stored in sr on the way."""
    if rr is None:
        return _load(xr, i)
    v = _round_like(sr, _load(xr, i) + _load(rr, i))
    _store(sr, i, v)
    return v


@njit(inline="always")
def _sumsq(xr, rr, sr, k):
    """Sum of the row's squares over [:k] (forming the whole residual sum when rr is given)."""
    full = k - k % BLOCK
    if rr is None and _vector_sums(xr):
        total = _row_sumsq(xr, full, np.float32(0.0), xr, None)[0]
    else:
        total = 0.0
        for j in range(0, full, BLOCK):
            _prefetch_pass1(xr, rr, j)
            part = np.float32(0.0)
            for i in range(j, j + BLOCK):
                v = _value(xr, rr, sr, i)
                part += v * v
            total += part
    part = np.float32(0.0)
    for i in range(full, k):
        v = _value(xr, rr, sr, i)
        part += v * v
    if rr is not None:
        for i in range(k, xr.shape[0]):  # past the statistic: the sum is still formed
            _value(xr, rr, sr, i)
    return total + part


@njit(inline="always")
def _moments(xr, rr, sr, row):
    """(mean, variance) of the row (``row`` is x, or the residual sum sr) in one pass: sums of
    u = x - c and u^2, with c the mean of the row's first block, then var = E[u^2] - E[u]^2.
    x - c is exact for x near c (Sterbenz), which keeps rows with a large mean (1e4) exact. The
    difference loses accuracy when E[u]^2 is not small against var (a first block unlike the
    rest of the row): then the variance comes from a second pass over the row, in cache."""
    d = row.shape[0]
    head = min(d, BLOCK)
    c = np.float32(0.0)
    for i in range(head):
        c += _value(xr, rr, sr, i)
    c = np.float32(c / head)
    full = d - d % BLOCK
    if rr is None and _vector_sums(xr):
        s1, s2 = _row_moments(xr, full, c, xr, None)
    else:
        s1 = 0.0
        s2 = 0.0
        for j in range(0, full, BLOCK):
            _prefetch_pass1(xr, rr, j)
            p1 = np.float32(0.0)
            p2 = np.float32(0.0)
            for i in range(j, j + BLOCK):
                u = _value(xr, rr, sr, i) - c
                p1 += u
                p2 += u * u
            s1 += p1
            s2 += p2
    p1 = np.float32(0.0)
    p2 = np.float32(0.0)
    for i in range(full, d):
        u = _value(xr, rr, sr, i) - c
        p1 += u
        p2 += u * u
    m1 = (s1 + p1) / d
    mean = np.float64(c) + m1
    var = (s2 + p2) / d - m1 * m1
    if not m1 * m1 <= var * 0.0625:  # also taken for var <= 0 and nan
        var = _variance(row, d, mean)
    return mean, var


@njit
def _centred(v, mhi, mlo):
    # x - mean with the float64 mean split in two float32 parts: v - mhi is exact for v near the
    # mean (Sterbenz), so rows with a large mean (1e4) keep their centred values to an ulp.
    return (v - mhi) - mlo


@njit
def _split(mean):
    mhi = np.float32(mean)
    return mhi, np.float32(mean - np.float64(mhi))


@njit
def _variance(xr, n, mean):
    """A second pass over a row in cache: mean((x - mean)^2), no cancellation."""
    mhi, mlo = _split(mean)
    total = 0.0
    full = n - n % BLOCK
    for j in range(0, full, BLOCK):
        part = np.float32(0.0)
        for i in range(j, j + BLOCK):
            c = _centred(_load(xr, i), mhi, mlo)
            part += c * c
        total += part
    part = np.float32(0.0)
    for i in range(full, n):
        c = _centred(_load(xr, i), mhi, mlo)
        part += c * c
    return (total + part) / n


@njit(parallel=True, cache=True)
def start_threads(n):
    """A trivial parallel loop: the first one a process runs starts numba's threading layer."""
    total = 0
    for i in prange(n):
        total += i
    return total


@njit
def _recip(x):
    """1 / x as float32, inf at 0 (eps = 0 on a zero row) where numba would raise ZeroDivisionError."""
    return np.float32(math.inf) if x == 0.0 else np.float32(1.0 / x)


@njit
def _rms_scale(ss, k, eps, inside):
    ms = ss / k
    if inside:
        return _recip(math.sqrt(ms + eps))
    return _recip(math.sqrt(ms) + eps)


def _row(a, r):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_row)
def _ov_row(a, r):
    """a[r], or None when a is None (an optional input such as the residual gradient). An
    overload rather than an ``if a is None`` branch: numba would type that value Optional."""
    if isinstance(a, (types.NoneType, types.Omitted)):
        return lambda a, r: None
    return lambda a, r: a[r]


# ------------------------------------------------------------------------- block output
# Output rows are written in blocks of EMIT values, each computed from the inputs as explicit
# 16-lane vectors and stored (_make_forward_block, _make_backward_block), with the arithmetic of
# the element helpers that write the rows' heads and tails. Until 2026-11-29 an element loop
# computed a block into a float32 staging row and a second step converted and stored it; without
# that round trip, bf16 at d=1024 (interleaved A/B): forward in cache rms_norm 1.19x, layer_norm
# 1.07x, from memory layer_norm 1.14x; backward from memory 1.15x-1.2x (other shapes and float32
# within the noise). _store_block converts a block: bf16 through the CPU's vcvtneps2bf16 where it
# has one (AVX512-BF16), else by integer round-to-nearest-even with a nan select; fp16 through
# vcvtps2ph. Against rounding element by element inside a vectorized loop (same bits, below),
# bf16 rows in cache, interleaved A/B: rms_norm 1.02x-1.19x, layer_norm 1.34x-1.41x, backward
# 1.0x; from memory 0.85x-1.12x. Blocks are small and, unless streamed, the next block's lines
# are prefetched for writing: blocks of 256 stored their lines in bursts whose fills stalled the
# stores (memory-bound bf16 rms_norm 20% slower).
#
# Streaming: outputs larger than the last-level cache go out with non-temporal stores. A normal
# store first reads the line it writes into the cache (read-for-ownership), so a kernel that
# reads x and writes y moves three streams through memory; a non-temporal store writes the line
# out whole: two streams. Measured on the 2-core EPYC: y = 2x with non-temporal stores ran at
# 1.2x-1.5x the speed of torch's copy_, with normal stores at 0.9x-1.0x; on a tensor that fits in
# cache they are 2x-3x slower, hence the size threshold in the launchers (``nt``). With ``nt`` a
# row's blocks start at its first 64-byte boundary (plain stores before it and after the last
# whole block), so every vector store is aligned, as non-temporal stores must be. 16-bit outputs
# stream whole 64-byte lines, two vectors converted together (``_narrow_line``): against storing
# each vector's bits in the staging row and streaming them from there, as before, bf16 from
# memory (interleaved A/B, 2 threads) rms_norm 1.04x-1.15x, layer_norm 1.07x-1.12x, backward
# 0.85x-1.29x (mostly above 1.05x).
#
# The vector conversions give the bits of the scalar ones (``_store``, ``_round_like``) that
# write the rows' heads and tails, with two exceptions where the CPU's bf16 instruction is used:
# results below bf16's smallest normal (1.2e-38) flush to zero, and a nan keeps its sign and
# payload (quieted) instead of becoming 0x7FC0. Neither occurs in a normalized row of finite
# values (tests/test_kernels_cpu.py checks the conversions against the scalar ones).

EMIT = 64  # outputs per block: small, so stores and their line fills interleave with the arithmetic
X86 = platform.machine().lower() in ("x86_64", "amd64")
HW_BF16 = numba.config.CPU_NAME is None and bool(llvm.get_host_cpu_features().get("avx512bf16", False))


class _BFloat(ir.types.Type):
    """LLVM's bfloat type, which llvmlite.ir does not spell."""

    null = "0.0"

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash(_BFloat)


_LANES = 16


def _vconst(ty, value):
    return ir.Constant(ir.VectorType(ty, _LANES), [value] * _LANES)


def _narrow(builder, x, kind, hw):
    """<16 x float> -> the output's bits (<16 x i16>), or x itself for float32. ``hw``: bf16
    through the CPU's instruction."""
    i16, i32 = ir.IntType(16), ir.IntType(32)
    if kind == types.float32:
        return x
    if kind == types.int16:  # fp16
        return builder.bitcast(builder.fptrunc(x, ir.VectorType(ir.HalfType(), _LANES)), ir.VectorType(i16, _LANES))
    if hw:
        return builder.bitcast(builder.fptrunc(x, ir.VectorType(_BFloat(), _LANES)), ir.VectorType(i16, _LANES))
    b = builder.bitcast(x, ir.VectorType(i32, _LANES))
    lsb = builder.and_(builder.lshr(b, _vconst(i32, 16)), _vconst(i32, 1))
    r = builder.lshr(builder.add(builder.add(b, _vconst(i32, 0x7FFF)), lsb), _vconst(i32, 16))
    r = builder.select(builder.fcmp_unordered("uno", x, x), _vconst(i32, 0x7FC0), r)
    return builder.trunc(r, ir.VectorType(i16, _LANES))


def _widen(builder, bits, kind):
    """The inverse of _narrow: the rounded values as <16 x float>."""
    f32 = ir.VectorType(ir.FloatType(), _LANES)
    if kind == types.float32:
        return bits
    if kind == types.int16:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), _LANES)), f32)
    wide = builder.zext(bits, ir.VectorType(ir.IntType(32), _LANES))
    return builder.bitcast(builder.shl(wide, _vconst(ir.IntType(32), 16)), f32)


def _prefetch_ir(builder, ptr, write):
    """A prefetch of the line at ``ptr`` into all cache levels (never faults, in bounds or not)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, int(write)), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _prefetch_next_block(builder, base, kind):
    """Prefetch for writing the lines of the next block of the row (beyond its end: harmless)."""
    first = builder.bitcast(builder.gep(base, [ir.Constant(ir.IntType(64), EMIT)]), ir.IntType(8).as_pointer())
    for line in range(EMIT * (kind.bitwidth // 8) // 64):
        _prefetch_ir(builder, builder.gep(first, [ir.Constant(ir.IntType(64), 64 * line)]), write=True)


# A staging row: a line of zeros at _ZERO (the launcher zeroes the row, the kernels never write
# it), which _narrow_line needs; [0, EMIT) holds a block where _EMIT (the tests) converts one.
_ZERO = 128
STAGE_WIDTH = 192


def _narrow_line(builder, lo, hi, kind, hw, zero):
    """Two 16-lane float32 vectors -> one 64-byte line of 16-bit output bits (<32 x i16>).

    With the CPU's bf16 instruction the pair converts in one vcvtne2ps2bf16, whose result LLVM
    types as <32 x bfloat>. x86 has no non-temporal store of bfloat vectors, and LLVM folds a
    bitcast to integers into the store and then silently emits a normal store. Adding the
    staging row's line of zeros, a value LLVM cannot see through, keeps the integer vector."""
    i16x32 = ir.VectorType(ir.IntType(16), 32)
    if hw and kind == types.uint16:
        f32 = ir.VectorType(ir.FloatType(), _LANES)
        fnty = ir.FunctionType(ir.VectorType(_BFloat(), 32), [f32, f32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512bf16.cvtne2ps2bf16.512")
        bits = builder.bitcast(builder.call(fn, [hi, lo]), i16x32)  # its low half comes from the 2nd operand
        return builder.add(bits, builder.load(builder.bitcast(zero, i16x32.as_pointer()), align=4))
    pair = ir.Constant(ir.VectorType(ir.IntType(32), 32), list(range(32)))
    return builder.shuffle_vector(_narrow(builder, lo, kind, hw), _narrow(builder, hi, kind, hw), pair)


def _store_block(builder, kind, base, wbase, values, llama, nt, hw, zero):
    """Store EMIT float32 values (16-lane vectors) at ``base`` in the output's dtype. ``llama``:
    the values are x * rstd, rounded to the output's dtype, widened, multiplied by the weights at
    ``wbase`` and rounded again. ``nt``: non-temporal stores (``base`` 64-byte aligned), of whole
    64-byte lines. ``zero``: a staging row's line of zeros (see _narrow_line)."""
    nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
    if not nt:
        _prefetch_next_block(builder, base, kind)
    pending = None
    for v, x in enumerate(values):
        off = ir.Constant(ir.IntType(64), v * _LANES)
        if llama:
            x = builder.fmul(_widen(builder, _narrow(builder, x, kind, hw), kind), _load_f32(builder, wbase, v))
        if nt and kind != types.float32:  # 16-bit outputs: a line holds two vectors
            if pending is None:
                pending = x
                continue
            y = _narrow_line(builder, pending, x, kind, hw, zero)
            ptr = builder.bitcast(builder.gep(base, [ir.Constant(ir.IntType(64), (v - 1) * _LANES)]), y.type.as_pointer())
            builder.store(y, ptr, align=64).set_metadata("nontemporal", nontemporal)
            pending = None
            continue
        y = _narrow(builder, x, kind, hw)
        ptr = builder.bitcast(builder.gep(base, [off]), y.type.as_pointer())
        if nt:
            builder.store(y, ptr, align=64).set_metadata("nontemporal", nontemporal)
        else:
            builder.store(y, ptr, align=kind.bitwidth // 8)


def _bf16_pair(builder, base, at):
    """The 32 bf16 values from element ``at`` of ``base`` read two to a 32-bit lane (little-
    endian: the low one first), widened: (the even-indexed 16, the odd-indexed 16)."""
    i32 = ir.VectorType(ir.IntType(32), _LANES)
    f32 = ir.VectorType(ir.FloatType(), _LANES)
    ptr = builder.gep(base, [ir.Constant(ir.IntType(64), at)] if isinstance(at, int) else [at])
    pair = builder.load(builder.bitcast(ptr, i32.as_pointer()), align=2)
    return (builder.bitcast(builder.shl(pair, _vconst(ir.IntType(32), 16)), f32),
            builder.bitcast(builder.and_(pair, _vconst(ir.IntType(32), 0xFFFF0000)), f32))


_INTERLEAVE = ir.Constant(ir.VectorType(ir.IntType(32), 32), [i // 2 + 16 * (i % 2) for i in range(32)])


def _pair_line(builder, even, odd, hw, zero):
    """The inverse of _bf16_pair: 32 bf16 bits (<32 x i16>) in place: _narrow_line's line (the
    evens, then the odds), interleaved by one shuffle."""
    line = _narrow_line(builder, even, odd, types.uint16, hw, zero)
    return builder.shuffle_vector(line, line, _INTERLEAVE)


def _store_pairs(builder, base, values, nt, hw, zero):
    """Store float32 vectors (even, odd, even, odd, ...: see _bf16_pair) as bf16 at ``base``, 32
    values a line (``nt``: non-temporal, ``base`` 64-byte aligned)."""
    if not nt:
        _prefetch_next_block(builder, base, types.uint16)
    nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
    for c in range(len(values) // 2):
        line = _pair_line(builder, values[2 * c], values[2 * c + 1], hw, zero)
        ptr = builder.bitcast(builder.gep(base, [ir.Constant(ir.IntType(64), 32 * c)]), line.type.as_pointer())
        if nt:
            builder.store(line, ptr, align=64).set_metadata("nontemporal", nontemporal)
        else:
            builder.store(line, ptr, align=2)


def _load_f32(builder, base, v):
    """Float32 vector v (16 lanes) from a float32 pointer."""
    f32 = ir.VectorType(ir.FloatType(), _LANES)
    ptr = builder.gep(base, [ir.Constant(ir.IntType(64), v * _LANES)])
    return builder.load(builder.bitcast(ptr, f32.as_pointer()), align=4)


def _load_row(builder, base, v, kind):
    """Vector v (16 lanes, in order) from a row of ``kind``, widened to float32."""
    element = ir.FloatType() if kind == types.float32 else ir.IntType(kind.bitwidth)
    ptr = builder.gep(base, [ir.Constant(ir.IntType(64), v * _LANES)])
    bits = builder.load(builder.bitcast(ptr, ir.VectorType(element, _LANES).as_pointer()), align=kind.bitwidth // 8)
    return _widen(builder, bits, kind)


def _make_emit(llama, nt, hw=HW_BF16):
    """dst[j:j + EMIT] = src[:EMIT] (a staging row) converted to dst's dtype (see _store_block)."""

    def emit(typingctx, dst, j, src, w):
        kind = dst.dtype

        def codegen(context, builder, signature, args):
            dst_data, src_data, w_data = (
                context.make_array(signature.args[k])(context, builder, args[k]).data for k in (0, 2, 3)
            )
            values = [_load_f32(builder, src_data, v) for v in range(EMIT // _LANES)]
            zero = builder.gep(src_data, [ir.Constant(ir.IntType(64), _ZERO)])
            base, wbase = builder.gep(dst_data, [args[1]]), builder.gep(w_data, [args[1]])
            _store_block(builder, kind, base, wbase, values, llama, nt, hw, zero)
            return context.get_dummy_value()

        return types.void(dst, types.uint64, src, w), codegen

    return intrinsic(emit)


def _make_forward_block(op, llama, nt, hw=HW_BF16):
    """The forward's output block y[j:j + EMIT] computed from x[j:j + EMIT] and stored, one
    vector at a time (see _store_block), with the arithmetic of the element helpers _rms_y and
    _ln_y (the heads and tails of rows), operation for operation, so that both give the same bits:
    rms: x * rstd * w (llama: x * rstd, then as _store_block says); ln: ((x - mhi) - mlo) * rstd
    * w + b. Arguments (y, j, x, w, b, stage, mhi, mlo, rstd); rms does not use b, mhi, mlo."""

    def block(typingctx, y, j, x, w, b, stage, mhi, mlo, rs):
        kind, xkind = y.dtype, x.dtype

        def codegen(context, builder, signature, args):
            y_data, x_data, w_data, b_data, stage_data = (
                context.make_array(signature.args[k])(context, builder, args[k]).data for k in (0, 2, 3, 4, 5)
            )
            at = args[1]
            xbase, wbase, bbase = (builder.gep(data, [at]) for data in (x_data, w_data, b_data))
            mhi, mlo, rs = (_f32x16(builder, args[k]) for k in (6, 7, 8))
            values = []
            for v in range(EMIT // _LANES):
                t = _load_row(builder, xbase, v, xkind)
                if op == "ln":
                    t = builder.fsub(builder.fsub(t, mhi), mlo)
                t = builder.fmul(t, rs)
                if not llama:
                    t = builder.fmul(t, _load_f32(builder, wbase, v))
                if op == "ln":
                    t = builder.fadd(t, _load_f32(builder, bbase, v))
                values.append(t)
            zero = builder.gep(stage_data, [ir.Constant(ir.IntType(64), _ZERO)])
            _store_block(builder, kind, builder.gep(y_data, [at]), wbase, values, llama, nt, hw, zero)
            return context.get_dummy_value()

        return types.void(y, types.uint64, x, w, b, stage, types.float32, types.float32, types.float32), codegen

    return intrinsic(block)


def _make_backward_block(op, nt, hw=HW_BF16, paired=False):
    """The backward's dx block at j computed from dy and x and stored, with the arithmetic of the
    element helpers _rms_dx and _ln_dx operation for operation (same bits). Arguments (dx, j, dy,
    x, w, ds, stage, p0, p1, p2, rstd), ds None or the residual's gradient. rms ("rms_head"
    inside the statistic's first k features, "rms" past them): dx = fma(x, -p0, rstd * (dy * w))
    (or without the fma) [+ ds]; ln (see _ln_bwd_write): dx = fma(dy * w, rstd, fma(x - p0, p1,
    p2)) [+ ds]. ``paired`` (bf16 rows, the block's start a multiple of 32 from the row's): the
    inputs are read two values to a 32-bit lane, w is in pair_order, and each 32 results are
    interleaved back into place as they are stored (_pair_line)."""

    def block(typingctx, dx, j, dy, x, w, ds, stage, p0, p1, p2, rs):
        has_ds = not isinstance(ds, (types.NoneType, types.Omitted))

        def codegen(context, builder, signature, args):
            data = {k: context.make_array(signature.args[k])(context, builder, args[k]).data for k in (0, 2, 3, 4, 6)}
            if has_ds:
                data[5] = context.make_array(signature.args[5])(context, builder, args[5]).data
            at = args[1]
            base = {k: builder.gep(v, [at]) for k, v in data.items()}
            p = [_f32x16(builder, args[k]) for k in (7, 8, 9)]
            rs = _f32x16(builder, args[10])

            def row(k, kind):
                if paired:
                    return [u for c in range(EMIT // 32) for u in _bf16_pair(builder, base[k], 32 * c)]
                return [_load_row(builder, base[k], v, kind) for v in range(EMIT // _LANES)]

            dys = row(2, dy.dtype)
            xs = row(3, x.dtype) if op != "rms" else None
            dss = row(5, ds.dtype) if has_ds else None
            values = []
            for v in range(EMIT // _LANES):
                g = builder.fmul(dys[v], _load_f32(builder, base[4], v))
                if op == "ln":
                    xc = builder.fsub(xs[v], p[0])
                    t = _fma(builder, g, rs, _fma(builder, xc, p[1], p[2]))
                else:
                    t = builder.fmul(rs, g)
                    if op == "rms_head":
                        t = _fma(builder, xs[v], builder.fneg(p[0]), t)
                if has_ds:
                    t = builder.fadd(t, dss[v])
                values.append(t)
            zero = builder.gep(data[6], [ir.Constant(ir.IntType(64), _ZERO)])
            if paired:
                _store_pairs(builder, base[0], values, nt, hw, zero)
            else:
                _store_block(builder, dx.dtype, base[0], base[4], values, False, nt, hw, zero)
            return context.get_dummy_value()

        f = types.float32
        return types.void(dx, types.uint64, dy, x, w, ds, stage, f, f, f, f), codegen

    return intrinsic(block)


_BACKWARD_BLOCK = {
    (op, nt, paired): _make_backward_block(op, nt, paired=paired)
    for op in ("rms", "rms_head", "ln")
    for nt in (False, True)
    for paired in (False, True)
}


_FORWARD_BLOCK = {
    (op, llama, nt): _make_forward_block(op, llama, nt)
    for op, llamas in (("rms", (False, True)), ("ln", (False,)))
    for llama in llamas
    for nt in (False, True)
}


# The conversions on their own, from a staging row: tests/test_kernels_cpu.py checks _store_block
# through them against the scalar conversions (the integer bf16 path too, on every CPU).
_EMIT = {(llama, nt): _make_emit(llama, nt) for llama in (False, True) for nt in (False, True)}
_EMIT_INTEGER_BF16 = {key: _make_emit(*key, hw=False) for key in _EMIT}


@intrinsic
def _store_fence(typingctx):
    """This thread's non-temporal stores become visible before anything after it: sfence on
    x86 (a plain fence there orders only normal stores), a full fence elsewhere."""

    def codegen(context, builder, signature, args):
        if X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.sfence"), [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


def _prefetch_ahead(context, builder, aryty, ary, j, values, ahead=1):
    """Prefetch (for reading) the lines of values [j, j + ``values``) of the row ``ahead`` rows
    after the row ``ary`` in memory; nothing for a None."""
    if isinstance(aryty, (types.NoneType, types.Omitted)):
        return
    data = context.make_array(aryty)(context, builder, ary)
    row = builder.extract_value(data.shape, 0)
    if ahead > 1:
        row = builder.mul(row, ir.Constant(row.type, ahead))
    first = builder.gep(data.data, [builder.add(row, j)])
    first = builder.bitcast(first, ir.IntType(8).as_pointer())
    for line in range(max(1, values * aryty.dtype.bitwidth // 8 // 64)):
        _prefetch_ir(builder, builder.gep(first, [ir.Constant(ir.IntType(64), 64 * line)]), write=False)


def _make_prefetch(values):
    """A function (a, j) that prefetches (for reading) the lines of values [j, j + ``values``)
    of the row that follows the row ``a`` in memory, in bounds or not; nothing for a None. The
    line count is a compile-time constant (numba's ``a.itemsize`` is not: a loop over it cost a
    division per block)."""

    def prefetch(typingctx, a, j):
        def codegen(context, builder, signature, args):
            _prefetch_ahead(context, builder, signature.args[0], args[0], args[1], values)
            return context.get_dummy_value()

        return types.void(a, types.int64), codegen

    lines = intrinsic(prefetch)

    def fetch(a, j):  # pragma: no cover - replaced by the overload below
        raise NotImplementedError

    @overload(fetch, inline="always")
    def _ov_fetch(a, j):
        if isinstance(a, (types.NoneType, types.Omitted)):
            return lambda a, j: None
        return lambda a, j: lines(a, j)

    return fetch


# The next row's inputs are prefetched while this row is worked on, half of them during each
# pass, at the pace the pass reads this row: pass 1 (blocks of BLOCK values) fetches the next
# row's first half, pass 2 (blocks of EMIT values) its second half. So the memory is busy during
# both passes, and the next row's first pass reads from cache. Against prefetching it all in
# pass 2 (bf16 4096x4096 from memory, interleaved A/B, 1 thread): layer_norm forward 1.17x,
# backward 1.11x-1.15x, rms_norm forward 0.95x (within the noise); 2 threads: 0.9x-1.2x.
_prefetch_wide = _make_prefetch(BLOCK // 2)
_prefetch_narrow = _make_prefetch(EMIT // 2)


@njit(inline="always")  # LLVM left a call per block here: the backward ran 1.15x-1.5x slower
def _prefetch_pass1(a1, a2, j):
    """Prefetch what block j of pass 1 asks of the rows that follow a1 and a2 (an input's row r:
    its row r + 1 comes next in memory; a2 may be None): the values from j // 2."""
    _prefetch_wide(a1, j // 2)
    _prefetch_wide(a2, j // 2)


@njit(inline="always")
def _prefetch_pass2(a1, a2, j, ahead):
    """Pass 2's share for block j: the values from d // 2 + j // 2 (of the rows ``ahead`` rows
    after a1 and a2: 1, or 2 where rows go in pairs). Without these prefetches the two passes
    took turns with the memory: from memory the bf16 kernels ran at 0.45-0.57x copy speed
    instead of 0.8x."""
    h = a1.shape[0] * (ahead - 1) + a1.shape[0] // 2 + j // 2
    _prefetch_narrow(a1, h)
    _prefetch_narrow(a2, h)


# ------------------------------------------------------------------------------ row sums
# Pass 1 over a row's whole blocks, written out as vectors: per block, 16 vectors of 16 lanes
# summed into _ACC independent float32 accumulators per sum (each lane adds BLOCK / 16 / _ACC
# values), the block's lanes then added to float64 lanes, and those reduced once per row. LLVM's
# own vectorization of the element loop reduced every block to a scalar and chained its FMAs
# (in cache: layer_norm's pass 1 at 7.5 cycles per 16 bf16 values; these loops take 3.4).
# bf16 values are read two to a 32-bit lane: the low one shifted up, the high one masked, no
# widening shuffle (the sums do not care about the order; 4.4 cycles with shuffles).

_ACC = 4


def _f32x16(builder, scalar):
    v = builder.insert_element(ir.Constant(ir.VectorType(ir.FloatType(), _LANES), ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), _LANES), [0] * _LANES))


def _block_values(builder, data, base, kind):
    """The BLOCK values from element ``base`` of ``data`` as float32 vectors of 16, in an order
    fit for sums."""
    return list(_block_stream(builder, data, base, kind))


def _block_stream(builder, data, base, kind):
    """_block_values, emitted as they are used (bf16 read in pairs: _bf16_pair)."""
    start = builder.gep(data, [base])
    if kind == types.uint16:
        for v in range(BLOCK // 32):
            yield from _bf16_pair(builder, start, 32 * v)
    else:
        for v in range(BLOCK // _LANES):
            yield _load_row(builder, start, v, kind)


def _fma(builder, a, b, c):
    """a * b + c rounded once, for float32 scalars or vectors of 16."""
    ty = a.type
    name = "llvm.fma.v16f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
    return builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]), name), [a, b, c])


def _tree(builder, vectors):
    """The vectors added pairwise, in a fixed order."""
    while len(vectors) > 1:
        vectors = [builder.fadd(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def _half(builder, v, h):
    """The low (h=0) or high (h=1) half of a vector's lanes."""
    n = v.type.count // 2
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), n), list(range(h * n, (h + 1) * n))))


def _f64_totals(builder, count):
    """``count`` running float64 totals, each two 8-lane vectors (a 16-lane float32 block's halves)."""
    f64 = ir.VectorType(ir.DoubleType(), _LANES // 2)
    return [[cgutils.alloca_once_value(builder, ir.Constant(f64, [0.0] * f64.count)) for _ in range(2)] for _ in range(count)]


def _add_blocks(builder, acc, totals):
    """Add each sum's block (its _ACC float32 accumulators, added pairwise) to its float64 total."""
    f64 = ir.VectorType(ir.DoubleType(), _LANES // 2)
    for sums, total in zip(acc, totals):
        block = _tree(builder, sums)
        for h, t in enumerate(total):
            builder.store(builder.fadd(builder.load(t), builder.fpext(_half(builder, block, h), f64)), t)


def _totals(builder, totals):
    """The float64 totals as scalars."""
    return [_lanes_sum(builder, _tree(builder, [builder.load(t) for t in total])) for total in totals]


def _lanes_sum(builder, v):
    """The lanes of a float64 vector added pairwise: one scalar."""
    while v.type.count > 1:
        v = builder.fadd(_half(builder, v, 0), _half(builder, v, 1))
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


def _make_row_sums(centred):
    """An intrinsic (xr, n, c, a1, a2) -> (float64, float64) over the values [0, n) of row xr
    (n a multiple of BLOCK): with ``centred`` the sums of u and u^2 for u = x - c, else the sum
    of x^2 (and 0.0; c is not used). Block j prefetches as _prefetch_pass1(a1, a2, j) does."""

    def row_sums(typingctx, xr, n, c, a1, a2):
        kind = xr.dtype

        def codegen(context, builder, signature, args):
            f32 = ir.VectorType(ir.FloatType(), _LANES)
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            shift = _f32x16(builder, args[2])
            nsums = 2 if centred else 1
            totals = _f64_totals(builder, nsums)
            blocks = builder.udiv(args[1], ir.Constant(ir.IntType(64), BLOCK))
            with cgutils.for_range(builder, blocks) as loop:
                base = builder.mul(loop.index, ir.Constant(ir.IntType(64), BLOCK))
                half = builder.udiv(base, ir.Constant(ir.IntType(64), 2))
                for k in (3, 4):
                    _prefetch_ahead(context, builder, signature.args[k], args[k], half, BLOCK // 2)
                acc = [[ir.Constant(f32, [0.0] * _LANES)] * _ACC for _ in range(nsums)]
                for v, x in enumerate(_block_values(builder, data, base, kind)):
                    a = v % _ACC
                    if centred:
                        x = builder.fsub(x, shift)
                        acc[1][a] = _fma(builder, x, x, acc[1][a])
                        acc[0][a] = builder.fadd(acc[0][a], x)
                    else:
                        acc[0][a] = _fma(builder, x, x, acc[0][a])
                _add_blocks(builder, acc, totals)
            out = _totals(builder, totals)
            if not centred:
                out.append(ir.Constant(ir.DoubleType(), 0.0))
            return context.make_tuple(builder, signature.return_type, out)

        return types.UniTuple(types.float64, 2)(xr, types.int64, types.float32, a1, a2), codegen

    return intrinsic(row_sums)


_row_moments = _make_row_sums(centred=True)
_row_sumsq = _make_row_sums(centred=False)


# ------------------------------------------------------------------- backward, first pass
# The backward's first pass over a row's whole blocks, written out as vectors for bf16 rows (x
# and dy both): the sums the dx formula needs, with the row's dw (and db) terms added to the
# chunk's partial rows on the way. bf16 is read two values to a 32-bit lane as _block_values
# does, so each 32 values arrive as their 16 even-indexed ones, then their 16 odd-indexed ones;
# the weight the pass reads (``wp``) and the partial rows it adds to are kept in that order
# (pair_order), which the kernel undoes on the summed partials (_sum_partials). Against LLVM's
# vectorization of the element loops this takes half the widening instructions and fuses the
# sums' multiply-adds (LLVM does not vectorize a reduction through an fma): bf16 backward in
# cache 1.15x (layer_norm) to 1.45x (llama-order rms_norm) at d=1024; with the dx blocks in pair
# order too, from memory at 8192x1024 1.16x-1.33x (docs/results/cpu-bench-pairs-2026-11-29.md).
# Float32 rows stay on the element loops: this pass in natural order ran 0.85x-0.98x there.


def _make_pair_shuffle(to_pairs):
    """An intrinsic (src, dst, span): dst[:span] = src[:span] in pair order (``to_pairs``) or
    back from it, 32 float32 values at a time as two shuffles of two vectors. (Element loops
    with the strided indices ran at 0.85 ns a value, scalar: 14 us a call at d=16384.)"""
    even = [2 * i for i in range(16)]
    if to_pairs:  # (a, b) = values [g, g + 32) -> (even-indexed, odd-indexed)
        masks = (even, [i + 1 for i in even])
    else:  # (evens, odds) -> values in place
        masks = ([i // 2 + 16 * (i % 2) for i in range(16)], [8 + i // 2 + 16 * (i % 2) for i in range(16)])

    def shuffle(typingctx, src, dst, span):
        def codegen(context, builder, signature, args):
            src_data, dst_data = (context.make_array(signature.args[k])(context, builder, args[k]).data for k in (0, 1))
            i64 = ir.IntType(64)
            groups = builder.udiv(args[2], ir.Constant(i64, 32))
            with cgutils.for_range(builder, groups) as loop:
                at = builder.mul(loop.index, ir.Constant(i64, 32))
                a, b = (_load_f32(builder, builder.gep(src_data, [at]), v) for v in (0, 1))
                for v, mask in enumerate(masks):
                    out = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 16), mask))
                    ptr = builder.gep(dst_data, [builder.add(at, ir.Constant(i64, 16 * v))])
                    builder.store(out, builder.bitcast(ptr, out.type.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(src, dst, types.int64), codegen

    return intrinsic(shuffle)


_to_pairs = _make_pair_shuffle(True)
_from_pairs = _make_pair_shuffle(False)


@njit
def pair_order(v, span):
    """A copy of the float32 vector v with each 32 values of [0, span) (span a multiple of 32)
    in the order the bf16 passes read them: the 16 even-indexed ones, then the 16 odd-indexed
    ones; past span, in place."""
    out = v.copy()
    _to_pairs(v, out, span)
    return out


@njit
def pair_unorder(v, span):
    """The inverse of pair_order."""
    out = v.copy()
    _from_pairs(v, out, span)
    return out


@njit
def _partial_rows(nchunks, d):
    """Zeroed float32 rows, one per chunk. (A function of its own: in the body of a parallel
    kernel numba turns np.zeros into a parallel loop of its own, a second or so more to compile
    for every kernel signature.)"""
    return np.zeros((nchunks, d), np.float32)


@njit
def _sum_partials(part, span, out):
    """out = the partial rows summed in chunk order (deterministic for a chunk count), put back
    in place from pair order over [0, span) (pair_unorder) and stored in out's dtype (rounded to
    nearest even, as torch converts)."""
    total = part[0].copy()
    for c in range(1, part.shape[0]):
        total += part[c]
    total = pair_unorder(total, span)
    for i in range(total.shape[0]):
        _store(out, i, total[i])


def _make_grad_sums(op, llama=False, squares=False, rows=1, hw=HW_BF16):
    """An intrinsic (dyr, xr, wp, dwc, aux, n, c0, c1, c2) -> (float64, float64) over the
    values [0, n) of bf16 rows dyr and xr (n a multiple of BLOCK), with g = dy * w:

    - ln (aux: the db partial row; c0, c1, c2 = mhi, rstd, lo): xhat = fma(x - mhi, rstd, lo)
      as _ln_dw computes it; dwc += dy * xhat (one fma) and aux += dy; returns (sum of g, sum
      of g * xhat).
    - rms (aux: ``rnd``; c0 = rstd): xhat = x * rstd (``llama``: rounded to bf16); dwc += dy *
      xhat (one fma); returns (sum of g * x, sum of x^2 if ``squares`` else 0).

    Block j prefetches as _prefetch_pass1(xr, dyr, j) does.

    ``rows=2``: (dyr, xr, dyr2, xr2, wp, dwc, aux, n, c0, c1, c2, e0, e1, e2) -> the two rows'
    sums, four float64: the same work for two rows at once, which loads and stores each value
    of the partial rows (and of w) once for both. The terms reach dwc (aux) in the same order,
    row by row, as two calls would add them, so the bits do not change; each pass 1 prefetches
    the rows two ahead (the pair after this one)."""

    def codegen(context, builder, signature, args):
        # args: (dyr, xr) per row, wp, dwc, aux, n, then (c0, c1, c2) per row. Run for bf16 rows
        # (picked when numba types the call); other dtypes would be read in natural order.
        f32 = ir.VectorType(ir.FloatType(), _LANES)
        i64 = ir.IntType(64)
        data = [context.make_array(signature.args[k])(context, builder, args[k]).data for k in range(2 * rows + 2)]
        w_data, dw_data = data[2 * rows :]
        db_data = context.make_array(signature.args[2 * rows + 2])(context, builder, args[2 * rows + 2]).data if op == "ln" else None
        rkind = signature.args[2 * rows + 2].dtype  # rms: rnd's, the output dtype
        c = [[_f32x16(builder, args[2 * rows + 4 + 3 * r + k]) for k in range(3)] for r in range(rows)]
        totals = _f64_totals(builder, 2 * rows)
        blocks = builder.udiv(args[2 * rows + 3], ir.Constant(i64, BLOCK))
        with cgutils.for_range(builder, blocks) as loop:
            base = builder.mul(loop.index, ir.Constant(i64, BLOCK))
            half = builder.udiv(base, ir.Constant(i64, 2))
            for r in range(rows):
                for k in (2 * r + 1, 2 * r):
                    _prefetch_ahead(context, builder, signature.args[k], args[k], half, BLOCK // 2, rows)
            acc = [[ir.Constant(f32, [0.0] * _LANES)] * _ACC for _ in range(2 * rows)]
            streams = [(_block_stream(builder, data[2 * r + 1], base, signature.args[2 * r + 1].dtype),
                        _block_stream(builder, data[2 * r], base, signature.args[2 * r].dtype)) for r in range(rows)]
            for v in range(BLOCK // _LANES):
                a = v % _ACC
                at = builder.add(base, ir.Constant(i64, v * _LANES))
                w = _load_f32(builder, builder.gep(w_data, [at]), 0)
                dwp = builder.bitcast(builder.gep(dw_data, [at]), f32.as_pointer())
                dw = builder.load(dwp, align=4)
                if op == "ln":
                    dbp = builder.bitcast(builder.gep(db_data, [at]), f32.as_pointer())
                    db = builder.load(dbp, align=4)
                for r, (xs, dys) in enumerate(streams):
                    x, dy = next(xs), next(dys)
                    s0, s1 = acc[2 * r], acc[2 * r + 1]
                    g = builder.fmul(dy, w)
                    if op == "ln":
                        mhi, rs, lo = c[r]
                        s0[a] = builder.fadd(s0[a], g)
                        xh = _fma(builder, builder.fsub(x, mhi), rs, lo)
                        s1[a] = _fma(builder, g, xh, s1[a])
                        db = builder.fadd(db, dy)
                    else:
                        s0[a] = _fma(builder, g, x, s0[a])
                        if squares:
                            s1[a] = _fma(builder, x, x, s1[a])
                        xh = builder.fmul(x, c[r][0])
                        if llama:
                            xh = _widen(builder, _narrow(builder, xh, rkind, hw), rkind)
                    dw = _fma(builder, dy, xh, dw)
                if op == "ln":
                    builder.store(db, dbp, align=4)
                builder.store(dw, dwp, align=4)
            _add_blocks(builder, acc, totals)
        out = _totals(builder, totals)
        return context.make_tuple(builder, signature.return_type, out)

    f = types.float32
    if rows == 1:
        def grad_sums(typingctx, dyr, xr, wp, dwc, aux, n, c0, c1, c2):
            return types.UniTuple(types.float64, 2)(dyr, xr, wp, dwc, aux, types.int64, f, f, f), codegen
    else:
        def grad_sums(typingctx, dyr, xr, dyr2, xr2, wp, dwc, aux, n, c0, c1, c2, e0, e1, e2):
            return types.UniTuple(types.float64, 4)(dyr, xr, dyr2, xr2, wp, dwc, aux, types.int64, f, f, f, f, f, f), codegen

    return intrinsic(grad_sums)


_LN_GRAD_SUMS = {rows: _make_grad_sums("ln", rows=rows) for rows in (1, 2)}
_RMS_GRAD_SUMS = {
    (llama, squares, rows): _make_grad_sums("rms", llama, squares, rows)
    for llama in (False, True) for squares in (False, True) for rows in (1, 2)
}


def _is_none(t):
    """Whether a numba argument type is None (or the argument was left out)."""
    return t is None or isinstance(t, (types.NoneType, types.Omitted))


def _pair_types(x, dy, ds=None):
    """Whether numba array types x and dy (and ds, when given) are all bf16: the rows the
    backward reads in pairs."""
    return x.dtype == dy.dtype == types.uint16 and (_is_none(ds) or ds.dtype == types.uint16)


def _paired(x, dy, ds=None):  # pragma: no cover - replaced by the overload below
    """Whether the backward reads its rows in bf16 pairs with w in pair_order: x and dy (and ds,
    when given) all bf16."""
    raise NotImplementedError


@overload(_paired)
def _ov_paired(x, dy, ds=None):
    every = _pair_types(x, dy, ds)
    return lambda x, dy, ds=None: every


# Row pairs: the bf16 backward's pass 1 takes two rows at once (_make_grad_sums, rows=2) where
# the rows' whole blocks span at least PAIR_ROWS_MIN values. Its float32 partial rows (dw, and db
# for layer_norm: 8 bytes a value, loaded and stored) outgrow the 32 KB L1 from d = 4096 on, and
# two rows halve that traffic. From memory, 2 threads, new / old (interleaved A/B, llama order):
# d=4096 layer_norm 1.09-1.11, rms_norm 1.07-1.12; 8192 1.10 / 1.07; 16384 1.05 / 1.05. At
# d=2048 0.93-0.99, and at d=1024 0.65-0.83 (in cache there, 0.9-1.1): two rows of 2 KB read
# side by side share each 4 KB page, which seems to throw off the hardware's stream prefetcher.
PAIR_ROWS_MIN = 4096


@njit
def _row_pairs(x, dy, k):
    """Whether the backward takes its rows in pairs (see PAIR_ROWS_MIN)."""
    return _paired(x, dy) and k - k % BLOCK >= max(PAIR_ROWS_MIN, BLOCK)


def _vector_sums(a):  # pragma: no cover - replaced by the overload below
    """Whether pass 1 over row ``a`` takes the vector loops above: 16-bit rows, where the sums
    set the pace. A float32 row waits on memory, and there rms_norm at 8192x1024 ran 0.86x-0.96x
    with them (interleaved A/B, from memory)."""
    raise NotImplementedError


@overload(_vector_sums)
def _ov_vector_sums(a):
    vector = a.dtype != types.float32
    return lambda a: vector


@njit
def _spans(out, i0, i1, nt):
    """Split [i0, i1) of an output row into a plain head [i0, a), whole blocks [a, b) and a plain
    tail [b, i1). With ``nt`` the blocks start at the row's first 64-byte boundary."""
    a = i0
    if nt:
        size = out.itemsize
        misalign = (np.int64(out.ctypes.data) + i0 * size) % 64
        a = i0 + min(i1 - i0, ((64 - misalign) % 64) // size)
    return a, a + (i1 - a) // EMIT * EMIT


def _is_llama(rnd):
    return not isinstance(rnd, (types.NoneType, types.Omitted)) and rnd.dtype != types.float32


def _rms_block(y, j, x, w, stage, rs, nt, rnd):  # pragma: no cover - replaced by the overload below
    """rms_norm's output block at j (see _make_forward_block)."""
    raise NotImplementedError


def _ln_block(y, j, x, w, b, stage, mhi, mlo, rs, nt):  # pragma: no cover
    """layer_norm's output block at j (see _make_forward_block)."""
    raise NotImplementedError


@overload(_rms_block)
def _ov_rms_block(y, j, x, w, stage, rs, nt, rnd):
    plain, streamed = (_FORWARD_BLOCK["rms", _is_llama(rnd), t] for t in (False, True))

    def block(y, j, x, w, stage, rs, nt, rnd):
        z = np.float32(0.0)
        if nt:
            streamed(y, np.uint64(j), x, w, w, stage, z, z, rs)
        else:
            plain(y, np.uint64(j), x, w, w, stage, z, z, rs)

    return block


@overload(_ln_block)
def _ov_ln_block(y, j, x, w, b, stage, mhi, mlo, rs, nt):
    plain, streamed = (_FORWARD_BLOCK["ln", False, t] for t in (False, True))

    def block(y, j, x, w, b, stage, mhi, mlo, rs, nt):
        if nt:
            streamed(y, np.uint64(j), x, w, b, stage, mhi, mlo, rs)
        else:
            plain(y, np.uint64(j), x, w, b, stage, mhi, mlo, rs)

    return block


def _dx_block(op, dx, j, dy, x, w, ds, stage, p0, p1, p2, rs, nt):  # pragma: no cover
    """The backward's dx block at j (see _make_backward_block). ``op`` a string literal: "ln",
    "rms" or "rms_head", with "/pairs" for bf16 rows read in pairs and w in pair_order."""
    raise NotImplementedError


@overload(_dx_block, prefer_literal=True)
def _ov_dx_block(op, dx, j, dy, x, w, ds, stage, p0, p1, p2, rs, nt):
    name, _, how = op.literal_value.partition("/")
    paired = how == "pairs"
    if paired and not (_pair_types(x, dy, ds) and dx.dtype == types.uint16):
        return lambda op, dx, j, dy, x, w, ds, stage, p0, p1, p2, rs, nt: None  # not called: _paired is False
    plain, streamed = (_BACKWARD_BLOCK[name, t, paired] for t in (False, True))

    def block(op, dx, j, dy, x, w, ds, stage, p0, p1, p2, rs, nt):
        if nt:
            streamed(dx, np.uint64(j), dy, x, w, ds, stage, p0, p1, p2, rs)
        else:
            plain(dx, np.uint64(j), dy, x, w, ds, stage, p0, p1, p2, rs)

    return block


# ----------------------------------------------------------------------------------- forward


@njit
def _rms_y(xr, w, yr, rs, rnd, i):
    _store(yr, i, _round_like(rnd, _load(xr, i) * rs) * _load(w, i))


@njit(inline="always")
def _rms_write(xr, w, yr, rs, rnd, stage, nt, ahead1, ahead2):
    d = yr.shape[0]
    a, b = _spans(yr, 0, d, nt)
    for i in range(a):
        _rms_y(xr, w, yr, rs, rnd, i)
    for j in range(a, b, EMIT):
        _prefetch_pass2(ahead1, ahead2, j, 1)
        _rms_block(yr, j, xr, w, stage, rs, nt, rnd)
    for i in range(b, d):
        _rms_y(xr, w, yr, rs, rnd, i)


@njit
def _ln_y(xr, w, bias, out, mhi, mlo, rs, i):
    _store(out, i, _centred(_load(xr, i), mhi, mlo) * rs * _load(w, i) + _load(bias, i))


@njit(inline="always")
def _ln_write(xr, w, bias, yr, mean, rs, stage, nt, ahead1, ahead2):
    d = yr.shape[0]
    mhi, mlo = _split(mean)
    a, b = _spans(yr, 0, d, nt)
    for i in range(a):
        _ln_y(xr, w, bias, yr, mhi, mlo, rs, i)
    for j in range(a, b, EMIT):
        _prefetch_pass2(ahead1, ahead2, j, 1)
        _ln_block(yr, j, xr, w, bias, stage, mhi, mlo, rs, nt)
    for i in range(b, d):
        _ln_y(xr, w, bias, yr, mhi, mlo, rs, i)


# The kernels take ``stages``: float32 rows of STAGE_WIDTH, 64-byte aligned, zero at _ZERO, one
# staging row per chunk (their count is the chunk count). ``nt`` turns the streaming stores on
# (see "block output").


@njit(parallel=True, **JIT)
def rms_fwd(x, w, y, rstd, eps, inside, k, rnd, stages, nt):
    n = x.shape[0]
    nchunks = stages.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        stage = stages[c]
        for r in range(r0, r1):
            xr = x[r]
            rs = _rms_scale(_sumsq(xr, None, None, k), k, eps, inside)
            rstd[r] = rs
            _rms_write(xr, w, y[r], rs, rnd, stage, nt, xr, None)
        if nt:
            _store_fence()


@njit(parallel=True, **JIT)
def add_rms_fwd(x, res, w, y, s, rstd, eps, inside, k, rnd, stages, nt):
    n = x.shape[0]
    nchunks = stages.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        stage = stages[c]
        for r in range(r0, r1):
            xr, rr, sr = x[r], res[r], s[r]
            # s is an output too, but the second pass reads it back: plain stores keep it cached
            rs = _rms_scale(_sumsq(xr, rr, sr, k), k, eps, inside)
            rstd[r] = rs
            _rms_write(sr, w, y[r], rs, rnd, stage, nt, xr, rr)
        if nt:
            _store_fence()


@njit(parallel=True, **JIT)
def ln_fwd(x, w, b, y, mean, rstd, eps, stages, nt):
    n = x.shape[0]
    nchunks = stages.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        stage = stages[c]
        for r in range(r0, r1):
            xr = x[r]
            mu, var = _moments(xr, None, None, xr)
            rs = _recip(math.sqrt(var + eps))
            mean[r] = mu
            rstd[r] = rs
            _ln_write(xr, w, b, y[r], mu, rs, stage, nt, xr, None)
        if nt:
            _store_fence()


@njit(parallel=True, **JIT)
def add_ln_fwd(x, res, w, b, y, s, mean, rstd, eps, stages, nt):
    n = x.shape[0]
    nchunks = stages.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        stage = stages[c]
        for r in range(r0, r1):
            xr, rr, sr = x[r], res[r], s[r]
            mu, var = _moments(xr, rr, sr, sr)
            rs = _recip(math.sqrt(var + eps))
            mean[r] = mu
            rstd[r] = rs
            _ln_write(sr, w, b, y[r], mu, rs, stage, nt, xr, rr)
        if nt:
            _store_fence()


# ---------------------------------------------------------------------------------- backward
# ``ds`` is the gradient flowing into the residual sum (add variants) or None; numba compiles the
# None case without the add. ``dw_part`` / ``db_part`` are (nchunks, d) float32 rows the kernel
# zeroes: each chunk adds its rows' terms to its own row, element by element, and the kernel
# sums the rows in chunk order into dw (db), stored in its dtype, at the end (_sum_partials).
# The launcher did that in numpy before: 40-65 us right after a large kernel, when Python's
# memory is cold (the kernel streamed the inputs through the caches). The terms need
# only the saved statistics, so they are added in the first pass: it stored nothing, while the
# second already stored dx and, at the time, its staging row (the CPU's store port set the pace
# there). bf16 from memory, interleaved A/B: 1.02x-1.3x; float32 0.94x-1.18x (within the noise).


@njit
def _rms_dw(dyr, xr, dwc, rs, rnd, i):
    """Add element i's dw term to dwc; returns x[i]."""
    xv = _load(xr, i)
    dwc[np.uint64(i)] = _fma32(_load(dyr, i), _round_like(rnd, xv * rs), dwc[np.uint64(i)])
    return xv


@njit(inline="always")
def _dot_gx(dyr, w, wp, xr, k, dwc, rs, rnd, squares):
    """(sum over the row of (dy * w) * x, sum of x^2 over [:k] or, without ``squares``, any
    value), one pass over the row, which also adds the row's dw terms to dwc (see "backward"
    above). ``wp``: w in pair_order over the whole blocks of [:k] (bf16 rows)."""
    full = k - k % BLOCK
    tgx, tss = _rms_blocks(dyr, w, wp, xr, full, dwc, rs, rnd, squares)
    pgx, pss = _rms_tail(dyr, w, xr, full, k, dwc, rs, rnd)
    return tgx + pgx, tss + pss


@njit(inline="always")
def _rms_tail(dyr, w, xr, full, k, dwc, rs, rnd):
    """_dot_gx past the whole blocks: [full, k), then [k, d) (pRMSNorm: g * x only)."""
    pgx = np.float32(0.0)
    pss = np.float32(0.0)
    for i in range(full, k):
        xv = _rms_dw(dyr, xr, dwc, rs, rnd, i)
        pgx += (_load(dyr, i) * _load(w, i)) * xv
        pss += xv * xv
    for i in range(k, xr.shape[0]):
        pgx += (_load(dyr, i) * _load(w, i)) * _rms_dw(dyr, xr, dwc, rs, rnd, i)
    return pgx, pss


def _dot_gx_pair(dyr, xr, dyr2, xr2, w, wp, k, dwc, rs, rs2, rnd, squares):  # pragma: no cover - the overload below
    """_dot_gx of two bf16 rows, their whole blocks in one pass (_make_grad_sums, rows=2):
    (gx, ss) of the first row, then of the second. Same bits as two _dot_gx calls. Other
    dtypes compile a stub (_row_pairs is False for them): every copy of the pass costs each
    kernel signature compile time."""
    raise NotImplementedError


@overload(_dot_gx_pair, inline="always")
def _ov_dot_gx_pair(dyr, xr, dyr2, xr2, w, wp, k, dwc, rs, rs2, rnd, squares):
    if not _pair_types(xr, dyr):
        return lambda dyr, xr, dyr2, xr2, w, wp, k, dwc, rs, rs2, rnd, squares: (0.0, 0.0, 0.0, 0.0)
    with_squares, without = (_RMS_GRAD_SUMS[_is_llama(rnd), s, 2] for s in (True, False))

    def pair(dyr, xr, dyr2, xr2, w, wp, k, dwc, rs, rs2, rnd, squares):
        full = k - k % BLOCK
        z = np.float32(0.0)
        if squares:
            tgx, tss, tgx2, tss2 = with_squares(dyr, xr, dyr2, xr2, wp, dwc, rnd, full, rs, z, z, rs2, z, z)
        else:
            tgx, tss, tgx2, tss2 = without(dyr, xr, dyr2, xr2, wp, dwc, rnd, full, rs, z, z, rs2, z, z)
        pgx, pss = _rms_tail(dyr, w, xr, full, k, dwc, rs, rnd)
        pgx2, pss2 = _rms_tail(dyr2, w, xr2, full, k, dwc, rs2, rnd)
        return tgx + pgx, tss + pss, tgx2 + pgx2, tss2 + pss2

    return pair


@njit(inline="always")
def _rms_blocks_loop(dyr, w, xr, full, dwc, rs, rnd):
    """_dot_gx's whole blocks as element loops (LLVM vectorizes them)."""
    tgx = 0.0
    tss = 0.0
    for j in range(0, full, BLOCK):
        _prefetch_pass1(xr, dyr, j)
        pgx = np.float32(0.0)
        pss = np.float32(0.0)
        for i in range(j, j + BLOCK):
            xv = _rms_dw(dyr, xr, dwc, rs, rnd, i)
            pgx += (_load(dyr, i) * _load(w, i)) * xv
            pss += xv * xv
        tgx += pgx
        tss += pss
    return tgx, tss


def _rms_blocks(dyr, w, wp, xr, full, dwc, rs, rnd, squares):  # pragma: no cover - replaced by the overload below
    """_dot_gx over the whole blocks [0, full): the vector loops for bf16 rows, else the
    element loops. Picked when numba types the call, so each kernel compiles one of them."""
    raise NotImplementedError


@overload(_rms_blocks, inline="always")
def _ov_rms_blocks(dyr, w, wp, xr, full, dwc, rs, rnd, squares):
    if not _pair_types(xr, dyr):
        return lambda dyr, w, wp, xr, full, dwc, rs, rnd, squares: _rms_blocks_loop(dyr, w, xr, full, dwc, rs, rnd)
    with_squares, without = (_RMS_GRAD_SUMS[_is_llama(rnd), s, 1] for s in (True, False))

    def blocks(dyr, w, wp, xr, full, dwc, rs, rnd, squares):
        z = np.float32(0.0)
        if squares:
            return with_squares(dyr, xr, wp, dwc, rnd, full, rs, z, z)
        return without(dyr, xr, wp, dwc, rnd, full, rs, z, z)

    return blocks


@njit
def _rms_coef(rs, gx, ss, k, inside):
    # d rstd / d ms: inside -rstd^3 / 2; outside -rstd^2 / (2 sqrt(ms)). The sum of g * x runs
    # over all d features (every one is scaled by rstd); only ms is over the first k. DESIGN.md's
    # pRMSNorm formula sums g * x over i < k only, which is wrong for k < d.
    r = np.float64(rs)
    if inside:
        return np.float32(r * r * r * gx / k)
    rms = math.sqrt(ss / k)
    return np.float32(r * r / rms * gx / k) if rms > 0.0 else np.float32(0.0)


@njit
def _rms_dx(dyr, xr, w, dsr, out, rs, coef, i, in_head):
    xv = _load(xr, i)
    dyv = _load(dyr, i)
    v = rs * (dyv * _load(w, i))
    if in_head:
        v = _fma32(xv, -coef, v)
    if dsr is not None:
        v += _load(dsr, i)
    _store(out, i, v)


@njit(inline="always")
def _rms_bwd_write(dyr, xr, w, wp, dsr, dxr, rs, coef, i0, i1, head, stage, nt, ahead):
    """dx over [i0, i1) (``head``: inside the first k, where the rstd term applies; there, with
    i0 = 0, the whole blocks of bf16 rows are read in pairs: see _make_grad_sums)."""
    a, b = _spans(dxr, i0, i1, nt)
    for i in range(i0, a):
        _rms_dx(dyr, xr, w, dsr, dxr, rs, coef, i, head)
    z = np.float32(0.0)
    c = a
    if head and a == 0 and _paired(xr, dyr, dsr):
        c = i1 - i1 % BLOCK
        for j in range(0, c, EMIT):
            _prefetch_pass2(xr, dyr, j, ahead)
            _dx_block("rms_head/pairs", dxr, j, dyr, xr, wp, dsr, stage, coef, z, z, rs, nt)
    for j in range(c, b, EMIT):
        _prefetch_pass2(xr, dyr, j, ahead)
        if head:
            _dx_block("rms_head", dxr, j, dyr, xr, w, dsr, stage, coef, z, z, rs, nt)
        else:
            _dx_block("rms", dxr, j, dyr, xr, w, dsr, stage, coef, z, z, rs, nt)
    for i in range(b, i1):
        _rms_dx(dyr, xr, w, dsr, dxr, rs, coef, i, head)


@njit(parallel=True, **JIT)
def rms_bwd(dy, x, w, rstd, ds, dx, dw, eps, inside, k, rnd, stages, nt):
    """dx and dw ((d,), in dw's dtype) of rms_norm. Each chunk of rows adds its dw terms to its
    own float32 partial row; they are summed in chunk order at the end."""
    n, d = x.shape
    nchunks = stages.shape[0]
    span = k - k % BLOCK if _paired(x, dy) else 0
    wp = pair_order(w, span)
    dw_part = _partial_rows(nchunks, d)
    pairs = _row_pairs(x, dy, k)
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        dwc = dw_part[c]
        stage = stages[c]
        paired_to = r0 + (r1 - r0) // 2 * 2 if pairs else r0  # rows [r0, paired_to) go in pairs
        gx2, ss2 = 0.0, 0.0
        for r in range(r0, r1):
            dyr, xr, dxr, dsr = dy[r], x[r], dx[r], _row(ds, r)
            rs = rstd[r]
            ahead = 1 if r >= paired_to else 2  # rows ahead that pass 2 prefetches
            if ahead == 1:
                gx, ss = _dot_gx(dyr, w, wp, xr, k, dwc, rs, rnd, not inside)
            elif (r - r0) % 2 == 0:  # pass 1 of this row and the next
                gx, ss, gx2, ss2 = _dot_gx_pair(dyr, xr, dy[r + 1], x[r + 1], w, wp, k, dwc, rs, rstd[r + 1], rnd, not inside)
            else:
                gx, ss = gx2, ss2
            coef = _rms_coef(rs, gx, ss, k, inside)
            _rms_bwd_write(dyr, xr, w, wp, dsr, dxr, rs, coef, 0, k, True, stage, nt, ahead)
            if k < d:  # pRMSNorm: the features past the statistic
                _rms_bwd_write(dyr, xr, w, wp, dsr, dxr, rs, coef, k, d, False, stage, nt, ahead)
        if nt:
            _store_fence()
    _sum_partials(dw_part, span, dw)


@njit
def _ln_dw(dyr, xr, dwc, dbc, mhi, rs, lo, i):
    """Add element i's dw and db terms to dwc and dbc; returns xhat[i] = (x - mean) * rstd,
    computed as fma(x - mhi, rstd, lo) with lo = -mlo * rstd (an operation fewer than
    ((x - mhi) - mlo) * rstd, and as exact: 0 for a constant row)."""
    dyv = _load(dyr, i)
    xh = _fma32(_load(xr, i) - mhi, rs, lo)
    dwc[i] = _fma32(dyv, xh, dwc[i])
    _accumulate(dbc, i, dyv)
    return xh


@njit(inline="always")
def _ln_blocks_loop(dyr, w, xr, full, mhi, rs, lo, dwc, dbc):
    """_ln_sums's whole blocks as element loops (LLVM vectorizes them)."""
    tg = 0.0
    tgx = 0.0
    for j in range(0, full, BLOCK):
        _prefetch_pass1(xr, dyr, j)
        pg = np.float32(0.0)
        pgx = np.float32(0.0)
        for i in range(j, j + BLOCK):
            g = _load(dyr, i) * _load(w, i)
            pg += g
            pgx += g * _ln_dw(dyr, xr, dwc, dbc, mhi, rs, lo, i)
        tg += pg
        tgx += pgx
    return tg, tgx


def _ln_blocks(dyr, w, wp, xr, full, mhi, rs, lo, dwc, dbc):  # pragma: no cover - replaced by the overload below
    """_ln_sums over the whole blocks [0, full), picked as _rms_blocks is."""
    raise NotImplementedError


@overload(_ln_blocks, inline="always")
def _ov_ln_blocks(dyr, w, wp, xr, full, mhi, rs, lo, dwc, dbc):
    if not _pair_types(xr, dyr):
        return lambda dyr, w, wp, xr, full, mhi, rs, lo, dwc, dbc: _ln_blocks_loop(dyr, w, xr, full, mhi, rs, lo, dwc, dbc)
    sums = _LN_GRAD_SUMS[1]
    return lambda dyr, w, wp, xr, full, mhi, rs, lo, dwc, dbc: sums(dyr, xr, wp, dwc, dbc, full, mhi, rs, lo)


@njit(inline="always")
def _ln_consts(mean, rs):
    """(mhi, lo) of _ln_dw: the mean's float32 head and -mlo * rstd."""
    mhi, mlo = _split(mean)
    return mhi, np.float32(-np.float64(mlo) * rs)


@njit(inline="always")
def _ln_sums(dyr, w, wp, xr, mean, rs, dwc, dbc):
    """(sum of g, sum of g * xhat) with g = dy * w, xhat = (x - mean) * rstd; adds the row's dw
    and db terms to dwc and dbc on the way (see "backward" above). ``wp``: w in pair_order over
    the row's whole blocks (bf16 rows)."""
    mhi, lo = _ln_consts(mean, rs)
    full = xr.shape[0] - xr.shape[0] % BLOCK
    tg, tgx = _ln_blocks(dyr, w, wp, xr, full, mhi, rs, lo, dwc, dbc)
    pg, pgx = _ln_tail(dyr, w, xr, full, mhi, rs, lo, dwc, dbc)
    return tg + pg, tgx + pgx


@njit(inline="always")
def _ln_tail(dyr, w, xr, full, mhi, rs, lo, dwc, dbc):
    """_ln_sums past the whole blocks."""
    pg = np.float32(0.0)
    pgx = np.float32(0.0)
    for i in range(full, xr.shape[0]):
        g = _load(dyr, i) * _load(w, i)
        pg += g
        pgx += g * _ln_dw(dyr, xr, dwc, dbc, mhi, rs, lo, i)
    return pg, pgx


def _ln_sums_pair(dyr, xr, dyr2, xr2, w, wp, mean, rs, mean2, rs2, dwc, dbc):  # pragma: no cover - the overload below
    """_ln_sums of two bf16 rows, their whole blocks in one pass (_make_grad_sums, rows=2):
    (sum of g, sum of g * xhat) of the first row, then of the second. Same bits as two
    _ln_sums calls. A stub for other dtypes, as _dot_gx_pair."""
    raise NotImplementedError


@overload(_ln_sums_pair, inline="always")
def _ov_ln_sums_pair(dyr, xr, dyr2, xr2, w, wp, mean, rs, mean2, rs2, dwc, dbc):
    if not _pair_types(xr, dyr):
        return lambda dyr, xr, dyr2, xr2, w, wp, mean, rs, mean2, rs2, dwc, dbc: (0.0, 0.0, 0.0, 0.0)
    sums = _LN_GRAD_SUMS[2]

    def pair(dyr, xr, dyr2, xr2, w, wp, mean, rs, mean2, rs2, dwc, dbc):
        mhi, lo = _ln_consts(mean, rs)
        mhi2, lo2 = _ln_consts(mean2, rs2)
        full = xr.shape[0] - xr.shape[0] % BLOCK
        tg, tgx, tg2, tgx2 = sums(dyr, xr, dyr2, xr2, wp, dwc, dbc, full, mhi, rs, lo, mhi2, rs2, lo2)
        pg, pgx = _ln_tail(dyr, w, xr, full, mhi, rs, lo, dwc, dbc)
        pg2, pgx2 = _ln_tail(dyr2, w, xr2, full, mhi2, rs2, lo2, dwc, dbc)
        return tg + pg, tgx + pgx, tg2 + pg2, tgx2 + pgx2

    return pair


@njit
def _ln_dx(dyr, xr, w, dsr, out, mhi, p, q, rs, i):
    v = _fma32(_load(dyr, i) * _load(w, i), rs, _fma32(_load(xr, i) - mhi, p, q))
    if dsr is not None:
        v += _load(dsr, i)
    _store(out, i, v)


@njit(inline="always")
def _ln_bwd_write(dyr, xr, w, wp, dsr, dxr, mean, rs, sg, sgx, stage, nt, ahead):
    """dx of this row: rstd * (g - mean(g) - xhat * mean(g * xhat)), with the terms that do not
    depend on g folded into one affine function of x - mhi: dx = rstd * g + p * (x - mhi) + q,
    p = -rstd^2 * mean(g * xhat), q = -rstd * mean(g) - p * mlo (from the float64 sums), as two
    fmas: four vector operations per 16 values where there were eight. Nothing cancels that did
    not before: x - mhi is the centred value the old form had too (0 for a constant row, where
    p is 0 as well)."""
    d = dxr.shape[0]
    mhi, mlo = _split(mean)
    r = np.float64(rs)
    p = np.float32(-r * r * (sgx / d))
    q = np.float32(-r * (sg / d) - np.float64(p) * mlo)
    a, b = _spans(dxr, 0, d, nt)
    for i in range(a):
        _ln_dx(dyr, xr, w, dsr, dxr, mhi, p, q, rs, i)
    c = a
    if a == 0 and _paired(xr, dyr, dsr):  # whole blocks of bf16 rows: in pairs (_make_grad_sums)
        c = d - d % BLOCK
        for j in range(0, c, EMIT):
            _prefetch_pass2(xr, dyr, j, ahead)
            _dx_block("ln/pairs", dxr, j, dyr, xr, wp, dsr, stage, mhi, p, q, rs, nt)
    for j in range(c, b, EMIT):
        _prefetch_pass2(xr, dyr, j, ahead)
        _dx_block("ln", dxr, j, dyr, xr, w, dsr, stage, mhi, p, q, rs, nt)
    for i in range(b, d):
        _ln_dx(dyr, xr, w, dsr, dxr, mhi, p, q, rs, i)


@njit(parallel=True, **JIT)
def ln_bwd(dy, x, w, mean, rstd, ds, dx, dw, db, stages, nt):
    """dx, dw and db of layer_norm, the last two summed as rms_bwd's dw is."""
    n, d = x.shape
    nchunks = stages.shape[0]
    span = d - d % BLOCK if _paired(x, dy) else 0
    wp = pair_order(w, span)
    dw_part = _partial_rows(nchunks, d)
    db_part = _partial_rows(nchunks, d)
    pairs = _row_pairs(x, dy, d)
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        dwc = dw_part[c]
        dbc = db_part[c]
        stage = stages[c]
        paired_to = r0 + (r1 - r0) // 2 * 2 if pairs else r0  # rows [r0, paired_to) go in pairs
        sg2, sgx2 = 0.0, 0.0
        for r in range(r0, r1):
            dyr, xr = dy[r], x[r]
            mu, rs = mean[r], rstd[r]
            ahead = 1 if r >= paired_to else 2  # rows ahead that pass 2 prefetches
            if ahead == 1:
                sg, sgx = _ln_sums(dyr, w, wp, xr, mu, rs, dwc, dbc)
            elif (r - r0) % 2 == 0:  # pass 1 of this row and the next
                sg, sgx, sg2, sgx2 = _ln_sums_pair(dyr, xr, dy[r + 1], x[r + 1], w, wp, mu, rs, mean[r + 1], rstd[r + 1], dwc, dbc)
            else:
                sg, sgx = sg2, sgx2
            _ln_bwd_write(dyr, xr, w, wp, _row(ds, r), dx[r], mu, rs, sg, sgx, stage, nt, ahead)
        if nt:
            _store_fence()
    _sum_partials(dw_part, span, dw)
    _sum_partials(db_part, span, db)
