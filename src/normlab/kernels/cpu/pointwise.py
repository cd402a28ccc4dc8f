"""The point-wise replacements of a norm on CPU, fused: DyT (Zhu et al. 2025, "Transformers
without Normalization") and Derf (Chen et al. 2025, "Stronger Normalization-Free Transformers"),
forward and backward, by the same kernels.

Forward, elementwise (no statistics: a and s are learned scalars, w and b per feature):

    DyT:   y = w * f(z) + b,   f = tanh,   z = a * x
    Derf:  y = w * f(z) + b,   f = erf,    z = a * x + s

Backward, with t = f(z) and u = dy * w * f'(z):

    dx = a * u
    da = sum over every element of u * x,      ds = sum over every element of u (Derf)
    dw = sum over rows of dy * t,              db = sum over rows of dy

The kernels take s as None for DyT and as a float32 for Derf: numba compiles one specialization
of each, and the blocks below emit tanh's or erf's IR by s's type, so DyT's machine code is what
it was before Derf joined. Each row is read once and written once, like a copy, but tanh and erf
cost some 30 vector operations per 16 values, so the loops are compute-bound (float32 here, and
16-bit dtypes without tables): they run as 16-lane vectors written out in LLVM IR (simd.py's
blocks), and the scalar heads and tails run the same IR on a vector's first lane, so every
element gets the same bits wherever it falls in its row. A 16-bit x is one of only 65536 values:
from DYT_TABLE_MIN elements the kernels first tabulate f for every one of them (the same IR, so
the same bits) and then gather from the table ("tables" below). The sums are float64, one set
per chunk of rows, added in chunk order by the launcher: the same inputs and thread count give
the same bits. (da's terms are summed by output block, and with streaming stores the blocks
start at the first 64-byte boundary: a streamed call rounds da's sum in another order.)
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cache import kernel
from .codecs import LANES, load_at, load_f32, store_at, widen_bits
from .rows import FLUSH, at, chunk_span, flush_into, partial_row_pairs, block_spans, row_of
from .simd import (AVX512, ZERO, EMIT, HALF, HW_BF16, add_blocks, f32x16, f64_totals, fma_ir, fma32, load_row,
                   prefetch_ahead, store_block, store_fence, scalar_totals)
from .tanh_erf import F32, I32, const, erf, erf_grad, tanh, tanh_grad


# ------------------------------------------------------------------- DyT or Derf, by s's type
# Every block below takes s, the shift: None (numba's none type) for DyT, a float32 for Derf.


def _z(builder, a, x, s):
    """The argument of f for 16 lanes: a x (DyT) or a x + s rounded once (Derf)."""
    return builder.fmul(a, x) if s is None else fma_ir(builder, a, x, s)


def _f(builder, z, s):
    return tanh(builder, z) if s is None else erf(builder, z)


def _f_grad(builder, z, s):
    return tanh_grad(builder, z) if s is None else erf_grad(builder, z)


def _shift(builder, signature, args, k):
    """Argument k, the shift, as 16 lanes; None where it is None (DyT)."""
    return None if isinstance(signature.args[k], types.NoneType) else f32x16(builder, args[k])


def _lane0(context, builder, signature, args, body):
    """A scalar intrinsic's codegen from a 16-lane one: the scalars splatted, ``body`` on the
    vectors, lane 0 of each result. The same instructions give the same bits as the blocks."""
    outs = body(builder, *(f32x16(builder, a) for a in args))
    if not isinstance(outs, tuple):
        return builder.extract_element(outs, ir.Constant(ir.IntType(32), 0))
    lanes = [builder.extract_element(v, ir.Constant(ir.IntType(32), 0)) for v in outs]
    return context.make_tuple(builder, signature.return_type, lanes)


# ----------------------------------------------------------------------------------- tables
# A bf16 or fp16 x is one of 65536 bit patterns, so tanh(a x) is one of 65536 values. From
# DYT_TABLE_MIN elements, a call first fills a table with them, for every pattern (nan, inf and
# subnormal ones included), by the blocks' own IR: the table holds the bits the blocks would
# compute. The blocks then gather from it, one vgatherdps in place of some 30 operations, and the
# bf16 kernels stop being bound by the vector ports (docs/cpu-kernels.md, "DyT"). The forward's
# table holds t; the backward's holds (t, s) pairs, one 8-byte gather per value. Filling costs
# about as much as 65536 elements of compute, split over the chunks; below DYT_TABLE_MIN the
# blocks compute tanh as float32 rows do. x86 with AVX-512 only (the gathers are AVX-512's), and
# not where the microcode mitigation of Gather Data Sampling ("Downfall") makes gathers several
# times slower: there the gathers would cost more than the tanh (measured only on an unaffected CPU).
DYT_TABLE_MIN = 1 << 20
TABLE_SIZE = 1 << 16
GDS_STATUS = "/sys/devices/system/cpu/vulnerabilities/gather_data_sampling"


def gathers_are_fast(status: str = GDS_STATUS) -> bool:
    """False where Linux reports the GDS mitigation in force; True otherwise (also where it
    does not say)."""
    try:
        with open(status) as f:
            return not f.read().startswith("Mitigation")
    except OSError:
        return True


TABLES = AVX512 and gathers_are_fast()


# On a Zen 4 (LLVM's znver4) a 16-lane gather costs more than the forward's tanh: the forward
# computed 1.1-1.3x faster than it gathered there, while the backward's table, which stands in
# for twice the work, still ran it 1.9-2.1x faster (docs/cpu-kernels.md, "DyT"). The tables stay
# compiled in; the launcher's table (empty or not) picks the path at run time.
def forward_tables(cpu_name: str) -> bool:
    """Whether the forward gathers from a table, where there are tables, on a CPU LLVM names so."""
    return cpu_name != "znver4"


FORWARD_TABLES = TABLES and forward_tables(llvm.get_host_cpu_name())


def table_for(x, grad: bool) -> np.ndarray:
    """The table a call on x (a tensor or numpy array) fills: empty where the blocks compute."""
    use = (TABLES if grad else FORWARD_TABLES) and x.itemsize == 2 and x.nbytes // 2 >= DYT_TABLE_MIN
    return np.empty((2 if grad else 1) * TABLE_SIZE if use else 0, np.float32)


def _tabled(kind):
    """Whether blocks on x of this numba dtype emit the gathers (the run-time flag picks)."""
    return TABLES and kind != types.float32


def _gather_dps(builder, table, idx):
    """table[idx] for 16 lanes (float32 entries, idx an <16 x i32> of patterns)."""
    i8p, mask = ir.IntType(8).as_pointer(), ir.VectorType(ir.IntType(1), LANES)
    fnty = ir.FunctionType(F32, [F32, i8p, I32, mask, ir.IntType(32)])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.mask.gather.dps.512")
    return builder.call(fn, [const(0.0), builder.bitcast(table, i8p), idx, ir.Constant(mask, [1] * LANES),
                             ir.Constant(ir.IntType(32), 4)])


def _gather_pairs(builder, table, idx):
    """(t, s) for 16 lanes from a table of (t, s) pairs: two gathers of eight 8-byte entries."""
    i8p, f64x8, i32x8 = ir.IntType(8).as_pointer(), ir.VectorType(ir.DoubleType(),
                                                                  8), ir.VectorType(ir.IntType(32), 8)
    mask = ir.VectorType(ir.IntType(1), 8)
    fnty = ir.FunctionType(f64x8, [f64x8, i8p, i32x8, mask, ir.IntType(32)])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.mask.gather.dpd.512")
    halves = []
    for h in range(2):
        part = builder.shuffle_vector(idx, idx, ir.Constant(i32x8, list(range(8 * h, 8 * h + 8))))
        pairs = builder.call(fn, [ir.Constant(f64x8, [0.0] * 8), builder.bitcast(table, i8p), part,
                                  ir.Constant(mask, [1] * 8), ir.Constant(ir.IntType(32), 8)])
        halves.append(builder.bitcast(pairs, F32))
    return tuple(builder.shuffle_vector(*halves, ir.Constant(I32, list(range(k, 32, 2)))) for k in (0, 1))


def _patterns(builder, base, v):
    """Vector v of a 16-bit row's bit patterns, as table indices (<16 x i32>)."""
    ty = ir.VectorType(ir.IntType(16), LANES)
    ptr = builder.gep(base, [ir.Constant(ir.IntType(64), v * LANES)])
    return builder.zext(builder.load(builder.bitcast(ptr, ty.as_pointer()), align=2), I32)


def _x_of(builder, idx, kind):
    """The float32 value of 16 bit patterns (the inverse of _patterns)."""
    return widen_bits(builder, builder.trunc(idx, ir.VectorType(ir.IntType(16), LANES)), kind)


def _either(builder, flag, then, otherwise):
    """then() if the run-time boolean ``flag`` else otherwise(): each a list of 16-lane vectors."""
    with builder.if_else(flag) as (yes, no):
        with yes:
            a, a_block = then(), builder.block
        with no:
            b, b_block = otherwise(), builder.block
    out = []
    for u, v in zip(a, b):
        phi = builder.phi(u.type)
        phi.add_incoming(u, a_block)
        phi.add_incoming(v, b_block)
        out.append(phi)
    return out


def _splat_i32(builder, scalar):
    """An i32 scalar splatted to 16 lanes."""
    v = builder.insert_element(ir.Constant(I32, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, v, ir.Constant(I32, [0] * LANES))


def _make_fill(grad):
    """An intrinsic (table, j, x, a, s) that fills the table's entries for the patterns
    [j, j + EMIT) (x only gives the dtype): t, or with ``grad`` interleaved (t, slope) pairs."""

    def codegen(context, builder, signature, args):
        kind = signature.args[2].dtype
        if not _tabled(kind):  # (float32 x: never called, no table)
            return context.get_dummy_value()
        table = context.make_array(signature.args[0])(context, builder, args[0]).data
        av, sv = f32x16(builder, args[3]), _shift(builder, signature, args, 4)
        first = builder.trunc(args[1], ir.IntType(32))
        for v in range(EMIT // LANES):
            idx = builder.add(_splat_i32(builder, builder.add(first, ir.Constant(ir.IntType(32), v * LANES))),
                              ir.Constant(I32, list(range(LANES))))
            z = _z(builder, av, _x_of(builder, idx, kind), sv)
            if grad:
                t, s = _f_grad(builder, z, sv)
                lines = [builder.shuffle_vector(t, s, ir.Constant(I32, [k // 2 + 16 * (k % 2) + 8 * h
                                                                        for k in range(16)]))
                         for h in range(2)]
                at = builder.mul(builder.add(args[1], ir.Constant(ir.IntType(64), v * LANES)),
                                 ir.Constant(ir.IntType(64), 2))
            else:
                lines, at = [_f(builder, z, sv)], builder.add(args[1], ir.Constant(ir.IntType(64), v * LANES))
            for k, line in enumerate(lines):
                ptr = builder.gep(table, [builder.add(at, ir.Constant(ir.IntType(64), k * LANES))])
                builder.store(line, builder.bitcast(ptr, F32.as_pointer()), align=4)
        return context.get_dummy_value()

    def fill(typingctx, table, j, x, a, s):
        return types.void(table, types.int64, x, types.float32, s), codegen

    return intrinsic(fill)


_fill_t, _fill_ts = _make_fill(False), _make_fill(True)


@njit(inline="always")
def _fill_table(fill, table, x, a, s, c, nchunks):
    """Chunk c's share of the table's patterns."""
    b0, b1 = chunk_span(c, nchunks, TABLE_SIZE // EMIT)
    for k in range(b0, b1):
        fill(table, k * EMIT, x, a, s)


# ---------------------------------------------------------------------------------- forward


def _y(builder, x, w, b, a, s=None):
    """16 outputs: w * f(z) + b."""
    return fma_ir(builder, w, _f(builder, _z(builder, a, x, s), s), b)


@intrinsic
def _y_scalar(typingctx, x, w, b, a, s):
    def codegen(context, builder, signature, args):
        sv = _shift(builder, signature, args, 4)
        return _lane0(context, builder, signature, args[:4], lambda builder, *v: _y(builder, *v, sv))

    f = types.float32
    return f(f, f, f, f, s), codegen


def _make_y_blocks(size):
    """An intrinsic (y, j0, j1, x, w, b, stage, a, s, stream, table, use, far, skip): the outputs
    [j0, j1) of a row (j1 - j0 a multiple of ``size``: EMIT, or HALF for a row's last values),
    ``size`` at a time: t computed, or gathered from ``table`` where ``use``. ``stream``:
    streamed (both run-time branches per block). Each block prefetches the same block of the next
    row (``skip`` rows further: memory.prefetch_skip), into L2 where ``far`` (simd.prefetch_ahead):
    with the hardware prefetcher alone the compute waited on memory (docs/cpu-kernels.md, "DyT").
    The backward's blocks do the same."""

    def y_blocks(typingctx, y, j0, j1, x, w, b, stage, a, s, stream, table, use, far, skip):
        b1, i = types.boolean, types.int64
        return types.void(y, i, i, x, w, b, stage, types.float32, s, b1, table, b1, b1, i), codegen

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        ykind, xkind = signature.args[0].dtype, signature.args[3].dtype
        yd, xd, wd, bd, sd, td = (context.make_array(signature.args[k])(context, builder, args[k]).data
                                  for k in (0, 3, 4, 5, 6, 10))
        zero = builder.gep(sd, [ir.Constant(i64, ZERO)])
        av, sv = f32x16(builder, args[7]), _shift(builder, signature, args, 8)
        count = builder.udiv(builder.sub(args[2], args[1]), ir.Constant(i64, size))
        with cgutils.for_range(builder, count) as loop:
            at = builder.add(args[1], builder.mul(loop.index, ir.Constant(i64, size)))
            prefetch_ahead(context, builder, signature.args[3], args[3], at, size, far=args[12],
                           skip=args[13])
            xb, wb, bb = (builder.gep(data, [at]) for data in (xd, wd, bd))
            blocks = range(size // LANES)
            ws, bs = [load_f32(builder, wb, v) for v in blocks], [load_f32(builder, bb, v) for v in blocks]
            if _tabled(xkind):
                idx = [_patterns(builder, xb, v) for v in blocks]
                ts = _either(builder, args[11], lambda: [_gather_dps(builder, td, i) for i in idx],
                             lambda: [_f(builder, _z(builder, av, _x_of(builder, i, xkind), sv), sv)
                                      for i in idx])
                values = [fma_ir(builder, ws[v], ts[v], bs[v]) for v in blocks]
            else:
                values = [_y(builder, load_row(builder, xb, v, xkind), ws[v], bs[v], av, sv) for v in blocks]
            with builder.if_else(args[9]) as (streamed, plain):
                for flag, branch in ((True, streamed), (False, plain)):
                    with branch:
                        store_block(builder, ykind, builder.gep(yd, [at]), wb, values, False, flag, HW_BF16,
                                    zero)
        return context.get_dummy_value()

    return intrinsic(y_blocks)


_y_blocks, _y_half = _make_y_blocks(EMIT), _make_y_blocks(HALF)


@kernel
def pointwise_fwd(x, a, s, w, b, y, stages, stream, table, far, skip):
    """y = w * f(a x [+ s]) + b: DyT where s is None, Derf where s is a float32."""
    x, w, b, y = at(x), at(w), at(b), at(y)
    n, d = x.shape
    a32 = np.float32(a)
    nchunks = stages.shape[0]
    use = table.shape[0] > 0
    if use:
        for c in prange(nchunks):
            _fill_table(_fill_t, table, x, a32, s, c, nchunks)
    for c in prange(nchunks):
        r0, r1 = chunk_span(c, nchunks, n)
        stage = stages[c]
        for r in range(r0, r1):
            xr, yr = row_of(x, r), row_of(y, r)
            head, body = block_spans(yr, 0, d, stream)
            for i in range(head):
                store_at(yr, i, _y_scalar(load_at(xr, i), load_at(w, i), load_at(b, i), a32, s))
            _y_blocks(yr, head, body, xr, w, b, stage, a32, s, stream, table, use, far, skip)
            if d - body >= HALF:  # a row's last 32-63 values: a half block, not 32 one-lane ones
                _y_half(yr, body, body + HALF, xr, w, b, stage, a32, s, stream, table, use, far, skip)
                body += HALF
            for i in range(body, d):
                store_at(yr, i, _y_scalar(load_at(xr, i), load_at(w, i), load_at(b, i), a32, s))
        if stream:
            store_fence()


# --------------------------------------------------------------------------------- backward
# One pass: each element's dx is stored, its dw and db terms go to the chunk's float32 partial
# rows (added to its float64 rows dw_sum, db_sum: (nchunks, d) every FLUSH rows, as in the norms'
# backward, rows.py), and its da term (and Derf's ds term) to float32 lanes that each block of
# EMIT adds to float64 lanes; da_sum (nchunks, 2) takes each chunk's da and ds (0 for DyT). Rows
# from these widths go two at a time, so each partial-row value (and w) is loaded and stored once
# per two rows; below them pairs were slower (docs/cpu-kernels.md, "DyT").
DYT_PAIRS_MIN_16 = 512  # bf16 and fp16 rows
DYT_PAIRS_MIN_32 = 2048  # float32 rows


def _grad(builder, g, x, w, a, s=None, ts=None):
    """(dx, v * x, v, t) for 16 elements, v = u / 4 = g * w * slope (slope = f'(z) / 4): the da
    and ds terms come as quarters (the kernel multiplies the sums by 4, exactly). ``ts``:
    (t, slope) from a table, else computed."""
    t, slope = ts or _f_grad(builder, _z(builder, a, x, s), s)
    v = builder.fmul(builder.fmul(g, w), slope)
    return builder.fmul(builder.fmul(a, const(4.0)), v), builder.fmul(v, x), v, t


@intrinsic
def _grad_scalar(typingctx, g, x, w, a, s):
    def codegen(context, builder, signature, args):
        sv = _shift(builder, signature, args, 4)
        return _lane0(context, builder, signature, args[:4], lambda builder, *v: _grad(builder, *v, sv))

    f = types.float32
    return types.UniTuple(f, 4)(f, f, f, f, s), codegen


@njit
def _grad_element(dyr, xr, w, dxr, dwc, dbc, a, s, i):
    """Element i's dx stored and its dw, db terms added; returns its da and ds terms (quarters)."""
    g = load_at(dyr, i)
    dx, vx, v, t = _grad_scalar(g, load_at(xr, i), load_at(w, i), a, s)
    store_at(dxr, i, dx)
    j = np.uint64(i)  # unsigned: an affine address (see codecs.py)
    dwc[j] = fma32(g, t, dwc[j])
    dbc[j] += g
    return np.float64(vx), np.float64(v)


def _make_grad_blocks(rows=1, hw=HW_BF16, size=EMIT):
    """An intrinsic (dx, j0, j1, dy, x, w, dwc, dbc, stage, a, s, stream, table, use, far, skip) -> (float64,
    float64): the elements [j0, j1) of a row (j1 - j0 a multiple of ``size``: EMIT, or HALF for a
    row's last values) as _grad_element does each one, 16 at a time; returns the sums of their da
    and ds terms (float32 within a block, float64 lanes across blocks; ds is 0.0 for DyT, whose
    blocks do not sum it). ``stream``: dx's blocks are streamed; ``use``: (t, slope) come from
    ``table`` (both run-time branches per block: the arithmetic is emitted once, which halves the
    compile time of two specialized copies). ``far``: prefetch into L2 (simd.prefetch_ahead).

    ``rows=2``: (..., use, dx2, dy2, x2, far, skip) -> four float64 (each row's da, then each row's ds), the
    same for two rows at once, which loads and stores each partial-row value once for both. The
    second row's terms reach dwc and dbc after the first's, as two calls would add them, and each
    row's sums are its own: the bits do not change."""

    def codegen(context, builder, signature, args):
        f32 = ir.VectorType(ir.FloatType(), LANES)
        i64 = ir.IntType(64)
        rows_in = [(0, 3, 4), (14, 15, 16)][:rows]  # each row's (dx, dy, x) arguments
        data = {k: context.make_array(signature.args[k])(context, builder, args[k]).data
                for k in (5, 6, 7, 8, 12, *sum(rows_in, ()))}
        zero = builder.gep(data[8], [ir.Constant(i64, ZERO)])
        av, sv = f32x16(builder, args[9]), _shift(builder, signature, args, 10)
        derf = sv is not None
        totals = f64_totals(builder, 2 * rows if derf else rows)
        count = builder.udiv(builder.sub(args[2], args[1]), ir.Constant(i64, size))
        xkind = signature.args[4].dtype
        blocks = range(size // LANES)
        with cgutils.for_range(builder, count) as loop:
            at = builder.add(args[1], builder.mul(loop.index, ir.Constant(i64, size)))
            wb, dwb, dbb = (builder.gep(data[k], [at]) for k in (5, 6, 7))
            for row in rows_in:
                for k in row[1:]:
                    prefetch_ahead(context, builder, signature.args[k], args[k], at, size, rows, args[-2],
                                   args[-1])
            xs, tabled = {}, {}  # (row, v) -> x, and (t, slope) where the blocks may gather
            if _tabled(xkind):
                idx = {(r, v): _patterns(builder, builder.gep(data[kx], [at]), v)
                       for r, (_, _, kx) in enumerate(rows_in) for v in blocks}
                xs = {key: _x_of(builder, i, xkind) for key, i in idx.items()}
                flat = _either(builder, args[13],
                               lambda: [u for i in idx.values() for u in _gather_pairs(builder, data[12], i)],
                               lambda: [u for x in xs.values()
                                        for u in _f_grad(builder, _z(builder, av, x, sv), sv)])
                tabled = {key: (flat[2 * k], flat[2 * k + 1]) for k, key in enumerate(idx)}
            values, terms, shifts = [[] for _ in rows_in], [[] for _ in rows_in], [[] for _ in rows_in]
            for v in blocks:
                w = load_f32(builder, wb, v)
                dwp, dbp = (builder.bitcast(builder.gep(base, [ir.Constant(i64, v * LANES)]),
                                            f32.as_pointer()) for base in (dwb, dbb))
                dw, db = builder.load(dwp, align=4), builder.load(dbp, align=4)
                for r, (kdx, kdy, kx) in enumerate(rows_in):
                    g = load_row(builder, builder.gep(data[kdy], [at]), v, signature.args[kdy].dtype)
                    x = xs[r, v] if xs else load_row(builder, builder.gep(data[kx], [at]), v, xkind)
                    dxv, vx, u, t = _grad(builder, g, x, w, av, sv, tabled.get((r, v)))
                    values[r].append(dxv)
                    terms[r].append(vx)
                    shifts[r].append(u)
                    dw, db = fma_ir(builder, g, t, dw), builder.fadd(db, g)
                builder.store(dw, dwp, align=4)
                builder.store(db, dbp, align=4)
            with builder.if_else(args[11]) as (streamed, plain):
                for stream, branch in ((True, streamed), (False, plain)):
                    with branch:
                        for r, (kdx, _, _) in enumerate(rows_in):
                            base = builder.gep(data[kdx], [at])
                            store_block(builder, signature.args[kdx].dtype, base, wb, values[r], False,
                                        stream, hw, zero)
            add_blocks(builder, terms + shifts if derf else terms, totals)
        sums = scalar_totals(builder, totals)
        if not derf:
            sums += [ir.Constant(ir.DoubleType(), 0.0)] * rows
        return context.make_tuple(builder, signature.return_type, sums)

    f, b, i = types.float32, types.boolean, types.int64
    if rows == 1:
        def blocks(typingctx, dx, j0, j1, dy, x, w, dwc, dbc, stage, a, s, stream, table, use, far, skip):
            return types.UniTuple(types.float64, 2)(dx, i, i, dy, x, w, dwc, dbc, stage, f, s, b, table, b, b,
                                                    i), codegen
    else:
        def blocks(typingctx, dx, j0, j1, dy, x, w, dwc, dbc, stage, a, s, stream, table, use, dx2, dy2, x2,
                   far, skip):
            return (types.UniTuple(types.float64, 4)(dx, i, i, dy, x, w, dwc, dbc, stage, f, s, b, table, b,
                                                     dx2, dy2, x2, b, i), codegen)

    return intrinsic(blocks)


_GRAD_BLOCKS = {rows: _make_grad_blocks(rows) for rows in (1, 2)}
_grad_blocks, _grad_blocks_pair = _GRAD_BLOCKS[1], _GRAD_BLOCKS[2]
_grad_half = _make_grad_blocks(size=HALF)


@njit(inline="always")
def _grad_edges(dyr, xr, w, dxr, dwc, dbc, a, s, i0, i1, da, ds):
    """The elements [i0, i1) of a row one at a time (a row's head or tail); da and ds plus their terms."""
    for i in range(i0, i1):
        vx, v = _grad_element(dyr, xr, w, dxr, dwc, dbc, a, s, i)
        da += vx
        ds += v
    return da, ds


@njit(inline="always")
def _grad_tail(dxr, i0, d, dyr, xr, w, dwc, dbc, stage, a, s, stream, table, use, far, skip, da, ds):
    """The elements [i0, d) of a row: a half block where 32-63 are left, then one at a time."""
    if d - i0 >= HALF:
        ha, hs = _grad_half(dxr, i0, i0 + HALF, dyr, xr, w, dwc, dbc, stage, a, s, stream, table, use, far,
                            skip)
        da, ds = da + ha, ds + hs
        i0 += HALF
    return _grad_edges(dyr, xr, w, dxr, dwc, dbc, a, s, i0, d, da, ds)


@kernel
def pointwise_bwd(dy, x, a, s, w, dx, da_sum, dw_sum, db_sum, stages, stream, table, far, skip):
    """The gradients of pointwise_fwd: dx stored, and per chunk da_sum[c] = (da, ds), dw_sum[c],
    db_sum[c]."""
    dy, x, w, dx = at(dy), at(x), at(w), at(dx)
    n, d = x.shape
    a32 = np.float32(a)
    nchunks = stages.shape[0]
    parts = partial_row_pairs(nchunks, d)
    pairs = d >= (DYT_PAIRS_MIN_16 if x.itemsize == 2 else DYT_PAIRS_MIN_32)
    use = table.shape[0] > 0
    if use:
        for c in prange(nchunks):
            _fill_table(_fill_ts, table, x, a32, s, c, nchunks)
    for c in prange(nchunks):
        r0, r1 = chunk_span(c, nchunks, n)
        dwc, dbc, stage = parts[2 * c], parts[2 * c + 1], stages[c]
        paired_to = r0 + (r1 - r0) // 2 * 2 if pairs else r0  # rows [r0, paired_to) go in pairs
        da, ds = 0.0, 0.0
        for r in range(r0, r1):
            dyr, xr, dxr = row_of(dy, r), row_of(x, r), row_of(dx, r)
            head, body = block_spans(dxr, 0, d, stream)
            partner = r + 1 if (r - r0) % 2 == 0 else r - 1
            # (streamed rows: alike)
            in_pair = r < paired_to and block_spans(row_of(dx, partner), 0, d, stream) == (head, body)
            if not in_pair:
                da, ds = _grad_edges(dyr, xr, w, dxr, dwc, dbc, a32, s, 0, head, da, ds)
                ba, bs = _grad_blocks(dxr, head, body, dyr, xr, w, dwc, dbc, stage, a32, s, stream, table,
                                      use, far, skip)
                da, ds = da + ba, ds + bs
                da, ds = _grad_tail(dxr, body, d, dyr, xr, w, dwc, dbc, stage, a32, s, stream, table,
                                    use, far, skip, da, ds)
            elif partner > r:  # this row and the next, in the order two single rows go (same bits)
                dyr2, xr2, dxr2 = dy[partner], x[partner], dx[partner]
                da, ds = _grad_edges(dyr, xr, w, dxr, dwc, dbc, a32, s, 0, head, da, ds)
                da1, da2, ds1, ds2 = _grad_blocks_pair(dxr, head, body, dyr, xr, w, dwc, dbc, stage, a32, s,
                                                       stream, table, use,
                                                       dxr2, dyr2, xr2, far, skip)
                da, ds = da + da1, ds + ds1
                da, ds = _grad_tail(dxr, body, d, dyr, xr, w, dwc, dbc, stage, a32, s, stream, table,
                                    use, far, skip, da, ds)
                da, ds = _grad_edges(dyr2, xr2, w, dxr2, dwc, dbc, a32, s, 0, head, da, ds)
                da, ds = da + da2, ds + ds2
                da, ds = _grad_tail(dxr2, body, d, dyr2, xr2, w, dwc, dbc, stage, a32, s, stream, table,
                                    use, far, skip, da, ds)
            # (else: the second row of a pair, done with the first)
            if (r - r0) % FLUSH == FLUSH - 1:
                flush_into(dwc, dw_sum[c])
                flush_into(dbc, db_sum[c])
        flush_into(dwc, dw_sum[c])
        flush_into(dbc, db_sum[c])
        if stream:
            store_fence()
        da_sum[c, 0] = 4.0 * da  # the terms came as quarters (_grad)
        da_sum[c, 1] = 4.0 * ds
