"""bf16 and fp16 as the kernels see them: bit patterns in integer arrays, widened to float32.

numba has neither type, so bfloat16 travels as uint16 bits and float16 as int16 bits. ``load_at``
widens an element to float32; ``store_at`` narrows a float32 with round-to-nearest-even (bf16 by
integer arithmetic, fp16 by LLVM's fptrunc). The vector forms (``narrow_bits``, ``widen_bits``) give the
same bits as the scalar ones, with two exceptions where the CPU's bf16 instruction is used:
results below bf16's smallest normal flush to zero, and a nan keeps its sign and payload.
Neither occurs in a normalized row of finite values (tests/test_cpu_blocks.py checks both).
Where bf16 rows are read two values to a 32-bit lane (``bf16_pair``, ``pair_line``), the float32
vectors beside them (w, b, partial rows) are kept in the same order: ``pair_order``.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

# ---------------------------------------------------------------------------------- scalars


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


@njit
def _bf16_bits_to_f32(b):
    return _u32_as_f32(np.uint32(b) << np.uint32(16))


@njit
def _f32_to_bf16_bits(v):
    b = _f32_as_u32(v)
    # round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate
    rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    # nan becomes the canonical quiet nan, as torch's conversion does; a select on v == v is the
    # form LLVM vectorizes
    return np.uint16(rounded if v == v else np.uint32(0x7FC0))


def load_at(a, i):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


def store_at(a, i, v):  # pragma: no cover
    raise NotImplementedError


def round_like(a, v):  # pragma: no cover
    raise NotImplementedError


# Indices go through np.uint64: numba wraps negative signed indices around, which makes the
# address non-affine and turns the vectorized loops into gathers and scatters.


@overload(load_at)
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
def add_at(a, i, v):
    a[np.uint64(i)] += v


@overload(store_at)
def _ov_store(a, i, v):
    if a.dtype == types.float32:
        return lambda a, i, v: _store_f32(a, i, v)
    if a.dtype == types.uint16:
        return lambda a, i, v: _store_bf16(a, i, v)
    if a.dtype == types.int16:
        return lambda a, i, v: _store_f16(a, i, v)


@overload(round_like)
def _ov_round_like(a, v):
    """v rounded to a's dtype and widened back to float32 (the llama cast of xhat)."""
    if a.dtype == types.float32:
        return lambda a, v: v
    if a.dtype == types.uint16:
        return lambda a, v: _bf16_bits_to_f32(_f32_to_bf16_bits(v))
    if a.dtype == types.int16:
        return lambda a, v: _f16_bits_to_f32(_f32_to_f16_bits(v))


# ---------------------------------------------------------------------------------- vectors

LANES = 16


class _BFloat(ir.types.Type):
    """LLVM's bfloat type, which llvmlite.ir does not spell."""

    null = "0.0"

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash(_BFloat)


def i64(value):
    """An int64 IR constant (offsets and indices)."""
    return ir.Constant(ir.IntType(64), value)


def load_f32(builder, base, v):
    """Float32 vector v (16 lanes) from a float32 pointer."""
    f32 = ir.VectorType(ir.FloatType(), LANES)
    ptr = builder.gep(base, [i64(v * LANES)])
    return builder.load(builder.bitcast(ptr, f32.as_pointer()), align=4)


def _vconst(ty, value):
    return ir.Constant(ir.VectorType(ty, LANES), [value] * LANES)


def narrow_bits(builder, x, kind, hw, nan=True):
    """<16 x float> -> the output's bits (<16 x i16>), or x itself for float32. ``hw``: bf16
    through the CPU's instruction. ``nan=False``: the caller knows x holds no nan, so the integer
    rounding skips the select that makes a nan's bits (it rounds infinities right without it)."""
    i16, i32 = ir.IntType(16), ir.IntType(32)
    if kind == types.float32:
        return x
    if kind == types.int16:  # fp16
        return builder.bitcast(builder.fptrunc(x, ir.VectorType(ir.HalfType(), LANES)),
                               ir.VectorType(i16, LANES))
    if hw:
        return builder.bitcast(builder.fptrunc(x, ir.VectorType(_BFloat(), LANES)), ir.VectorType(i16, LANES))
    r = builder.lshr(_rounded_high(builder, x), _vconst(i32, 16))
    if nan:
        r = builder.select(builder.fcmp_unordered("uno", x, x), _vconst(i32, 0x7FC0), r)
    return builder.trunc(r, ir.VectorType(i16, LANES))


def _rounded_high(builder, x):
    """<16 x float> -> <16 x i32> whose high halves are x's bf16 bits, rounded to nearest even
    (the low halves are left over; a nan's are not a quiet nan: callers select for it)."""
    i32 = ir.IntType(32)
    b = builder.bitcast(x, ir.VectorType(i32, LANES))
    lsb = builder.and_(builder.lshr(b, _vconst(i32, 16)), _vconst(i32, 1))
    return builder.add(builder.add(b, _vconst(i32, 0x7FFF)), lsb)


def widen_bits(builder, bits, kind):
    """The inverse of narrow_bits: the rounded values as <16 x float>."""
    f32 = ir.VectorType(ir.FloatType(), LANES)
    if kind == types.float32:
        return bits
    if kind == types.int16:
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), f32)
    wide = builder.zext(bits, ir.VectorType(ir.IntType(32), LANES))
    return builder.bitcast(builder.shl(wide, _vconst(ir.IntType(32), 16)), f32)


def narrow_line(builder, lo, hi, kind, hw, zero):
    """Two 16-lane float32 vectors -> one 64-byte line of 16-bit output bits (<32 x i16>).

    With the CPU's bf16 instruction the pair converts in one vcvtne2ps2bf16, typed <32 x bfloat>.
    x86 has no non-temporal store of bfloat vectors, and LLVM folds a bitcast to integers into
    the store and then silently emits a normal one: adding ``zero`` (a line of zeros in memory,
    which LLVM cannot see through) keeps the integer vector; a line stored normally passes None."""
    i16x32 = ir.VectorType(ir.IntType(16), 32)
    if hw and kind == types.uint16:
        bits = bf16_line(builder, lo, hi)
        if zero is None:
            return bits
        return builder.add(bits, builder.load(builder.bitcast(zero, i16x32.as_pointer()), align=4))
    pair = ir.Constant(ir.VectorType(ir.IntType(32), 32), list(range(32)))
    return builder.shuffle_vector(narrow_bits(builder, lo, kind, hw), narrow_bits(builder, hi, kind, hw),
                                  pair)


def bf16_line(builder, lo, hi):
    """Two 16-lane float32 vectors -> their bf16 bits in order (<32 x i16>), by one
    vcvtne2ps2bf16 (AVX512-BF16): the same bits as two vcvtneps2bf16, which cost as much each
    (docs/cpu-kernels.md, "bf16 conversion")."""
    f32 = ir.VectorType(ir.FloatType(), LANES)
    fnty = ir.FunctionType(ir.VectorType(_BFloat(), 32), [f32, f32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512bf16.cvtne2ps2bf16.512")
    # its low half comes from the second operand
    return builder.bitcast(builder.call(fn, [hi, lo]), ir.VectorType(ir.IntType(16), 32))


def widen_line(builder, bits):
    """The inverse of bf16_line: (the first 16 values, the last 16) as <16 x float>."""
    index = ir.VectorType(ir.IntType(32), LANES)
    halves = (ir.Constant(index, list(range(h, h + LANES))) for h in (0, LANES))
    return tuple(widen_bits(builder, builder.shuffle_vector(bits, bits, half), types.uint16)
                 for half in halves)


def bf16_pair(builder, base, at):
    """The 32 bf16 values from element ``at`` of ``base`` read two to a 32-bit lane (little-
    endian: the low one first), widened: (the even-indexed 16, the odd-indexed 16). No widening
    shuffle: sums do not care about the order, and the backward keeps its weights in this order."""
    i32 = ir.VectorType(ir.IntType(32), LANES)
    f32 = ir.VectorType(ir.FloatType(), LANES)
    ptr = builder.gep(base, [ir.Constant(ir.IntType(64), at)] if isinstance(at, int) else [at])
    pair = builder.load(builder.bitcast(ptr, i32.as_pointer()), align=2)
    return (builder.bitcast(builder.shl(pair, _vconst(ir.IntType(32), 16)), f32),
            builder.bitcast(builder.and_(pair, _vconst(ir.IntType(32), 0xFFFF0000)), f32))


_INTERLEAVE = ir.Constant(ir.VectorType(ir.IntType(32), 32), [i // 2 + 16 * (i % 2) for i in range(32)])


def pair_line(builder, even, odd, hw, zero, nan=True):
    """The inverse of bf16_pair: 32 bf16 bits (<32 x i16>) in place. With the CPU's instruction,
    narrow_line's line (the evens, then the odds) interleaved by one shuffle; without it, each
    32-bit lane built where it is: the odd value's rounded bits kept in the high half, the even
    value's shifted into the low one. The same bits as narrowing, with no shuffle (AVX2 needed
    12 per 32 values to narrow and interleave). ``nan``: as narrow_bits's."""
    if hw:
        line = narrow_line(builder, even, odd, types.uint16, hw, zero)
        return builder.shuffle_vector(line, line, _INTERLEAVE)
    i32 = ir.IntType(32)

    def rounded(x):  # a nan becomes the quiet nan narrow_bits gives (0x7FC0 in the high half)
        if not nan:
            return _rounded_high(builder, x)
        return builder.select(builder.fcmp_unordered("uno", x, x), _vconst(i32, 0x7FC00000),
                              _rounded_high(builder, x))

    lane = builder.or_(builder.and_(rounded(odd), _vconst(i32, 0xFFFF0000)),
                       builder.lshr(rounded(even), _vconst(i32, 16)))
    return builder.bitcast(lane, ir.VectorType(ir.IntType(16), 2 * LANES))


# ------------------------------------------------------------------------------- pair order


def _make_pair_shuffle(to_pairs):
    """An intrinsic (src, dst, span): dst[:span] = src[:span] in pair order (``to_pairs``) or
    back from it, 32 float32 values at a time as two shuffles of two vectors."""
    even = [2 * i for i in range(16)]
    if to_pairs:  # (a, b) = values [g, g + 32) -> (even-indexed, odd-indexed)
        masks = (even, [i + 1 for i in even])
    else:  # (evens, odds) -> values in place
        masks = ([i // 2 + 16 * (i % 2) for i in range(16)], [8 + i // 2 + 16 * (i % 2) for i in range(16)])

    def shuffle(typingctx, src, dst, span):
        def codegen(context, builder, signature, args):
            src_data, dst_data = (context.make_array(signature.args[k])(context, builder, args[k]).data
                                  for k in (0, 1))
            groups = builder.udiv(args[2], i64(32))
            with cgutils.for_range(builder, groups) as loop:
                at = builder.mul(loop.index, i64(32))
                a, b = (load_f32(builder, builder.gep(src_data, [at]), v) for v in (0, 1))
                for v, mask in enumerate(masks):
                    out = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 16), mask))
                    ptr = builder.gep(dst_data, [builder.add(at, i64(16 * v))])
                    builder.store(out, builder.bitcast(ptr, out.type.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(src, dst, types.int64), codegen

    return intrinsic(shuffle)


_to_pairs = _make_pair_shuffle(True)
_from_pairs = _make_pair_shuffle(False)


@njit
def pair_order(v, span):
    """The float32 vector v with each 32 values of [0, span) (span a multiple of 32) in the
    order the bf16 passes read them: the 16 even-indexed ones, then the 16 odd-indexed ones;
    past span, in place. A copy, or v itself when span is 0 (a call that reads nothing in
    pairs allocates nothing); callers only read it."""
    if span == 0:
        return v
    out = v.copy()
    _to_pairs(v, out, span)
    return out


@njit
def pair_unorder(v, span):
    """The inverse of pair_order."""
    out = v.copy()
    _from_pairs(v, out, span)
    return out

