"""RMSNorm on CPU, fused: the forward, the residual-add forward, and the backward.

Forward, per row of d features (the statistic over the first k; k < d is partial RMSNorm):

    rstd = 1 / sqrt(mean(x[:k]^2) + eps)      (eps inside the root; outside: 1 / (rms + eps))
    y    = x * rstd * w                       (gemma order, in float32; w = offset + weight)
    y    = round(x * rstd) * w                (llama order: x * rstd rounded to y's dtype first,
                                               w rounded to it by the launcher)
    add variant: s = round(x + residual), stored, and y = rms_norm(s)

Backward, with g = dy * w (for the features past k only the first term applies):

    dx = rstd * g - coef * x,   coef = rstd^3 * sum(g * x) / k          (eps inside)
                                coef = rstd^2 / rms * sum(g * x) / k    (eps outside)
    dw = sum over rows of dy * xhat,   xhat = x * rstd (rounded as in the forward)

Sums are float32 over blocks of BLOCK values (then of TAIL and HALF, in the vector passes) added in
float64. Each output is written by scalar element helpers at a row's head and tail and by
16-lane vector blocks in between; the two forms of each formula sit side by side below and do
the same operations in the same order.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange
from numba.extending import overload

from .cache import kernel
from .codecs import load_at, pair_order, round_like, store_at
from .rows import (FLUSH, ROW_GROUP, all_finite, at, chunk_span, flush_into, grad_nan_free,
                   grad_select_optional, grouped_rows, is_llama, nan_free, pair_registers, pair_types,
                   pairs_fit, reads_pairs, partial_rows, partial_sums, recip, row_of, row_pairs, block_spans,
                   select_optional, sum_partials, sums_block, value_at, vector_sums, widened, writes_pairs)
from .simd import (BLOCK, EMIT, HALF, TAIL, fma_ir, fma32, narrow_bits, prefetch_pass1, prefetch_pass2,
                   row_sumsq, store_fence, widen_bits, backward_block, forward_block, grad_sums)

# ---------------------------------------------------------------------------------- forward
# ``stages``: one float32 staging row per chunk (their count is the chunk count; see simd.py).
# ``stream``: stream the outputs past the caches. ``far``: prefetch the next row into L2, not L1
# (memory.prefetch_far). ``skip``: how many rows past the next one the prefetches reach
# (memory.prefetch_skip). ``round_to``: a 1-element array whose dtype is where
# xhat is rounded (the output's in the llama order, float32 in the gemma order).
# The forwards' rows are rows.row_of (no reference counts); the backward's are x[r]: without
# them it ran slower in bf16 (docs/cpu-kernels.md, "Row views without references").


@kernel
def rms_fwd(x, w, y, rstd, eps, inside, k, round_to, stages, stream, far, skip):
    x, w, y, rstd = at(x), widened(at(w)), at(y), at(rstd)
    n, d = x.shape
    nchunks = stages.shape[0]
    w_pairs = pair_order(w, d - d % EMIT if writes_pairs(x, y) else 0)
    w_finite = writes_pairs(x, y) and k == d and all_finite(w)  # partial: values past k are in no statistic
    # short rows (rows.ROW_GROUP) in a parallel loop of their own: long rows keep the code they had
    if grouped_rows(x, d):
        ahead = skip + ROW_GROUP - 1  # prefetch the rows the next group reads
        for c in prange(nchunks):
            r0, r1 = chunk_span(c, nchunks, n)
            stage = stages[c]
            sums = np.empty(ROW_GROUP, np.float64)
            for g0 in range(r0, r1, ROW_GROUP):
                g1 = min(g0 + ROW_GROUP, r1)
                for r in range(g0, g1):
                    sums[r - g0] = _sumsq(row_of(x, r), None, None, row_of(x, r + ahead), None, k, far)
                for r in range(g0, g1):
                    rstd[r] = _rms_scale(sums[r - g0], k, eps, inside)
                for r in range(g0, g1):
                    row_rstd = rstd[r]
                    _rms_write(row_of(x, r), w, w_pairs, row_of(y, r), row_rstd, round_to, stage, stream, far,
                               row_of(x, r + ahead), None, nan_free(w_finite, row_rstd, 0.0))
            if stream:
                store_fence()
    else:
        for c in prange(nchunks):
            r0, r1 = chunk_span(c, nchunks, n)
            stage = stages[c]
            for r in range(r0, r1):
                xr, px = row_of(x, r), row_of(x, r + skip)  # px: the row whose successor is prefetched
                row_rstd = _rms_scale(_sumsq(xr, None, None, px, None, k, far), k, eps, inside)
                rstd[r] = row_rstd
                _rms_write(xr, w, w_pairs, row_of(y, r), row_rstd, round_to, stage, stream, far, px, None,
                           nan_free(w_finite, row_rstd, 0.0))
            if stream:
                store_fence()


@kernel
def add_rms_fwd(x, res, w, y, s, rstd, eps, inside, k, round_to, stages, stream, far, skip):
    x, res, w, y, s, rstd = at(x), at(res), widened(at(w)), at(y), at(s), at(rstd)
    n, d = x.shape
    nchunks = stages.shape[0]
    w_pairs = pair_order(w, d - d % EMIT if writes_pairs(s, y) else 0)
    w_finite = writes_pairs(s, y) and k == d and all_finite(w)
    for c in prange(nchunks):
        r0, r1 = chunk_span(c, nchunks, n)
        stage = stages[c]
        for r in range(r0, r1):
            xr, rr, sr = row_of(x, r), row_of(res, r), row_of(s, r)
            px, pr = row_of(x, r + skip), row_of(res, r + skip)
            # s is an output too, but the second pass reads it back: plain stores keep it cached
            row_rstd = _rms_scale(_sumsq(xr, rr, sr, px, pr, k, far), k, eps, inside)
            rstd[r] = row_rstd
            _rms_write(sr, w, w_pairs, row_of(y, r), row_rstd, round_to, stage, stream, far, px, pr,
                       nan_free(w_finite, row_rstd, 0.0))
        if stream:
            store_fence()


@njit(inline="always")
def _sumsq(xr, rr, sr, px, pr, k, far):
    """Sum of the row's squares over [:k] (forming the whole residual sum when rr is given),
    prefetching from the rows after px and pr."""
    if rr is None and vector_sums(xr):
        full = k - k % HALF
        total = row_sumsq(xr, full, np.float32(0.0), px, None, far)[0]
    else:
        full = k - k % BLOCK
        total = 0.0
        for j in range(0, full, BLOCK):
            prefetch_pass1(px, pr, j, far)
            part = np.float32(0.0)
            for i in range(j, j + BLOCK):
                v = value_at(xr, rr, sr, i)
                part += v * v
            total += part
    part = np.float32(0.0)
    for i in range(full, k):
        v = value_at(xr, rr, sr, i)
        part += v * v
    if rr is not None:
        for i in range(k, xr.shape[0]):  # past the statistic: the sum is still formed
            value_at(xr, rr, sr, i)
    return total + part


@njit
def _rms_scale(ss, k, eps, inside):
    ms = ss / k
    if inside:
        return recip(math.sqrt(ms + eps))
    return recip(math.sqrt(ms) + eps)


@njit(inline="always")
def _rms_write(xr, w, w_pairs, yr, row_rstd, round_to, stage, stream, far, ahead1, ahead2, finite):
    """The row's outputs; ahead1 and ahead2 are the inputs whose next rows pass 2 prefetches.
    With writes_pairs and the row's blocks starting at 0, they go in pairs (w_pairs: w in
    pair_order over the whole blocks), rounded without the nan select where the row is
    ``finite`` (rows.nan_free)."""
    d = yr.shape[0]
    a, b = block_spans(yr, 0, d, stream)
    for i in range(a):
        _rms_y(xr, w, yr, row_rstd, round_to, i)
    c = a
    if a == 0 and writes_pairs(xr, yr):
        c = b
        if finite:  # a loop each: choosing per block made LLVM slow the paired loop (docs/cpu-kernels.md)
            for j in range(0, b, EMIT):
                prefetch_pass2(ahead1, ahead2, j, 1, far)
                _y_block(yr, j, xr, w_pairs, stage, row_rstd, stream, round_to, True, True, EMIT)
        else:
            for j in range(0, b, EMIT):
                prefetch_pass2(ahead1, ahead2, j, 1, far)
                _y_block(yr, j, xr, w_pairs, stage, row_rstd, stream, round_to, True, False, EMIT)
    for j in range(c, b, EMIT):
        prefetch_pass2(ahead1, ahead2, j, 1, far)
        _y_block(yr, j, xr, w, stage, row_rstd, stream, round_to, False, False, EMIT)
    if d - b >= HALF:  # in pair_order w is in place past the whole blocks: plain order serves
        _y_block(yr, b, xr, w, stage, row_rstd, stream, round_to, False, False, HALF)
        b += HALF
    for i in range(b, d):
        _rms_y(xr, w, yr, row_rstd, round_to, i)


@njit
def _rms_y(xr, w, yr, row_rstd, round_to, i):
    store_at(yr, i, round_like(round_to, load_at(xr, i) * row_rstd) * load_at(w, i))


def _y_vector(llama):
    """_rms_y on 16 lanes (the llama order's rounding and weight come as the block is stored)."""

    def y(builder, x, w, b, mhi, mlo, row_rstd):
        t = builder.fmul(x, row_rstd)
        return t if llama else builder.fmul(t, w())

    return y


_Y_BLOCK = {(llama, stream, paired, finite, size): forward_block(_y_vector(llama), llama, stream,
                                                                 paired=paired, finite=finite, size=size)
            for llama in (False, True) for stream in (False, True)
            for paired, finite, size in ((False, False, EMIT), (True, False, EMIT), (True, True, EMIT),
                                         (False, False, HALF))}


# replaced by the overload below
def _y_block(y, j, x, w, stage, row_rstd, stream, round_to, paired, finite, size):  # pragma: no cover
    """The output block y[j:j + size] (simd.forward_block; ``paired`` and ``finite`` literal
    bools: x and y in bf16 pairs, w in pair_order; no nan select; ``size`` EMIT or HALF, the
    latter in order only)."""
    raise NotImplementedError


@overload(_y_block, prefer_literal=True)
def _ov_y_block(y, j, x, w, stage, row_rstd, stream, round_to, paired, finite, size):
    pairs = paired.literal_value
    if pairs and not pairs_fit(x, y):
        # not called: writes_pairs is False
        return lambda y, j, x, w, stage, row_rstd, stream, round_to, paired, finite, size: None
    plain, streamed = (_Y_BLOCK[is_llama(round_to), t, pairs, finite.literal_value, size.literal_value]
                       for t in (False, True))

    def block(y, j, x, w, stage, row_rstd, stream, round_to, paired, finite, size):
        z = np.float32(0.0)
        if stream:
            streamed(y, np.uint64(j), x, w, w, stage, z, z, row_rstd)
        else:
            plain(y, np.uint64(j), x, w, w, stage, z, z, row_rstd)

    return block


# --------------------------------------------------------------------------------- backward
# Pass 1 forms sum(g * x) (and sum(x^2) over [:k] when eps is outside the root) and adds the row's
# dw terms to its chunk's float32 partial row, flushed to a float64 row every FLUSH rows; pass 2
# writes dx. The float64 rows are summed in chunk order at the end. bf16 rows take pass 1 as
# vectors (grad_sums), read in pair order, and in pairs of rows from PAIR_ROWS_MIN features on
# (rows.py). ``ds``: the gradient flowing into the residual sum (add variants), added to dx, or None.


@kernel
def rms_bwd(dy, x, w, rstd, ds, dx, dw, eps, inside, k, round_to, stages, stream, far, skip):
    dy, x, w, rstd, ds, dx, dw = at(dy), at(x), widened(at(w)), at(rstd), at(ds), at(dx), at(dw)
    n, d = x.shape
    nchunks = stages.shape[0]
    span = k - k % HALF if reads_pairs(x, dy) else 0
    w_pairs = pair_order(w, span)
    dw_part = partial_rows(nchunks, d)
    dw_sum = partial_sums(nchunks, d)
    pairs = row_pairs(x, dy, k, pair_registers(round_to, inside))
    for c in prange(nchunks):
        r0, r1 = chunk_span(c, nchunks, n)
        dwc = dw_part[c]
        stage = stages[c]
        paired_to = r0 + (r1 - r0) // 2 * 2 if pairs else r0  # rows [r0, paired_to) go in pairs
        gx2, ss2 = 0.0, 0.0
        for r in range(r0, r1):
            dyr, xr, dxr, dsr = dy[r], x[r], dx[r], row_of(ds, r)
            pdy, px = row_of(dy, r + skip), row_of(x, r + skip)  # the rows whose successors are prefetched
            row_rstd = rstd[r]
            ahead = 1 if r >= paired_to else 2  # rows ahead that pass 2 prefetches
            if ahead == 1:
                gx, ss = _dot_gx(dyr, w, w_pairs, xr, k, dwc, row_rstd, round_to, not inside, far, pdy, px,
                                 skip)
            elif (r - r0) % 2 == 0:  # pass 1 of this row and the next
                gx, ss, gx2, ss2 = _dot_gx_pair(dyr, xr, dy[r + 1], x[r + 1], w, w_pairs, k, dwc, row_rstd,
                                                rstd[r + 1], round_to, not inside, far, skip)
            else:
                gx, ss = gx2, ss2
            coef = _rms_coef(row_rstd, gx, ss, k, inside)
            finite = grad_select_optional(x, dy, ds) and grad_nan_free(row_rstd, gx, 0.0, coef, 0.0)
            _rms_bwd_write(dyr, xr, w, w_pairs, dsr, dxr, row_rstd, coef, 0, k, True, stage, stream, ahead,
                           finite, far, pdy, px)
            if k < d:  # pRMSNorm: the features past the statistic
                _rms_bwd_write(dyr, xr, w, w_pairs, dsr, dxr, row_rstd, coef, k, d, False, stage, stream,
                               ahead, False, far, pdy, px)
            if (r - r0) % FLUSH == FLUSH - 1:
                flush_into(dwc, dw_sum[c])
        flush_into(dwc, dw_sum[c])
        if stream:
            store_fence()
    sum_partials(dw_sum, span, dw)


# ------------------------------------------------------------------------- backward, pass 1


@njit(inline="always")
def _dot_gx(dyr, w, w_pairs, xr, k, dwc, row_rstd, round_to, squares, far, pdy, px, skip):
    """(sum over the row of g * x, sum of x^2 over [:k] or, without ``squares``, any value),
    adding the row's dw terms to dwc. ``w_pairs``: w in pair_order over the whole blocks of [:k].
    Prefetches from the rows after pdy and px (``skip`` rows past the next: memory.prefetch_skip)."""
    full = k - k % sums_block(xr, dyr, BLOCK)
    tgx, tss = _rms_blocks(dyr, w, w_pairs, xr, full, dwc, row_rstd, round_to, squares, far, pdy, px, skip)
    pgx, pss = _rms_tail(dyr, w, xr, full, k, dwc, row_rstd, round_to)
    return tgx + pgx, tss + pss


@njit
def _rms_dw(dyr, xr, dwc, row_rstd, round_to, i):
    """Add element i's dw term to dwc; returns x[i]."""
    xv = load_at(xr, i)
    dwc[np.uint64(i)] = fma32(load_at(dyr, i), round_like(round_to, xv * row_rstd), dwc[np.uint64(i)])
    return xv


def _grad_terms(llama, squares):
    """_rms_blocks_loop's element on 16 lanes, for simd.grad_sums: s0 += g * x, s1 += x * x,
    and xhat for the dw term."""

    def terms(builder, x, dy, w, c, s0, s1, a, rnd_kind, hw):
        g = builder.fmul(dy, w)
        s0[a] = fma_ir(builder, g, x, s0[a])
        if squares:
            s1[a] = fma_ir(builder, x, x, s1[a])
        xh = builder.fmul(x, c[0])
        if llama:
            xh = widen_bits(builder, narrow_bits(builder, xh, rnd_kind, hw), rnd_kind)
        return xh

    return terms


_GRAD_SUMS = {
    (llama, squares, rows): grad_sums(_grad_terms(llama, squares), rows)
    for llama in (False, True) for squares in (False, True) for rows in (1, 2)
}


@njit(inline="always")
def _rms_blocks_loop(dyr, w, xr, full, dwc, row_rstd, round_to, far, pdy, px):
    """_dot_gx's whole blocks as element loops (LLVM vectorizes them)."""
    tgx = 0.0
    tss = 0.0
    for j in range(0, full, BLOCK):
        prefetch_pass1(px, pdy, j, far)
        pgx = np.float32(0.0)
        pss = np.float32(0.0)
        for i in range(j, j + BLOCK):
            xv = _rms_dw(dyr, xr, dwc, row_rstd, round_to, i)
            pgx += (load_at(dyr, i) * load_at(w, i)) * xv
            pss += xv * xv
        tgx += pgx
        tss += pss
    return tgx, tss


# replaced by the overload below
def _rms_blocks(dyr, w, w_pairs, xr, full, dwc, row_rstd, round_to, squares, far, pdy, px,
                skip):  # pragma: no cover
    """_dot_gx over the whole blocks [0, full): the vector pass for bf16 rows, else the element
    loops. Picked when numba types the call, so each kernel compiles one of them."""
    raise NotImplementedError


@overload(_rms_blocks, inline="always")
def _ov_rms_blocks(dyr, w, w_pairs, xr, full, dwc, row_rstd, round_to, squares, far, pdy, px, skip):
    if not pair_types(xr, dyr):
        return lambda dyr, w, w_pairs, xr, full, dwc, row_rstd, round_to, squares, far, pdy, px, skip: (
            _rms_blocks_loop(dyr, w, xr, full, dwc, row_rstd, round_to, far, pdy, px))
    with_squares, without = (_GRAD_SUMS[is_llama(round_to), s, 1] for s in (True, False))

    def blocks(dyr, w, w_pairs, xr, full, dwc, row_rstd, round_to, squares, far, pdy, px, skip):
        z = np.float32(0.0)
        if squares:
            return with_squares(dyr, xr, w_pairs, dwc, round_to, full, row_rstd, z, z, skip, far)
        return without(dyr, xr, w_pairs, dwc, round_to, full, row_rstd, z, z, skip, far)

    return blocks


@njit(inline="always")
def _rms_tail(dyr, w, xr, full, k, dwc, row_rstd, round_to):
    """_dot_gx past the whole blocks: [full, k), then [k, d) (pRMSNorm: g * x only)."""
    pgx = np.float32(0.0)
    pss = np.float32(0.0)
    for i in range(full, k):
        xv = _rms_dw(dyr, xr, dwc, row_rstd, round_to, i)
        pgx += (load_at(dyr, i) * load_at(w, i)) * xv
        pss += xv * xv
    for i in range(k, xr.shape[0]):
        pgx += (load_at(dyr, i) * load_at(w, i)) * _rms_dw(dyr, xr, dwc, row_rstd, round_to, i)
    return pgx, pss


# the overload below
def _dot_gx_pair(dyr, xr, dyr2, xr2, w, w_pairs, k, dwc, row_rstd, row_rstd2, round_to, squares,
                 far, skip):  # pragma: no cover
    """_dot_gx of two bf16 rows, their whole blocks in one pass (grad_sums, rows=2): (gx, ss) of
    the first row, then of the second; the bits of two _dot_gx calls. Other dtypes compile a
    stub (row_pairs is False for them), which saves compile time."""
    raise NotImplementedError


@overload(_dot_gx_pair, inline="always")
def _ov_dot_gx_pair(dyr, xr, dyr2, xr2, w, w_pairs, k, dwc, row_rstd, row_rstd2, round_to, squares, far,
                    skip):
    if not pair_types(xr, dyr):
        return lambda dyr, xr, dyr2, xr2, w, w_pairs, k, dwc, row_rstd, row_rstd2, round_to, squares, far, \
            skip: (0.0, 0.0, 0.0, 0.0)
    with_squares, without = (_GRAD_SUMS[is_llama(round_to), s, 2] for s in (True, False))

    def pair(dyr, xr, dyr2, xr2, w, w_pairs, k, dwc, row_rstd, row_rstd2, round_to, squares, far, skip):
        full = k - k % HALF
        z = np.float32(0.0)
        if squares:
            tgx, tss, tgx2, tss2 = with_squares(dyr, xr, dyr2, xr2, w_pairs, dwc, round_to, full, row_rstd, z,
                                                z, row_rstd2, z, z, skip, far)
        else:
            tgx, tss, tgx2, tss2 = without(dyr, xr, dyr2, xr2, w_pairs, dwc, round_to, full, row_rstd, z, z,
                                           row_rstd2, z, z, skip, far)
        pgx, pss = _rms_tail(dyr, w, xr, full, k, dwc, row_rstd, round_to)
        pgx2, pss2 = _rms_tail(dyr2, w, xr2, full, k, dwc, row_rstd2, round_to)
        return tgx + pgx, tss + pss, tgx2 + pgx2, tss2 + pss2

    return pair


@njit
def _rms_coef(row_rstd, gx, ss, k, inside):
    # d rstd / d ms: inside -rstd^3 / 2; outside -rstd^2 / (2 sqrt(ms)). The sum of g * x runs
    # over all d features (every one is scaled by rstd); only ms is over the first k.
    r = np.float64(row_rstd)
    if inside:
        return np.float32(r * r * r * gx / k)
    rms = math.sqrt(ss / k)
    return np.float32(r * r / rms * gx / k) if rms > 0.0 else np.float32(0.0)


# ------------------------------------------------------------------------- backward, pass 2


@njit(inline="always")
def _rms_bwd_write(dyr, xr, w, w_pairs, dsr, dxr, row_rstd, coef, i0, i1, head, stage, stream, ahead, finite,
                   far, pdy, px):
    """dx over [i0, i1) (``head``: inside the first k, where the coef term applies; there, with
    i0 = 0, the whole blocks of bf16 rows are read in pairs, rounded without the nan select
    where the row is ``finite``: rows.grad_nan_free)."""
    a, b = block_spans(dxr, i0, i1, stream)
    for i in range(i0, a):
        _rms_dx(dyr, xr, w, dsr, dxr, row_rstd, coef, i, head)
    c = a
    if head and a == 0 and reads_pairs(xr, dyr, dsr):
        c = i1 - i1 % TAIL
        if finite:  # a loop each, as in _rms_write
            for j in range(0, c, EMIT):
                prefetch_pass2(px, pdy, j, ahead, far)
                _dx_block("head/pairs/finite", dxr, j, dyr, xr, w_pairs, dsr, stage, coef, row_rstd, stream)
        else:
            for j in range(0, c, EMIT):
                prefetch_pass2(px, pdy, j, ahead, far)
                _dx_block("head/pairs", dxr, j, dyr, xr, w_pairs, dsr, stage, coef, row_rstd, stream)
    for j in range(c, b, EMIT):
        prefetch_pass2(px, pdy, j, ahead, far)
        if head:
            _dx_block("head", dxr, j, dyr, xr, w, dsr, stage, coef, row_rstd, stream)
        else:
            _dx_block("tail", dxr, j, dyr, xr, w, dsr, stage, coef, row_rstd, stream)
    if i1 - b >= HALF:
        if head:
            _dx_block("head/half", dxr, b, dyr, xr, w, dsr, stage, coef, row_rstd, stream)
        else:
            _dx_block("tail/half", dxr, b, dyr, xr, w, dsr, stage, coef, row_rstd, stream)
        b += HALF
    for i in range(b, i1):
        _rms_dx(dyr, xr, w, dsr, dxr, row_rstd, coef, i, head)


@njit
def _rms_dx(dyr, xr, w, dsr, out, row_rstd, coef, i, in_head):
    xv = load_at(xr, i)
    dyv = load_at(dyr, i)
    v = row_rstd * (dyv * load_at(w, i))
    if in_head:
        v = fma32(xv, -coef, v)
    if dsr is not None:
        v += load_at(dsr, i)
    store_at(out, i, v)


def _dx_vector(head):
    """_rms_dx on 16 lanes (p[0] is coef)."""

    def dx(builder, dy, x, w, p, row_rstd):
        t = builder.fmul(row_rstd, builder.fmul(dy, w))
        return fma_ir(builder, x, builder.fneg(p[0]), t) if head else t

    return dx


_DX_BLOCK = {
    (variant, stream): backward_block(_dx_vector(variant.startswith("head")), stream,
                                      paired="/pairs" in variant, reads_x=variant.startswith("head"),
                                      finite=variant.endswith("/finite"),
                                      size=HALF if variant.endswith("/half") else EMIT)
    for variant in ("head", "tail", "head/pairs", "head/pairs/finite", "head/half", "tail/half")
    for stream in (False, True)
}


# replaced by the overload below
def _dx_block(variant, dx, j, dy, x, w, ds, stage, coef, row_rstd, stream):  # pragma: no cover
    """The dx block at j (simd.backward_block). ``variant`` a string literal: "head" (inside
    the first k), "tail" (past it), "head/pairs" (bf16 rows read in pairs, w in pair_order),
    "head/pairs/finite" (the same without the nan select), or "head/half" and "tail/half" (HALF
    values, not EMIT)."""
    raise NotImplementedError


@overload(_dx_block, prefer_literal=True)
def _ov_dx_block(variant, dx, j, dy, x, w, ds, stage, coef, row_rstd, stream):
    name = variant.literal_value
    if ("/pairs" in name and not (pair_types(x, dy, ds) and dx.dtype == dy.dtype)
            or name.endswith("/finite") and not select_optional(x, dy, ds)):
        # not called: reads_pairs or grad_select_optional is False
        return lambda variant, dx, j, dy, x, w, ds, stage, coef, row_rstd, stream: None
    plain, streamed = (_DX_BLOCK[name, t] for t in (False, True))

    def block(variant, dx, j, dy, x, w, ds, stage, coef, row_rstd, stream):
        z = np.float32(0.0)
        if stream:
            streamed(dx, np.uint64(j), dy, x, w, ds, stage, coef, z, z, row_rstd)
        else:
            plain(dx, np.uint64(j), dy, x, w, ds, stage, coef, z, z, row_rstd)

    return block
