"""LayerNorm's backward on CPU, fused (layernorm.py has the forward and the formulas).

With g = dy * w and xhat = (x - mean) * rstd:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,   db = sum over rows of dy

As in the forward, the float64 mean enters as float32 mhi + mlo, and each dx is written by a
scalar element helper at a row's head and tail and by 16-lane vector blocks in between, the two
forms side by side doing the same operations in the same order.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .cache import kernel
from .codecs import add_at, load_at, pair_order, store_at
from .layernorm import split_mean
from .rows import (FLUSH, at, block_spans, chunk_span, flush_into, grad_nan_free, grad_select_optional,
                   pair_registers, pair_types, partial_row_pairs, partial_sums, reads_pairs, row_of,
                   row_pairs, select_optional, sum_partials, sums_block)
from .simd import (EMIT, HALF, TAIL, backward_block, fma_ir, fma32, grad_sums, prefetch_pass1, prefetch_pass2,
                   store_fence)

# ----------------------------------------------------------------------------------- kernel
# Pass 1 forms sum(g) and sum(g * xhat) and adds the row's dw and db terms to its chunk's float32
# partial rows, flushed to float64 rows every FLUSH rows; pass 2 writes dx. The float64 rows are
# summed in chunk order at the end. bf16 rows take pass 1 as vectors (grad_sums), read in pair
# order, and in pairs of rows from PAIR_ROWS_MIN features on (rows.py). ``ds``: the gradient
# flowing into the residual sum, added to dx, or None.


@kernel
def ln_bwd(dy, x, w, mean, rstd, ds, dx, dw, db, stages, stream, far, skip):
    dy, x, w, mean, rstd, ds = at(dy), at(x), at(w), at(mean), at(rstd), at(ds)
    dx, dw, db = at(dx), at(dw), at(db)
    n, d = x.shape
    nchunks = stages.shape[0]
    span = d - d % HALF if reads_pairs(x, dy) else 0
    w_pairs = pair_order(w, span)
    parts = partial_row_pairs(nchunks, d)
    dw_sum = partial_sums(nchunks, d)
    db_sum = partial_sums(nchunks, d)
    pairs = row_pairs(x, dy, d, pair_registers(None, False))
    for c in prange(nchunks):
        r0, r1 = chunk_span(c, nchunks, n)
        dwc, dbc = parts[2 * c], parts[2 * c + 1]
        stage = stages[c]
        paired_to = r0 + (r1 - r0) // 2 * 2 if pairs else r0  # rows [r0, paired_to) go in pairs
        sg2, sgx2 = 0.0, 0.0
        for r in range(r0, r1):
            dyr, xr = row_of(dy, r), row_of(x, r)
            pdy, px = row_of(dy, r + skip), row_of(x, r + skip)  # the rows whose successors are prefetched
            mu, row_rstd = mean[r], rstd[r]
            ahead = 1 if r >= paired_to else 2  # rows ahead that pass 2 prefetches
            if ahead == 1:
                sg, sgx = _ln_sums(dyr, w, w_pairs, xr, mu, row_rstd, dwc, dbc, far, pdy, px, skip)
            elif (r - r0) % 2 == 0:  # pass 1 of this row and the next
                sg, sgx, sg2, sgx2 = _ln_sums_pair(dyr, xr, row_of(dy, r + 1), row_of(x, r + 1), w, w_pairs,
                                                   mu, row_rstd, mean[r + 1], rstd[r + 1], dwc, dbc, far,
                                                   skip)
            else:
                sg, sgx = sg2, sgx2
            _ln_bwd_write(dyr, xr, w, w_pairs, row_of(ds, r), row_of(dx, r), mu, row_rstd, sg, sgx, stage,
                          stream, ahead, far, pdy, px)
            if (r - r0) % FLUSH == FLUSH - 1:
                flush_into(dwc, dw_sum[c])
                flush_into(dbc, db_sum[c])
        flush_into(dwc, dw_sum[c])
        flush_into(dbc, db_sum[c])
        if stream:
            store_fence()
    sum_partials(dw_sum, span, dw)
    sum_partials(db_sum, span, db)


# ------------------------------------------------------------------------- backward, pass 1


@njit(inline="always")
def _ln_sums(dyr, w, w_pairs, xr, mean, row_rstd, dwc, dbc, far, pdy, px, skip):
    """(sum of g, sum of g * xhat), adding the row's dw and db terms to dwc and dbc. ``w_pairs``: w
    in pair_order over the row's whole blocks (bf16 rows). Prefetches from the rows after pdy and
    px (``skip`` rows past the next: memory.prefetch_skip)."""
    mhi, lo = _ln_consts(mean, row_rstd)
    full = xr.shape[0] - xr.shape[0] % sums_block(xr, dyr, TAIL)
    tg, tgx = _ln_blocks(dyr, w, w_pairs, xr, full, mhi, row_rstd, lo, dwc, dbc, far, pdy, px, skip)
    if _half_in_lanes(xr, dyr) and xr.shape[0] - full >= HALF:
        # as a loop LLVM ran these 32 values one at a time (its vector loop takes 64 a turn)
        hg, hgx = _ONE_ROW_SUMS(dyr[full:], xr[full:], w[full:], dwc[full:], dbc[full:], HALF, mhi, row_rstd,
                                lo, 0, False)
        tg, tgx, full = tg + hg, tgx + hgx, full + HALF
    pg, pgx = _ln_tail(dyr, w, xr, full, mhi, row_rstd, lo, dwc, dbc)
    return tg + pg, tgx + pgx


def _half_in_lanes(xr, dyr):  # pragma: no cover - replaced by the overload below
    """Whether _ln_sums takes a row's last 32-63 values as one 16-lane HALF block: where no bf16
    row is read (the vector pass reads those in pairs, with w in pair order)."""
    raise NotImplementedError


@overload(_half_in_lanes)
def _ov_half_in_lanes(xr, dyr):
    lanes = types.uint16 not in (xr.dtype, dyr.dtype)
    return lambda xr, dyr: lanes


@njit(inline="always")
def _ln_consts(mean, row_rstd):
    """(mhi, lo) of _ln_dw: the mean's float32 head and -mlo * rstd."""
    mhi, mlo = split_mean(mean)
    return mhi, np.float32(-np.float64(mlo) * row_rstd)


@njit
def _ln_dw(dyr, xr, dwc, dbc, mhi, row_rstd, lo, i):
    """Add element i's dw and db terms to dwc and dbc; returns xhat[i], computed as
    fma(x - mhi, rstd, lo) with lo = -mlo * rstd (as exact as ((x - mhi) - mlo) * rstd, an
    operation fewer: 0 for a constant row)."""
    dyv = load_at(dyr, i)
    xh = fma32(load_at(xr, i) - mhi, row_rstd, lo)
    dwc[i] = fma32(dyv, xh, dwc[i])
    add_at(dbc, i, dyv)
    return xh


def _grad_terms(builder, x, dy, w, c, s0, s1, a, aux_kind, hw):
    """_ln_blocks_loop's element on 16 lanes, for simd.grad_sums (c = mhi, rstd, lo)."""
    mhi, row_rstd, lo = c
    g = builder.fmul(dy, w)
    s0[a] = builder.fadd(s0[a], g)
    xh = fma_ir(builder, builder.fsub(x, mhi), row_rstd, lo)
    s1[a] = fma_ir(builder, g, xh, s1[a])
    return xh


_GRAD_SUMS = {rows: grad_sums(_grad_terms, rows, with_db=True) for rows in (1, 2)}
_ONE_ROW_SUMS = _GRAD_SUMS[1]


@njit(inline="always")
def _ln_blocks_loop(dyr, w, xr, full, mhi, row_rstd, lo, dwc, dbc, far, pdy, px):
    """_ln_sums's whole blocks as element loops (LLVM vectorizes them), TAIL values a block as
    the vector pass's last blocks: rows of 64-128 features then take all of pass 1 in blocks, at
    2x the speed of the loop after them, and long rows lose nothing (docs/cpu-kernels.md, "Short
    rows")."""
    tg = 0.0
    tgx = 0.0
    for j in range(0, full, TAIL):
        prefetch_pass1(px, pdy, j, far)
        pg = np.float32(0.0)
        pgx = np.float32(0.0)
        for i in range(j, j + TAIL):
            g = load_at(dyr, i) * load_at(w, i)
            pg += g
            pgx += g * _ln_dw(dyr, xr, dwc, dbc, mhi, row_rstd, lo, i)
        tg += pg
        tgx += pgx
    return tg, tgx


# replaced by the overload below
def _ln_blocks(dyr, w, w_pairs, xr, full, mhi, row_rstd, lo, dwc, dbc, far, pdy, px,
               skip):  # pragma: no cover
    """_ln_sums over the whole blocks [0, full): the vector pass for bf16 rows, else the element
    loops. Picked when numba types the call, so each kernel compiles one of them."""
    raise NotImplementedError


@overload(_ln_blocks, inline="always")
def _ov_ln_blocks(dyr, w, w_pairs, xr, full, mhi, row_rstd, lo, dwc, dbc, far, pdy, px, skip):
    if not pair_types(xr, dyr):
        return lambda dyr, w, w_pairs, xr, full, mhi, row_rstd, lo, dwc, dbc, far, pdy, px, skip: (
            _ln_blocks_loop(dyr, w, xr, full, mhi, row_rstd, lo, dwc, dbc, far, pdy, px))
    sums = _GRAD_SUMS[1]
    return lambda dyr, w, w_pairs, xr, full, mhi, row_rstd, lo, dwc, dbc, far, pdy, px, skip: sums(
        dyr, xr, w_pairs, dwc, dbc, full, mhi, row_rstd, lo, skip, far
    )


@njit(inline="always")
def _ln_tail(dyr, w, xr, full, mhi, row_rstd, lo, dwc, dbc):
    """_ln_sums past the whole blocks."""
    pg = np.float32(0.0)
    pgx = np.float32(0.0)
    for i in range(full, xr.shape[0]):
        g = load_at(dyr, i) * load_at(w, i)
        pg += g
        pgx += g * _ln_dw(dyr, xr, dwc, dbc, mhi, row_rstd, lo, i)
    return pg, pgx


# the overload below
def _ln_sums_pair(dyr, xr, dyr2, xr2, w, w_pairs, mean, row_rstd, mean2, row_rstd2, dwc, dbc,
                  far, skip):  # pragma: no cover
    """_ln_sums of two bf16 rows, their whole blocks in one pass (grad_sums, rows=2): the sums of
    the first row, then of the second; the bits of two _ln_sums calls. A stub for other dtypes."""
    raise NotImplementedError


@overload(_ln_sums_pair, inline="always")
def _ov_ln_sums_pair(dyr, xr, dyr2, xr2, w, w_pairs, mean, row_rstd, mean2, row_rstd2, dwc, dbc, far, skip):
    if not pair_types(xr, dyr):
        return lambda dyr, xr, dyr2, xr2, w, w_pairs, mean, row_rstd, mean2, row_rstd2, dwc, dbc, far, skip: (
            0.0, 0.0, 0.0, 0.0)
    sums = _GRAD_SUMS[2]

    def pair(dyr, xr, dyr2, xr2, w, w_pairs, mean, row_rstd, mean2, row_rstd2, dwc, dbc, far, skip):
        mhi, lo = _ln_consts(mean, row_rstd)
        mhi2, lo2 = _ln_consts(mean2, row_rstd2)
        full = xr.shape[0] - xr.shape[0] % HALF
        tg, tgx, tg2, tgx2 = sums(dyr, xr, dyr2, xr2, w_pairs, dwc, dbc, full, mhi, row_rstd, lo, mhi2,
                                  row_rstd2, lo2, skip, far)
        pg, pgx = _ln_tail(dyr, w, xr, full, mhi, row_rstd, lo, dwc, dbc)
        pg2, pgx2 = _ln_tail(dyr2, w, xr2, full, mhi2, row_rstd2, lo2, dwc, dbc)
        return tg + pg, tgx + pgx, tg2 + pg2, tgx2 + pgx2

    return pair


# ------------------------------------------------------------------------- backward, pass 2


@njit(inline="always")
def _ln_bwd_write(dyr, xr, w, w_pairs, dsr, dxr, mean, row_rstd, sg, sgx, stage, stream, ahead, far, pdy, px):
    """dx of this row, with the terms that do not depend on g folded into one affine function of
    x - mhi: dx = rstd * g + p * (x - mhi) + q, p = -rstd^2 * mean(g * xhat), q = -rstd * mean(g)
    - p * mlo (from the float64 sums): two fmas per value. x - mhi is exact near the mean, and
    for a constant row it is 0 and so is p. Where rows.grad_select_optional, a row proven
    nan-free (rows.grad_nan_free) is rounded without the nan select."""
    d = dxr.shape[0]
    mhi, mlo = split_mean(mean)
    r = np.float64(row_rstd)
    p = np.float32(-r * r * (sgx / d))
    q = np.float32(-r * (sg / d) - np.float64(p) * mlo)
    a, b = block_spans(dxr, 0, d, stream)
    for i in range(a):
        _ln_dx(dyr, xr, w, dsr, dxr, mhi, p, q, row_rstd, i)
    c = a
    if a == 0 and reads_pairs(xr, dyr, dsr):  # whole blocks of bf16 rows: in pairs
        c = d - d % TAIL
        # a loop each, as in _ln_write
        if grad_select_optional(xr, dyr, dsr) and grad_nan_free(row_rstd, sg, sgx, p, q):
            for j in range(0, c, EMIT):
                prefetch_pass2(px, pdy, j, ahead, far)
                _dx_block("pairs/finite", dxr, j, dyr, xr, w_pairs, dsr, stage, mhi, p, q, row_rstd, stream)
        else:
            for j in range(0, c, EMIT):
                prefetch_pass2(px, pdy, j, ahead, far)
                _dx_block("pairs", dxr, j, dyr, xr, w_pairs, dsr, stage, mhi, p, q, row_rstd, stream)
    for j in range(c, b, EMIT):
        prefetch_pass2(px, pdy, j, ahead, far)
        _dx_block("plain", dxr, j, dyr, xr, w, dsr, stage, mhi, p, q, row_rstd, stream)
    if d - b >= HALF:
        _dx_block("plain/half", dxr, b, dyr, xr, w, dsr, stage, mhi, p, q, row_rstd, stream)
        b += HALF
    for i in range(b, d):
        _ln_dx(dyr, xr, w, dsr, dxr, mhi, p, q, row_rstd, i)


@njit
def _ln_dx(dyr, xr, w, dsr, out, mhi, p, q, row_rstd, i):
    v = fma32(load_at(dyr, i) * load_at(w, i), row_rstd, fma32(load_at(xr, i) - mhi, p, q))
    if dsr is not None:
        v += load_at(dsr, i)
    store_at(out, i, v)


def _dx_vector(builder, dy, x, w, c, row_rstd):
    """_ln_dx on 16 lanes (c = mhi, p, q)."""
    g = builder.fmul(dy, w)
    xc = builder.fsub(x, c[0])
    return fma_ir(builder, g, row_rstd, fma_ir(builder, xc, c[1], c[2]))


_DX_BLOCK = {
    (variant, stream): backward_block(_dx_vector, stream, paired=variant.startswith("pairs"),
                                      finite=variant == "pairs/finite",
                                      size=HALF if variant.endswith("/half") else EMIT)
    for variant in ("plain", "pairs", "pairs/finite", "plain/half")
    for stream in (False, True)
}


# replaced by the overload below
def _dx_block(variant, dx, j, dy, x, w, ds, stage, mhi, p, q, row_rstd, stream):  # pragma: no cover
    """The dx block at j (simd.backward_block). ``variant`` a string literal: "plain", "pairs"
    (bf16 rows read in pairs, w in pair_order), "pairs/finite" (the same without the nan
    select) or "plain/half" (HALF values, not EMIT)."""
    raise NotImplementedError


@overload(_dx_block, prefer_literal=True)
def _ov_dx_block(variant, dx, j, dy, x, w, ds, stage, mhi, p, q, row_rstd, stream):
    name = variant.literal_value
    if (name.startswith("pairs") and not (pair_types(x, dy, ds) and dx.dtype == dy.dtype)
            or name == "pairs/finite" and not select_optional(x, dy, ds)):
        # not called: reads_pairs or grad_select_optional is False
        return lambda variant, dx, j, dy, x, w, ds, stage, mhi, p, q, row_rstd, stream: None
    plain, streamed = _DX_BLOCK[name, False], _DX_BLOCK[name, True]

    def block(variant, dx, j, dy, x, w, ds, stage, mhi, p, q, row_rstd, stream):
        if stream:
            streamed(dx, np.uint64(j), dy, x, w, ds, stage, mhi, p, q, row_rstd)
        else:
            plain(dx, np.uint64(j), dy, x, w, ds, stage, mhi, p, q, row_rstd)

    return block
