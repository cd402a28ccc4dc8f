"""DyT on CPU, fused: the forward and the backward (Zhu et al. 2025, "Transformers without
Normalization").

Forward, elementwise (no statistics: a is one learned scalar, w and b are per feature):

    y = w * tanh(a * x) + b

Backward, with t = tanh(a * x) and u = dy * w * (1 - t^2):

    dx = a * u
    da = sum over every element of u * x
    dw = sum over rows of dy * t,     db = sum over rows of dy

Each row is read once and written once, like a copy, but tanh costs some 30 vector operations
per 16 values, so the loops are compute-bound: they run as 16-lane vectors written out in LLVM
IR (simd.py's blocks), and the scalar heads and tails run the same IR on a vector's first lane,
so every element gets the same bits wherever it falls in its row. The sums are float64, one set
per chunk of rows, added in chunk order by the launcher: the same inputs and thread count give
the same bits. (da's terms are summed by output block, and with streaming stores the blocks
start at the first 64-byte boundary: a streamed call rounds da's sum in another order.)
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cache import kernel
from .codecs import _LANES, _load, _store
from .rows import FLUSH, _chunk, _flush, _partial_rows, _spans
from .simd import (_ZERO, EMIT, HW_BF16, X86, _add_blocks, _f32x16, _f64_totals, _fma, _fma32, _load_f32, _load_row,
                   _make_prefetch, _prefetch_ahead, _store_block, _store_fence, _totals, forward_block)

# ------------------------------------------------------------------------------------- tanh
# With e = exp(-2|z|) and m = e - 1 = expm1(-2|z|):
#
#     tanh z = sign(z) * -m / (1 + e)
#     1 - tanh^2 z = 4 h (1 - h),   h = e / (1 + e)       (no cancellation near +-1)
#
# m keeps small z accurate (1 - e would cancel), and the denominator comes from e rather than
# from 2 + m, so m's rounding is not doubled near saturation. Both come from one exponential:
# -2|z| = n ln2 + r with |r| <= ln2 / 2, q = expm1(r) = r + r^2 P(r) (P fitted on [-0.35, 0.35]),
# and with p = 2^n, m = p q + (p - 1) and e = p q + p, one fma each. tanh is within 2.1 ulp
# (float32's own: about 1) and 4h (1 - h) within 3e-7 of sech^2 (tests/test_dyt.py). |z| is
# capped at 10 to keep the reduction finite: t rounds to +-1 from |z| = 9.01 on, and the
# backward sets h to 0 from 10, so nothing flows back through a saturated element (and nothing
# subnormal is made). The IR works on 16-lane vectors with no fast-math flags; a scalar is a
# vector's first lane. Every operation counts: these loops run at the limit of the vector ports
# (docs/cpu-kernels.md, "DyT").

_CAP = 10.0
_EXPM1_POLY = (1.3857560697942972e-3, 8.367335423827171e-3, 4.16676327586174e-2, 0.16666537523269653, 0.4999999701976776)
_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 = HI + LO, n * HI exact for the n here
_F32 = ir.VectorType(ir.FloatType(), _LANES)
_I32 = ir.VectorType(ir.IntType(32), _LANES)
AVX512 = X86 and numba.config.CPU_NAME is None and bool(llvm.get_host_cpu_features().get("avx512f", False))


def _c(value, ty=_F32):
    """A vector constant (float32 values rounded to float32)."""
    return ir.Constant(ty, [float(np.float32(value)) if ty == _F32 else value] * _LANES)


def _llvm(builder, name, *args):
    """The LLVM intrinsic ``name`` (fabs, rint, copysign) on float32 vectors."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * len(args)), f"llvm.{name}.v16f32")
    return builder.call(fn, list(args))


def _pow2(builder, n, scalef=AVX512):
    """2^n for n a whole number in [-29, 0] or nan (then nan, or with the float32 bits, any
    value: tanh's nan comes through q anyway). ``scalef``: AVX-512's vscalefps, one operation."""
    if scalef:
        ty = ir.FunctionType(_F32, [_F32, _F32, _F32, ir.IntType(16), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, ty, "llvm.x86.avx512.mask.scalef.ps.512")
        return builder.call(fn, [_c(1.0), n, _c(0.0), ir.Constant(ir.IntType(16), -1), ir.Constant(ir.IntType(32), 4)])
    n = builder.select(builder.fcmp_ordered("ord", n, n), n, _c(0.0))  # fptosi of a nan would be poison
    return builder.bitcast(builder.shl(builder.add(builder.fptosi(n, _I32), _c(127, _I32)), _c(23, _I32)), _F32)


def _exps(builder, z):
    """(m, e, a) for 16 lanes: m = expm1(-2a), e = exp(-2a), a = min(|z|, 10). A nan stays nan."""
    az = _llvm(builder, "fabs", z)
    a = builder.select(builder.fcmp_ordered("<", _c(_CAP), az), _c(_CAP), az)  # min(10, |z|), nan kept
    x = builder.fmul(a, _c(-2.0))
    n = _llvm(builder, "rint", builder.fmul(x, _c(_LOG2E)))
    r = _fma(builder, n, _c(-_LN2_HI), x)
    r = _fma(builder, n, _c(-_LN2_LO), r)
    poly = _c(_EXPM1_POLY[0])
    for coef in _EXPM1_POLY[1:]:
        poly = _fma(builder, poly, r, _c(coef))
    q = _fma(builder, builder.fmul(r, r), poly, r)  # expm1(r)
    p = _pow2(builder, n)
    return _fma(builder, p, q, builder.fsub(p, _c(1.0))), _fma(builder, p, q, p), a


def _lane0(context, builder, signature, args, body):
    """A scalar intrinsic's codegen from a 16-lane one: the scalars splatted, ``body`` on the
    vectors, lane 0 of each result. The same instructions give the same bits as the blocks."""
    outs = body(builder, *(_f32x16(builder, a) for a in args))
    if not isinstance(outs, tuple):
        return builder.extract_element(outs, ir.Constant(ir.IntType(32), 0))
    lanes = [builder.extract_element(v, ir.Constant(ir.IntType(32), 0)) for v in outs]
    return context.make_tuple(builder, signature.return_type, lanes)


# ---------------------------------------------------------------------------------- forward


def _y(builder, x, w, b, a):
    """16 outputs: w * tanh(a x) + b."""
    z = builder.fmul(a, x)
    m, e, _ = _exps(builder, z)
    t = _llvm(builder, "copysign", builder.fdiv(m, builder.fadd(e, _c(1.0))), z)
    return _fma(builder, w, t, b)


@intrinsic
def _y_scalar(typingctx, x, w, b, a):
    def codegen(context, builder, signature, args):
        return _lane0(context, builder, signature, args, _y)

    f = types.float32
    return f(f, f, f, f), codegen


_y_block = forward_block(lambda builder, x, w, b, mhi, mlo, a: _y(builder, x, w(), b(), a), False, None)


# Each block prefetches the same block of the next row: with the hardware prefetcher alone the
# compute waited on memory (docs/cpu-kernels.md, "DyT"). The backward's blocks do the same.
_prefetch_next_row = _make_prefetch(EMIT)


@kernel
def dyt_fwd(x, a, w, b, y, stages, nt):
    n, d = x.shape
    a32 = np.float32(a)
    nchunks = stages.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        stage = stages[c]
        for r in range(r0, r1):
            xr, yr = x[r], y[r]
            head, body = _spans(yr, 0, d, nt)
            for i in range(head):
                _store(yr, i, _y_scalar(_load(xr, i), _load(w, i), _load(b, i), a32))
            for j in range(head, body, EMIT):
                _prefetch_next_row(xr, j)
                _y_block(yr, np.uint64(j), xr, w, b, stage, a32, a32, a32, nt)
            for i in range(body, d):
                _store(yr, i, _y_scalar(_load(xr, i), _load(w, i), _load(b, i), a32))
        if nt:
            _store_fence()


# --------------------------------------------------------------------------------- backward
# One pass: each element's dx is stored, its dw and db terms go to the chunk's float32 partial
# rows (added to its float64 rows dw_sum, db_sum: (nchunks, d) every FLUSH rows, as in the norms'
# backward, rows.py), and its da term to float32 lanes that each block of EMIT adds to float64
# lanes; da_sum (nchunks,) takes each chunk's da. Rows from these widths go two at a time, so
# each partial-row value (and w) is loaded and stored once per two rows; below them pairs were
# slower (docs/cpu-kernels.md, "DyT").
DYT_PAIRS_MIN_16 = 512  # bf16 and fp16 rows
DYT_PAIRS_MIN_32 = 2048  # float32 rows


def _grad(builder, g, x, w, a):
    """(dx, v * x, t) for 16 elements, v = u / 4 = g * w * h * (1 - h): the da term comes as a
    quarter (the kernel multiplies the sums by 4, exactly). t, which only dw uses, is m times
    1 / (1 + e), the division that h needs (the forward divides m itself: up to an ulp apart)."""
    z = builder.fmul(a, x)
    m, e, cap = _exps(builder, z)
    rden = builder.fdiv(_c(1.0), builder.fadd(e, _c(1.0)))  # (an estimate and a Newton step: no faster)
    t = _llvm(builder, "copysign", builder.fmul(m, rden), z)
    h = builder.select(builder.fcmp_ordered(">=", cap, _c(_CAP)), _c(0.0), builder.fmul(e, rden))
    v = builder.fmul(builder.fmul(g, w), _fma(builder, builder.fneg(h), h, h))  # h (1 - h) = h - h^2
    return builder.fmul(builder.fmul(a, _c(4.0)), v), builder.fmul(v, x), t


@intrinsic
def _grad_scalar(typingctx, g, x, w, a):
    def codegen(context, builder, signature, args):
        return _lane0(context, builder, signature, args, _grad)

    f = types.float32
    return types.UniTuple(f, 3)(f, f, f, f), codegen


@njit
def _grad_element(dyr, xr, w, dxr, dwc, dbc, a, i):
    """Element i's dx stored and its dw, db terms added; returns its da term (a quarter of it)."""
    g = _load(dyr, i)
    dx, ux, t = _grad_scalar(g, _load(xr, i), _load(w, i), a)
    _store(dxr, i, dx)
    j = np.uint64(i)  # unsigned: an affine address (see codecs.py)
    dwc[j] = _fma32(g, t, dwc[j])
    dbc[j] += g
    return np.float64(ux)


def _make_grad_blocks(rows=1, hw=HW_BF16):
    """An intrinsic (dx, j0, j1, dy, x, w, dwc, dbc, stage, a, nt) -> float64: the elements
    [j0, j1) of a row (j1 - j0 a multiple of EMIT) as _grad_element does each one, 16 at a time;
    returns the sum of their da terms (float32 within a block of EMIT, float64 lanes across
    blocks). ``nt``: dx's blocks are streamed (a run-time branch per block: the arithmetic is
    emitted once, which halves the compile time of two specialized copies).

    ``rows=2``: (dx, j0, j1, dy, x, w, dwc, dbc, stage, a, nt, dx2, dy2, x2) -> (float64,
    float64), the same for two rows at once, which loads and stores each partial-row value once
    for both. The second row's terms reach dwc and dbc after the first's, as two calls would add
    them, and each row's da sum is its own: the bits do not change."""

    def codegen(context, builder, signature, args):
        f32 = ir.VectorType(ir.FloatType(), _LANES)
        i64 = ir.IntType(64)
        rows_in = [(0, 3, 4), (11, 12, 13)][:rows]  # each row's (dx, dy, x) arguments
        data = {k: context.make_array(signature.args[k])(context, builder, args[k]).data for k in (5, 6, 7, 8, *sum(rows_in, ()))}
        zero = builder.gep(data[8], [ir.Constant(i64, _ZERO)])
        av = _f32x16(builder, args[9])
        totals = _f64_totals(builder, rows)
        count = builder.udiv(builder.sub(args[2], args[1]), ir.Constant(i64, EMIT))
        with cgutils.for_range(builder, count) as loop:
            at = builder.add(args[1], builder.mul(loop.index, ir.Constant(i64, EMIT)))
            wb, dwb, dbb = (builder.gep(data[k], [at]) for k in (5, 6, 7))
            for row in rows_in:
                for k in row[1:]:
                    _prefetch_ahead(context, builder, signature.args[k], args[k], at, EMIT, rows)
            values, terms = [[] for _ in rows_in], [[] for _ in rows_in]
            for v in range(EMIT // _LANES):
                w = _load_f32(builder, wb, v)
                dwp, dbp = (builder.bitcast(builder.gep(base, [ir.Constant(i64, v * _LANES)]), f32.as_pointer()) for base in (dwb, dbb))
                dw, db = builder.load(dwp, align=4), builder.load(dbp, align=4)
                for r, (kdx, kdy, kx) in enumerate(rows_in):
                    g = _load_row(builder, builder.gep(data[kdy], [at]), v, signature.args[kdy].dtype)
                    x = _load_row(builder, builder.gep(data[kx], [at]), v, signature.args[kx].dtype)
                    dxv, ux, t = _grad(builder, g, x, w, av)
                    values[r].append(dxv)
                    terms[r].append(ux)
                    dw, db = _fma(builder, g, t, dw), builder.fadd(db, g)
                builder.store(dw, dwp, align=4)
                builder.store(db, dbp, align=4)
            with builder.if_else(args[10]) as (streamed, plain):
                for nt, branch in ((True, streamed), (False, plain)):
                    with branch:
                        for r, (kdx, _, _) in enumerate(rows_in):
                            base = builder.gep(data[kdx], [at])
                            _store_block(builder, signature.args[kdx].dtype, base, wb, values[r], False, nt, hw, zero)
            _add_blocks(builder, terms, totals)
        sums = _totals(builder, totals)
        return sums[0] if rows == 1 else context.make_tuple(builder, signature.return_type, sums)

    f, b = types.float32, types.boolean
    if rows == 1:
        def blocks(typingctx, dx, j0, j1, dy, x, w, dwc, dbc, stage, a, nt):
            return types.float64(dx, types.int64, types.int64, dy, x, w, dwc, dbc, stage, f, b), codegen
    else:
        def blocks(typingctx, dx, j0, j1, dy, x, w, dwc, dbc, stage, a, nt, dx2, dy2, x2):
            return types.UniTuple(types.float64, 2)(dx, types.int64, types.int64, dy, x, w, dwc, dbc, stage, f, b, dx2, dy2, x2), codegen

    return intrinsic(blocks)


_GRAD_BLOCKS = {rows: _make_grad_blocks(rows) for rows in (1, 2)}
_grad_blocks, _grad_blocks_pair = _GRAD_BLOCKS[1], _GRAD_BLOCKS[2]


@njit(inline="always")
def _grad_edges(dyr, xr, w, dxr, dwc, dbc, a, i0, i1, da):
    """The elements [i0, i1) of a row one at a time (a row's head or tail); da plus their terms."""
    for i in range(i0, i1):
        da += _grad_element(dyr, xr, w, dxr, dwc, dbc, a, i)
    return da


@kernel
def dyt_bwd(dy, x, a, w, dx, da_sum, dw_sum, db_sum, stages, nt):
    n, d = x.shape
    a32 = np.float32(a)
    nchunks = stages.shape[0]
    dw_part = _partial_rows(nchunks, d)
    db_part = _partial_rows(nchunks, d)
    pairs = d >= (DYT_PAIRS_MIN_16 if x.itemsize == 2 else DYT_PAIRS_MIN_32)
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        dwc, dbc, stage = dw_part[c], db_part[c], stages[c]
        paired_to = r0 + (r1 - r0) // 2 * 2 if pairs else r0  # rows [r0, paired_to) go in pairs
        da = 0.0
        for r in range(r0, r1):
            dyr, xr, dxr = dy[r], x[r], dx[r]
            head, body = _spans(dxr, 0, d, nt)
            partner = r + 1 if (r - r0) % 2 == 0 else r - 1
            in_pair = r < paired_to and _spans(dx[partner], 0, d, nt) == (head, body)  # (streamed rows: alike)
            if not in_pair:
                da = _grad_edges(dyr, xr, w, dxr, dwc, dbc, a32, 0, head, da)
                da += _grad_blocks(dxr, head, body, dyr, xr, w, dwc, dbc, stage, a32, nt)
                da = _grad_edges(dyr, xr, w, dxr, dwc, dbc, a32, body, d, da)
            elif partner > r:  # this row and the next, in the order two single rows go (same bits)
                dyr2, xr2, dxr2 = dy[partner], x[partner], dx[partner]
                da = _grad_edges(dyr, xr, w, dxr, dwc, dbc, a32, 0, head, da)
                da1, da2 = _grad_blocks_pair(dxr, head, body, dyr, xr, w, dwc, dbc, stage, a32, nt, dxr2, dyr2, xr2)
                da += da1
                da = _grad_edges(dyr, xr, w, dxr, dwc, dbc, a32, body, d, da)
                da = _grad_edges(dyr2, xr2, w, dxr2, dwc, dbc, a32, 0, head, da)
                da += da2
                da = _grad_edges(dyr2, xr2, w, dxr2, dwc, dbc, a32, body, d, da)
            # (else: the second row of a pair, done with the first)
            if (r - r0) % FLUSH == FLUSH - 1:
                _flush(dwc, dw_sum[c])
                _flush(dbc, db_sum[c])
        _flush(dwc, dw_sum[c])
        _flush(dbc, db_sum[c])
        if nt:
            _store_fence()
        da_sum[c] = 4.0 * da  # the terms came as quarters (_grad)
