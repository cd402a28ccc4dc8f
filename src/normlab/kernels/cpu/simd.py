"""Vector code the kernels call, written as LLVM IR: loads, output blocks, sums and prefetches.

LLVM's vectorizer leaves the kernels' hot loops short of what the hardware does (it reduces
every block to a scalar, chains the fmas, and converts bf16 one element at a time), so those
loops are spelled out here as 16-lane vectors. What the vectors compute is the op files' business:
``forward_block``, ``backward_block`` and ``grad_sums`` take the math as a function from the op
file (rmsnorm.py, layernorm.py), which emits exactly the operations of that op's scalar
helper, so vector blocks and scalar heads and tails give the same bits.
docs/cpu-kernels.md says what each technique buys and how that was measured.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .cache import target_features
from .codecs import (LANES, bf16_line, bf16_pair, i64, load_f32, narrow_bits, narrow_line, pair_line,
                     widen_bits, widen_line)

BLOCK = 256  # values per block of a row's first pass (its sums)
# Values per block of the vector passes' sums past a row's last whole BLOCK: a row shorter than a
# BLOCK (qk-norm's heads of 64-256 features) takes its first pass in these, not element by element
TAIL = 64
EMIT = 64  # outputs per block of the second pass: small, so stores interleave with the arithmetic
HALF = EMIT // 2  # outputs of the one shorter block where a row has HALF or more left after its EMITs
_ACC = 4  # independent float32 accumulators per sum in a block
X86 = platform.machine().lower() in ("x86_64", "amd64")
HW_BF16 = bool(target_features().get("avx512bf16", False))
# 32 registers of 16 float32 lanes; AVX2 (16 of 8) and NEON (32 of 4) hold a quarter of that
AVX512 = X86 and bool(target_features().get("avx512f", False))

# A staging row (one per chunk, float32, 64-byte aligned): a line of zeros at ZERO, which
# narrow_line needs (the launcher zeroes the row, the kernels never write it); [0, EMIT) holds
# a block where the tests convert one (tests/test_cpu_blocks.py).
ZERO = 128
STAGE_WIDTH = 192

# ------------------------------------------------------------------------------- arithmetic


def fma_ir(builder, a, b, c):
    """a * b + c rounded once, for float32 scalars or vectors (of 16 float32 or 8 float64)."""
    ty = a.type
    name = "llvm.fma.f32"
    if isinstance(ty, ir.VectorType):
        name = "llvm.fma.v16f32" if ty.count == LANES else "llvm.fma.v8f64"
    return builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]),
                                                       name), [a, b, c])


@intrinsic
def fma32(typingctx, a, b, c):
    """a * b + c for float32 scalars, rounded once (the vector blocks' fma, element by element)."""

    def codegen(context, builder, signature, args):
        return fma_ir(builder, *args)

    f = types.float32
    return f(f, f, f), codegen


def f32x16(builder, scalar):
    v = builder.insert_element(ir.Constant(ir.VectorType(ir.FloatType(), LANES), ir.Undefined), scalar,
                               ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))


def _tree(builder, vectors):
    """The vectors added pairwise, in a fixed order."""
    while len(vectors) > 1:
        vectors = [builder.fadd(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def _half(builder, v, h):
    """The low (h=0) or high (h=1) half of a vector's lanes."""
    n = v.type.count // 2
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), n),
                                                    list(range(h * n, (h + 1) * n))))


def _lanes_sum(builder, v):
    """The lanes of a float64 vector added pairwise: one scalar."""
    while v.type.count > 1:
        v = builder.fadd(_half(builder, v, 0), _half(builder, v, 1))
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


# ------------------------------------------------------------------------------------ loads


def load_row(builder, base, v, kind):
    """Vector v (16 lanes, in order) from a row of ``kind``, widened to float32."""
    element = ir.FloatType() if kind == types.float32 else ir.IntType(kind.bitwidth)
    ptr = builder.gep(base, [i64(v * LANES)])
    bits = builder.load(builder.bitcast(ptr, ir.VectorType(element, LANES).as_pointer()),
                        align=kind.bitwidth // 8)
    return widen_bits(builder, bits, kind)


def _block_stream(builder, data, base, kind, size):
    """The ``size`` values from element ``base`` of ``data`` as float32 vectors of 16, emitted as
    they are used, in an order fit for sums (bf16 read in pairs: bf16_pair)."""
    start = builder.gep(data, [base])
    if kind == types.uint16:
        for v in range(size // 32):
            yield from bf16_pair(builder, start, 32 * v)
    else:
        for v in range(size // LANES):
            yield load_row(builder, start, v, kind)


def _for_blocks(builder, n, body):
    """body(base, size) for the whole blocks of [0, n) (n a multiple of HALF): BLOCK values
    each, then TAIL values each, then one of HALF values if that is left."""
    blocks = builder.udiv(n, i64(BLOCK))
    with cgutils.for_range(builder, blocks) as loop:
        body(builder.mul(loop.index, i64(BLOCK)), BLOCK)
    start = builder.mul(blocks, i64(BLOCK))
    tails = builder.udiv(builder.sub(n, start), i64(TAIL))
    with cgutils.for_range(builder, tails) as loop:
        body(builder.add(start, builder.mul(loop.index, i64(TAIL))), TAIL)
    start = builder.add(start, builder.mul(tails, i64(TAIL)))
    with builder.if_then(builder.icmp_unsigned(">=", builder.sub(n, start), i64(HALF))):
        body(start, HALF)


# ------------------------------------------------------------------------------- prefetches
# The next row's inputs are prefetched while this row is worked on, half during each pass, at
# the pace the pass reads this row, so memory stays busy and the next first pass reads cache.
# ``far`` (a run-time bool): into L2 only, for rows too wide for L1 to hold this row and the
# next (memory.PREFETCH_L2_MIN_BYTES); into L1 otherwise.


def _prefetch_ir(builder, ptr, write, locality=3):
    """A prefetch of the line at ``ptr`` into all cache levels, or with ``locality`` 2 into L2
    and below (x86 prefetcht1, ARM PLDL2KEEP). Never faults, in bounds or not."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, int(write)), ir.Constant(i32, locality),
                      ir.Constant(i32, 1)])


def _prefetch_next_block(builder, base, kind):
    """Prefetch for writing the lines of the next output block (beyond the row's end: harmless)."""
    first = builder.bitcast(builder.gep(base, [i64(EMIT)]), ir.IntType(8).as_pointer())
    for line in range(EMIT * (kind.bitwidth // 8) // 64):
        _prefetch_ir(builder, builder.gep(first, [i64(64 * line)]), write=True)


def prefetch_ahead(context, builder, aryty, ary, j, values, ahead=1, far=None, skip=None):
    """Prefetch (for reading) the lines of values [j, j + ``values``) of the row ``ahead`` rows
    (and ``skip`` more: an i64, memory.prefetch_skip) after the row ``ary`` in memory; nothing for
    a None. ``far``: an i1, true for L2 only."""
    if isinstance(aryty, (types.NoneType, types.Omitted)):
        return
    data = context.make_array(aryty)(context, builder, ary)
    row = builder.extract_value(data.shape, 0)
    rows = ir.Constant(row.type, ahead)
    if skip is not None:
        rows = builder.add(rows, skip)
    if ahead > 1 or skip is not None:
        row = builder.mul(row, rows)
    first = builder.gep(data.data, [builder.add(row, j)])
    first = builder.bitcast(first, ir.IntType(8).as_pointer())
    lines = range(max(1, values * aryty.dtype.bitwidth // 8 // 64))
    if far is None:
        for line in lines:
            _prefetch_ir(builder, builder.gep(first, [i64(64 * line)]), write=False)
        return
    with builder.if_else(far) as (to_l2, to_l1):  # the locality is an immediate: one branch each
        for branch, locality in ((to_l2, 2), (to_l1, 3)):
            with branch:
                for line in lines:
                    _prefetch_ir(builder, builder.gep(first, [i64(64 * line)]), False, locality)


def _make_prefetch(values):
    """A function (a, j, far) that prefetches the lines of values [j, j + ``values``) of the row
    that follows the row ``a`` in memory; nothing for a None. The line count is a compile-time
    constant (a loop over numba's ``a.itemsize`` cost a division per block)."""

    def prefetch(typingctx, a, j, far):
        def codegen(context, builder, signature, args):
            prefetch_ahead(context, builder, signature.args[0], args[0], args[1], values, far=args[2])
            return context.get_dummy_value()

        return types.void(a, types.int64, types.boolean), codegen

    lines = intrinsic(prefetch)

    def fetch(a, j, far):  # pragma: no cover - replaced by the overload below
        raise NotImplementedError

    @overload(fetch, inline="always")
    def _ov_fetch(a, j, far):
        if isinstance(a, (types.NoneType, types.Omitted)):
            return lambda a, j, far: None
        return lambda a, j, far: lines(a, j, far)

    return fetch


_prefetch_wide = _make_prefetch(BLOCK // 2)
_prefetch_narrow = _make_prefetch(EMIT // 2)


@njit(inline="always")  # LLVM left a call per block otherwise (docs/cpu-kernels.md, "Prefetch")
def prefetch_pass1(a1, a2, j, far):
    """Prefetch what block j of pass 1 asks of the rows that follow a1 and a2 (a2 may be None):
    the values from j // 2, so the first half of the next row arrives during this pass 1."""
    _prefetch_wide(a1, j // 2, far)
    _prefetch_wide(a2, j // 2, far)


@njit(inline="always")
def prefetch_pass2(a1, a2, j, ahead, far):
    """Pass 2's share for block j: the values from d // 2 + j // 2 of the rows ``ahead`` rows
    after a1 and a2 (1, or 2 where rows go in pairs)."""
    h = a1.shape[0] * (ahead - 1) + a1.shape[0] // 2 + j // 2
    _prefetch_narrow(a1, h, far)
    _prefetch_narrow(a2, h, far)


# ----------------------------------------------------------------------------------- stores


def store_block(builder, kind, base, wbase, values, llama, stream, hw, zero):
    """Store float32 values (EMIT or HALF of them, in 16-lane vectors) at ``base`` in the
    output's dtype. ``llama``: the values are x * rstd, rounded to the output's dtype, widened,
    multiplied by the weights at ``wbase`` and rounded again. ``stream``: non-temporal stores
    (``base`` 64-byte aligned), of whole 64-byte lines. ``zero``: a staging row's line of zeros
    (see narrow_line)."""
    nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
    if not stream:
        _prefetch_next_block(builder, base, kind)
    if kind != types.float32 and (stream or (hw and kind == types.uint16)):
        _store_lines(builder, kind, base, wbase, values, llama, stream, hw, zero, nontemporal)
        return
    for v, x in enumerate(values):
        if llama:
            x = builder.fmul(widen_bits(builder, narrow_bits(builder, x, kind, hw), kind),
                             load_f32(builder, wbase, v))
        y = narrow_bits(builder, x, kind, hw)
        ptr = builder.bitcast(builder.gep(base, [i64(v * LANES)]), y.type.as_pointer())
        if stream:
            builder.store(y, ptr, align=64).set_metadata("nontemporal", nontemporal)
        else:
            builder.store(y, ptr, align=kind.bitwidth // 8)


def _store_lines(builder, kind, base, wbase, values, llama, stream, hw, zero, nontemporal):
    """store_block for 16-bit outputs two vectors to a 64-byte line: where streamed (whole lines),
    and for bf16 with the CPU's instruction, which converts two vectors in one vcvtne2ps2bf16 for
    the cost of one (the same bits; the llama order's first rounding too)."""
    assert len(values) % 2 == 0, "a block of whole 64-byte lines"
    for c in range(len(values) // 2):
        lo, hi = values[2 * c], values[2 * c + 1]
        if llama:
            if hw and kind == types.uint16:
                lo, hi = widen_line(builder, bf16_line(builder, lo, hi))
            else:
                lo, hi = (widen_bits(builder, narrow_bits(builder, u, kind, hw), kind) for u in (lo, hi))
            lo, hi = (builder.fmul(u, load_f32(builder, wbase, 2 * c + h)) for h, u in enumerate((lo, hi)))
        line = narrow_line(builder, lo, hi, kind, hw, zero if stream else None)
        ptr = builder.bitcast(builder.gep(base, [i64(2 * c * LANES)]), line.type.as_pointer())
        if stream:
            builder.store(line, ptr, align=64).set_metadata("nontemporal", nontemporal)
        else:
            builder.store(line, ptr, align=2)


def _store_pairs(builder, base, values, stream, hw, zero, nan=True):
    """Store float32 vectors (even, odd, even, odd, ...: see bf16_pair) as bf16 at ``base``, 32
    values a line (``stream``: non-temporal, ``base`` 64-byte aligned; ``nan``: see narrow_bits)."""
    if not stream:
        _prefetch_next_block(builder, base, types.uint16)
    nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
    for c in range(len(values) // 2):
        line = pair_line(builder, values[2 * c], values[2 * c + 1], hw, zero, nan)
        ptr = builder.bitcast(builder.gep(base, [i64(32 * c)]), line.type.as_pointer())
        if stream:
            builder.store(line, ptr, align=64).set_metadata("nontemporal", nontemporal)
        else:
            builder.store(line, ptr, align=2)


@intrinsic
def store_fence(typingctx):
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


# ----------------------------------------------------------------------------- output blocks


def forward_block(math, llama, stream, hw=HW_BF16, paired=False, finite=False, size=EMIT, rows=1):
    """An intrinsic (y, j, x, w, b, stage, mhi, mlo, rstd) that computes and stores the output
    block y[j:j + size] (EMIT, or HALF for a row's last values). ``math(builder, x, w, b, mhi,
    mlo, rstd)`` gives one 16-lane vector of outputs from one of x; ``w`` and ``b`` are functions
    that load the matching weights, so a form that does not use them loads nothing. ``llama``:
    the weight multiply happens as the block is stored (see store_block), not in ``math``.
    ``paired`` (bf16 x and y): x is read two values to a 32-bit lane (bf16_pair), w and b are in
    pair_order, and each 32 results are put back in place as they are stored (_store_pairs): no
    shuffles where bf16 is rounded with integer arithmetic (see rows.writes_pairs). ``finite``
    (with ``paired``): the caller knows that no output of the block is nan (rows.nan_free), so
    the rounding skips the nan select: the same bits, 2 fewer instructions per 8 values on AVX2,
    where these kernels are compute-bound. ``rows=2``: (y, y2, j, x, x2, w, b, stage, mhi, mlo,
    rstd, mhi2, mlo2, rstd2), the same block of two rows, each weight loaded once for both."""

    def codegen(context, builder, signature, args):
        kind, xkind = signature.args[0].dtype, signature.args[rows + 1].dtype
        data = [context.make_array(ty)(context, builder, a).data if isinstance(ty, types.Array) else None
                for ty, a in zip(signature.args, args)]
        at = args[rows]
        wbase, bbase = (builder.gep(data[k], [at]) for k in (2 * rows + 1, 2 * rows + 2))
        loaded = {}

        def param(base, v):  # loaded once, for the first row that uses it
            if (base, v) not in loaded:
                loaded[base, v] = load_f32(builder, base, v)
            return loaded[base, v]

        zero = builder.gep(data[2 * rows + 3], [i64(ZERO)])
        for r in range(rows):
            xbase = builder.gep(data[rows + 1 + r], [at])
            mhi, mlo, row_rstd = (f32x16(builder, args[2 * rows + 4 + 3 * r + k]) for k in range(3))
            if paired:
                xs = [u for c in range(size // 32) for u in bf16_pair(builder, xbase, 32 * c)]
            else:
                xs = [load_row(builder, xbase, v, xkind) for v in range(size // LANES)]
            values = []
            for v, t in enumerate(xs):
                values.append(math(builder, t, lambda v=v: param(wbase, v), lambda v=v: param(bbase, v),
                                   mhi, mlo, row_rstd))
            ybase = builder.gep(data[r], [at])
            if paired:
                if llama:  # as store_block does it: round, widen, times the weight
                    values = [builder.fmul(widen_bits(builder, narrow_bits(builder, u, kind, hw, not finite),
                                                      kind), param(wbase, v))
                              for v, u in enumerate(values)]
                _store_pairs(builder, ybase, values, stream, hw, zero, not finite)
            else:
                store_block(builder, kind, ybase, wbase, values, llama, stream, hw, zero)
        return context.get_dummy_value()

    f = types.float32
    if rows == 1:
        def block(typingctx, y, j, x, w, b, stage, mhi, mlo, row_rstd):
            return types.void(y, types.uint64, x, w, b, stage, f, f, f), codegen
    else:
        def block(typingctx, y, y2, j, x, x2, w, b, stage, mhi, mlo, row_rstd, mhi2, mlo2, row_rstd2):
            return types.void(y, y2, types.uint64, x, x2, w, b, stage, f, f, f, f, f, f), codegen

    return intrinsic(block)


def backward_block(math, stream, paired=False, reads_x=True, hw=HW_BF16, finite=False, size=EMIT):
    """An intrinsic (dx, j, dy, x, w, ds, stage, p0, p1, p2, rstd) that computes and stores the
    block dx[j:j + size] (EMIT, or HALF for a row's last values), plus ds (the residual's
    gradient) when it is not None. ``math(builder, dy, x, w, (p0, p1, p2), rstd)`` gives one
    16-lane vector of dx from one of dy and x (x None without ``reads_x``). ``paired`` (bf16
    rows, the block's start a multiple of 32 from the row's): the inputs are read two values to
    a 32-bit lane (bf16_pair), w is in pair_order, and each 32 results are interleaved back into
    place as they are stored (_store_pairs). ``finite`` (with ``paired``): the caller knows no dx
    of the block is nan (rows.grad_nan_free), so the integer rounding skips the nan select, as
    forward_block's does."""

    def block(typingctx, dx, j, dy, x, w, ds, stage, p0, p1, p2, row_rstd):
        has_ds = not isinstance(ds, (types.NoneType, types.Omitted))

        def codegen(context, builder, signature, args):
            data = {k: context.make_array(signature.args[k])(context, builder, args[k]).data
                    for k in (0, 2, 3, 4, 6)}
            if has_ds:
                data[5] = context.make_array(signature.args[5])(context, builder, args[5]).data
            at = args[1]
            base = {k: builder.gep(v, [at]) for k, v in data.items()}
            p = [f32x16(builder, args[k]) for k in (7, 8, 9)]
            row_rstd = f32x16(builder, args[10])

            def row(k, kind):
                if paired:
                    return [u for c in range(size // 32) for u in bf16_pair(builder, base[k], 32 * c)]
                return [load_row(builder, base[k], v, kind) for v in range(size // LANES)]

            dys = row(2, dy.dtype)
            xs = row(3, x.dtype) if reads_x else [None] * (size // LANES)
            dss = row(5, ds.dtype) if has_ds else None
            values = []
            for v in range(size // LANES):
                t = math(builder, dys[v], xs[v], load_f32(builder, base[4], v), p, row_rstd)
                if has_ds:
                    t = builder.fadd(t, dss[v])
                values.append(t)
            zero = builder.gep(data[6], [i64(ZERO)])
            if paired:
                _store_pairs(builder, base[0], values, stream, hw, zero, not finite)
            else:
                store_block(builder, dx.dtype, base[0], base[4], values, False, stream, hw, zero)
            return context.get_dummy_value()

        f = types.float32
        return types.void(dx, types.uint64, dy, x, w, ds, stage, f, f, f, f), codegen

    return intrinsic(block)


# --------------------------------------------------------------------------------- row sums
# Pass 1 over a row's whole blocks: per block, 16-lane vectors summed into _ACC float32
# accumulators per sum, the block's lanes then added to float64 lanes, reduced once per row.
# As fast as a float32 sum and as accurate as a float64 one for any row length.


def f64_totals(builder, count):
    """``count`` running float64 totals, each two 8-lane vectors (a 16-lane float32 block's halves)."""
    f64 = ir.VectorType(ir.DoubleType(), LANES // 2)
    return [[cgutils.alloca_once_value(builder, ir.Constant(f64, [0.0] * f64.count)) for _ in range(2)]
            for _ in range(count)]


def add_blocks(builder, acc, totals):
    """Add each sum's block (its _ACC float32 accumulators, added pairwise) to its float64 total."""
    f64 = ir.VectorType(ir.DoubleType(), LANES // 2)
    for sums, total in zip(acc, totals):
        block = _tree(builder, sums)
        for h, t in enumerate(total):
            builder.store(builder.fadd(builder.load(t), builder.fpext(_half(builder, block, h), f64)), t)


def scalar_totals(builder, totals):
    """The float64 totals as scalars."""
    return [_lanes_sum(builder, _tree(builder, [builder.load(t) for t in total])) for total in totals]


def _make_row_sums(terms):
    """An intrinsic (xr, n, c, a1, a2, far) -> (float64, float64) over the values [0, n) of row
    xr (n a multiple of HALF: _for_blocks). ``terms``: "centred", the sums of u and u^2 for
    u = x - c; "wide", the same with every term in float64 (u^2 exact: pass 1 of rows of at most
    a BLOCK, whose E[u^2] - E[u]^2 may cancel); "squares", the sum of x^2 (and 0.0; c not used).
    A block at j prefetches the values from j // 2 of the rows after a1 and a2, as prefetch_pass1
    does."""
    wide = terms == "wide"

    def row_sums(typingctx, xr, n, c, a1, a2, far):
        kind = xr.dtype

        def codegen(context, builder, signature, args):
            ty = ir.VectorType(ir.DoubleType(), LANES // 2) if wide else ir.VectorType(ir.FloatType(), LANES)
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            shift = f32x16(builder, args[2])
            if wide:
                shift = _half(builder, builder.fpext(shift, ir.VectorType(ir.DoubleType(), LANES)), 0)
            nsums = 1 if terms == "squares" else 2
            totals = f64_totals(builder, nsums)

            def block(base, size):
                half = builder.udiv(base, i64(2))
                for k in (3, 4):
                    prefetch_ahead(context, builder, signature.args[k], args[k], half, size // 2,
                                   far=args[5])
                acc = [[ir.Constant(ty, [0.0] * ty.count)] * _ACC for _ in range(nsums)]
                values = _block_stream(builder, data, base, kind, size)
                if wide:
                    values = (builder.fpext(_half(builder, x, h), ty) for x in values for h in (0, 1))
                for v, x in enumerate(values):
                    a = v % _ACC
                    if nsums == 2:
                        x = builder.fsub(x, shift)
                        acc[1][a] = fma_ir(builder, x, x, acc[1][a])
                        acc[0][a] = builder.fadd(acc[0][a], x)
                    else:
                        acc[0][a] = fma_ir(builder, x, x, acc[0][a])
                if wide:  # the first of each sum's two float64 totals takes it all
                    for sums, (total, _) in zip(acc, totals):
                        builder.store(builder.fadd(builder.load(total), _tree(builder, sums)), total)
                else:
                    add_blocks(builder, acc, totals)

            _for_blocks(builder, args[1], block)
            out = scalar_totals(builder, totals)
            if nsums == 1:
                out.append(ir.Constant(ir.DoubleType(), 0.0))
            return context.make_tuple(builder, signature.return_type, out)

        return types.UniTuple(types.float64, 2)(xr, types.int64, types.float32, a1, a2,
                                                types.boolean), codegen

    return intrinsic(row_sums)


row_moments = _make_row_sums("centred")
row_moments_wide = _make_row_sums("wide")
row_sumsq = _make_row_sums("squares")


def grad_sums(terms, rows=1, with_db=False, hw=HW_BF16):
    """An intrinsic for the backward's first pass over the whole blocks of bf16 rows (and of
    layer_norm's other rows, their last HALF block): the two sums its dx formula needs, and the
    rows' dw (and db) terms added to the chunk's partial rows on the way. Arguments (dyr, xr,
    w_pairs, dwc, aux, n, c0, c1, c2, skip, far) -> (float64, float64), over values [0, n) (a
    multiple of HALF: _for_blocks); ``aux`` is the db partial row (``with_db``) or any array whose
    dtype ``terms`` reads. bf16 values arrive in pair order (bf16_pair), so w_pairs, dwc and aux
    are kept in pair_order; other dtypes' in order.

    ``terms(builder, x, dy, w, (c0, c1, c2), s0, s1, a, aux_kind, hw)`` adds one vector's terms
    to accumulators s0[a] and s1[a] and returns xhat; then dw += dy * xhat (one fma) and, with
    ``with_db``, db += dy.

    ``rows=2``: (dyr, xr, dyr2, xr2, w_pairs, dwc, aux, n, c0, c1, c2, e0, e1, e2, skip, far) -> four float64,
    the same work for two rows at once, which loads and stores each partial-row value once for
    both. The terms reach dwc in the order two calls would add them: the bits do not change."""

    def codegen(context, builder, signature, args):
        f32 = ir.VectorType(ir.FloatType(), LANES)
        data = [context.make_array(signature.args[k])(context, builder, args[k]).data
                for k in range(2 * rows + 2)]
        w_data, dw_data = data[2 * rows :]
        aux_type = signature.args[2 * rows + 2]
        db_data = context.make_array(aux_type)(context, builder, args[2 * rows + 2]).data if with_db else None
        c = [[f32x16(builder, args[2 * rows + 4 + 3 * r + k]) for k in range(3)] for r in range(rows)]
        totals = f64_totals(builder, 2 * rows)

        def block(base, size):
            half = builder.udiv(base, i64(2))
            for r in range(rows):
                for k in (2 * r + 1, 2 * r):
                    prefetch_ahead(context, builder, signature.args[k], args[k], half, size // 2, rows,
                                   args[-1], args[-2])
            acc = [[ir.Constant(f32, [0.0] * LANES)] * _ACC for _ in range(2 * rows)]
            streams = [(_block_stream(builder, data[2 * r + 1], base, signature.args[2 * r + 1].dtype, size),
                        _block_stream(builder, data[2 * r], base, signature.args[2 * r].dtype, size))
                       for r in range(rows)]
            for v in range(size // LANES):
                a = v % _ACC
                at = builder.add(base, i64(v * LANES))
                w = load_f32(builder, builder.gep(w_data, [at]), 0)
                dwp = builder.bitcast(builder.gep(dw_data, [at]), f32.as_pointer())
                dw = builder.load(dwp, align=4)
                if with_db:
                    dbp = builder.bitcast(builder.gep(db_data, [at]), f32.as_pointer())
                    db = builder.load(dbp, align=4)
                for r, (xs, dys) in enumerate(streams):
                    x, dy = next(xs), next(dys)
                    xh = terms(builder, x, dy, w, c[r], acc[2 * r], acc[2 * r + 1], a, aux_type.dtype, hw)
                    if with_db:
                        db = builder.fadd(db, dy)
                    dw = fma_ir(builder, dy, xh, dw)
                if with_db:
                    builder.store(db, dbp, align=4)
                builder.store(dw, dwp, align=4)
            add_blocks(builder, acc, totals)

        _for_blocks(builder, args[2 * rows + 3], block)
        out = scalar_totals(builder, totals)
        return context.make_tuple(builder, signature.return_type, out)

    f = types.float32
    if rows == 1:
        def sums(typingctx, dyr, xr, w_pairs, dwc, aux, n, c0, c1, c2, skip, far):
            return types.UniTuple(types.float64, 2)(dyr, xr, w_pairs, dwc, aux, types.int64, f, f, f,
                                                    types.int64, types.boolean), codegen
    else:
        def sums(typingctx, dyr, xr, dyr2, xr2, w_pairs, dwc, aux, n, c0, c1, c2, e0, e1, e2, skip, far):
            return (types.UniTuple(types.float64, 4)(dyr, xr, dyr2, xr2, w_pairs, dwc, aux, types.int64, f, f,
                                                     f, f, f, f, types.int64, types.boolean), codegen)

    return intrinsic(sums)
