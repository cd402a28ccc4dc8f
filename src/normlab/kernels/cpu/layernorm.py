"""LayerNorm on CPU, fused: the forward and the residual-add forward (the backward's kernel is
in layernorm_bwd.py).

Forward, per row of d features:

    mean = sum(x) / d,   var = sum((x - mean)^2) / d,   rstd = 1 / sqrt(var + eps)
    y    = (x - mean) * rstd * w + b
    add variant: s = round(x + residual), stored, and y = layer_norm(s)

Backward, with g = dy * w and xhat = (x - mean) * rstd:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,   db = sum over rows of dy

The mean is float64 and enters as two float32 parts (mhi + mlo), so x - mhi is exact for x near
the mean and rows with a large mean (1e4) keep their centred values. Each output is written by
scalar element helpers at a row's head and tail and by 16-lane vector blocks in between; the two
forms of each formula sit side by side below and do the same operations in the same order.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .cache import kernel
from .codecs import load_at, pair_order, store_at
from .rows import (GROUP_ROW_BYTES, ROW_GROUP, all_finite, at, block_spans, chunk_span, forward_pairs,
                   forward_pairs_fit, grouped_rows, nan_free, pairs_fit, recip, row_of, value_at,
                   vector_sums, writes_pairs)
from .simd import (BLOCK, EMIT, HALF, forward_block, prefetch_pass1, prefetch_pass2, row_moments,
                   row_moments_wide, store_fence)

assert GROUP_ROW_BYTES // 2 <= BLOCK  # grouped rows, 16-bit, take _short_moments

# ---------------------------------------------------------------------------------- forward
# ``stages``: one float32 staging row per chunk (their count is the chunk count; see simd.py).
# ``stream``: stream the outputs past the caches. ``far``: prefetch the next row into L2, not L1
# (memory.prefetch_far). ``skip``: how many rows past the next one the prefetches reach
# (memory.prefetch_skip).


@kernel
def ln_fwd(x, w, b, y, mean, rstd, eps, stages, stream, far, skip):
    x, w, b, y, mean, rstd = at(x), at(w), at(b), at(y), at(mean), at(rstd)
    n, d = x.shape
    nchunks = stages.shape[0]
    span = d - d % EMIT if writes_pairs(x, y) else 0
    w_pairs, b_pairs = pair_order(w, span), pair_order(b, span)
    wb_finite = writes_pairs(x, y) and all_finite(w) and all_finite(b)
    pairs = forward_pairs(x, d)
    # short rows (rows.ROW_GROUP: _short_moments's, no longer than a BLOCK) in a parallel loop of
    # their own: long rows keep the code they had
    if grouped_rows(x, d):
        ahead = skip + ROW_GROUP - 1  # prefetch the rows the next group reads
        for c in prange(nchunks):
            r0, r1 = chunk_span(c, nchunks, n)
            stage = stages[c]
            mus, variances = np.empty(ROW_GROUP, np.float64), np.empty(ROW_GROUP, np.float64)
            for g0 in range(r0, r1, ROW_GROUP):
                g1 = min(g0 + ROW_GROUP, r1)
                for r in range(g0, g1):
                    m, v = _short_moments(row_of(x, r), row_of(x, r + ahead), None, far)
                    mus[r - g0], variances[r - g0] = m, v
                for r in range(g0, g1):
                    mean[r], rstd[r] = mus[r - g0], recip(math.sqrt(variances[r - g0] + eps))
                for r in range(g0, g1):
                    mu, row_rstd = mus[r - g0], rstd[r]
                    _ln_write(row_of(x, r), w, b, w_pairs, b_pairs, row_of(y, r), mu, row_rstd, stage, stream,
                              far, row_of(x, r + ahead), None, nan_free(wb_finite, row_rstd, mu))
            if stream:
                store_fence()
    else:
        for c in prange(nchunks):
            r0, r1 = chunk_span(c, nchunks, n)
            stage = stages[c]
            for r in range(r0, r1):
                _ln_row(x, None, w, b, w_pairs, b_pairs, y, x, mean, rstd, eps, r, r0, r1, pairs, stage,
                        stream, far, skip, wb_finite)
            if stream:
                store_fence()


@kernel
def add_ln_fwd(x, res, w, b, y, s, mean, rstd, eps, stages, stream, far, skip):
    x, res, w, b, y, s = at(x), at(res), at(w), at(b), at(y), at(s)
    mean, rstd = at(mean), at(rstd)
    n, d = x.shape
    nchunks = stages.shape[0]
    span = d - d % EMIT if writes_pairs(s, y) else 0
    w_pairs, b_pairs = pair_order(w, span), pair_order(b, span)
    wb_finite = writes_pairs(s, y) and all_finite(w) and all_finite(b)
    for c in prange(nchunks):
        r0, r1 = chunk_span(c, nchunks, n)
        stage = stages[c]
        for r in range(r0, r1):  # no pairs: they gained nothing here (docs/cpu-kernels.md)
            _ln_row(x, res, w, b, w_pairs, b_pairs, y, s, mean, rstd, eps, r, r0, r1, False, stage, stream,
                    far, skip, wb_finite)
        if stream:
            store_fence()


@njit(inline="always")
def _ln_row(x, res, w, b, w_pairs, b_pairs, y, s, mean, rstd, eps, r, r0, r1, pairs, stage, stream, far, skip,
            wb_finite):
    """Row r of a chunk's rows [r0, r1): its statistics, then its outputs. The row normalized is
    s: with ``res``, the residual sum x + res, formed and stored on the way; without, x itself (s
    is x). Where ``pairs`` (rows.forward_pairs) the rows go two by two from r0, and a pair's
    outputs are written together (_ln_write_pair) once both rows have their statistics; each
    pass 1 then prefetches the first half of the row two on."""
    first = r - (r - r0) % 2
    paired = _in_pair(s, res, y, first, r1, pairs, stream)
    ahead = skip + 1 if paired else skip
    xr, rr, sr = row_of(x, r), row_of(res, r), row_of(s, r)
    px, pr = row_of(x, r + ahead), row_of(res, r + ahead)  # the rows whose successors are prefetched
    mu, var = _moments(xr, rr, sr, sr, px, pr, far)
    row_rstd = recip(math.sqrt(var + eps))
    mean[r], rstd[r] = mu, row_rstd
    if not paired:
        _ln_write(sr, w, b, w_pairs, b_pairs, row_of(y, r), mu, row_rstd, stage, stream, far, px, pr,
                  nan_free(wb_finite, row_rstd, mu))
    elif r > first:
        _ln_write_pair(x, res, w, b, y, mean, rstd, first, stage, stream, far, skip)


def _in_pair(s, res, y, first, r1, pairs, stream):  # pragma: no cover - replaced by the overload below
    """Whether the rows first and first + 1 go as a pair: ``pairs``, both in the chunk (up to r1),
    and their whole output blocks at the same offsets. False at typing time where rows never
    pair (rows.forward_pairs_fit; with a residual), and the pair code is then not compiled."""
    raise NotImplementedError


def _pairs_fit(s, res) -> bool:
    return forward_pairs_fit(s) and isinstance(res, (types.NoneType, types.Omitted))


@overload(_in_pair, inline="always")
def _ov_in_pair(s, res, y, first, r1, pairs, stream):
    if not _pairs_fit(s, res):
        return lambda s, res, y, first, r1, pairs, stream: False

    def in_pair(s, res, y, first, r1, pairs, stream):
        if not pairs or first + 1 >= r1:
            return False
        d = y.shape[1]
        return (block_spans(row_of(y, first), 0, d, stream)[0]
                == block_spans(row_of(y, first + 1), 0, d, stream)[0])

    return in_pair


@njit(inline="always")
def _moments(xr, rr, sr, row, px, pr, far):
    """(mean, variance) of the row (``row`` is x, or the residual sum sr) in one pass: sums of
    u = x - c and u^2, with c the mean of the row's first block, then var = E[u^2] - E[u]^2.
    x - c is exact for x near c (Sterbenz). When E[u]^2 is not small against var (a first block
    unlike the rest of the row) the variance comes from a second pass over the row, in cache.
    Rows of at most a BLOCK take _short_moments instead. Prefetches from the rows after px and pr."""
    d = row.shape[0]
    if d <= BLOCK:
        if rr is not None:  # the residual sum formed first, then summed back from cache
            for i in range(d):
                value_at(xr, rr, sr, i)
        return _short_moments(row, px, pr, far)
    c = np.float32(0.0)
    for i in range(BLOCK):
        c += value_at(xr, rr, sr, i)
    c = np.float32(c / BLOCK)
    if rr is None and vector_sums(xr):
        full = d - d % HALF
        s1, s2 = row_moments(xr, full, c, px, None, far)
    else:
        full = d - d % BLOCK
        s1 = 0.0
        s2 = 0.0
        for j in range(0, full, BLOCK):
            prefetch_pass1(px, pr, j, far)
            p1 = np.float32(0.0)
            p2 = np.float32(0.0)
            for i in range(j, j + BLOCK):
                u = value_at(xr, rr, sr, i) - c
                p1 += u
                p2 += u * u
            s1 += p1
            s2 += p2
    p1 = np.float32(0.0)
    p2 = np.float32(0.0)
    for i in range(full, d):
        u = value_at(xr, rr, sr, i) - c
        p1 += u
        p2 += u * u
    m1 = (s1 + p1) / d
    mean = np.float64(c) + m1
    var = (s2 + p2) / d - m1 * m1
    if not m1 * m1 <= var * 0.0625:  # also taken for var <= 0 and nan
        var = _variance(row, d, mean)
    return mean, var


# E[x]^2 / var up to which _short_moments's float64 sums stand: their var is then off by at most
# (1 + 4096) * 2^-43 of itself (BLOCK terms, each exact before its sum's rounding), 2^-31
SHORT_SETTLED = 4096.0


@njit(inline="always")
def _short_moments(xr, px, pr, far):
    """_moments of a row of at most a BLOCK: the sums of x and x^2 in float64, no shift (its
    mean over the whole row was a chain of adds before the sums, which short rows waited on).
    A row whose mean is far from 0 against its spread takes a second pass about the mean."""
    d = xr.shape[0]
    full = d - d % HALF
    s1, s2 = row_moments_wide(xr, full, np.float32(0.0), px, pr, far)
    for i in range(full, d):
        v = np.float64(load_at(xr, i))
        s1 += v
        s2 += v * v
    mean = s1 / d
    var = s2 / d - mean * mean
    if not mean * mean <= var * SHORT_SETTLED:  # also taken for var <= 0 and nan
        var = _variance(xr, d, mean)
    return mean, var


@njit
def _variance(xr, n, mean):
    """A second pass over a row in cache: mean((x - mean)^2), no cancellation."""
    mhi, mlo = split_mean(mean)
    total = 0.0
    full = n - n % BLOCK
    for j in range(0, full, BLOCK):
        part = np.float32(0.0)
        for i in range(j, j + BLOCK):
            c = _centred(load_at(xr, i), mhi, mlo)
            part += c * c
        total += part
    part = np.float32(0.0)
    for i in range(full, n):
        c = _centred(load_at(xr, i), mhi, mlo)
        part += c * c
    return (total + part) / n


@njit
def split_mean(mean):
    """The float64 mean as float32 mhi + mlo."""
    mhi = np.float32(mean)
    return mhi, np.float32(mean - np.float64(mhi))


@njit
def _centred(v, mhi, mlo):
    return (v - mhi) - mlo


@njit(inline="always")
def _ln_write(xr, w, bias, w_pairs, b_pairs, yr, mean, row_rstd, stage, stream, far, ahead1, ahead2, finite):
    """The row's outputs; ahead1 and ahead2 are the inputs whose next rows pass 2 prefetches.
    With writes_pairs and the row's blocks starting at 0, they go in pairs (w_pairs, b_pairs:
    w and b in pair_order over the whole blocks), rounded without the nan select where the row
    is ``finite`` (rows.nan_free)."""
    d = yr.shape[0]
    mhi, mlo = split_mean(mean)
    a, b = block_spans(yr, 0, d, stream)
    for i in range(a):
        _ln_y(xr, w, bias, yr, mhi, mlo, row_rstd, i)
    c = a
    if a == 0 and writes_pairs(xr, yr):
        c = b
        if finite:  # a loop each: choosing per block made LLVM slow the paired loop (docs/cpu-kernels.md)
            for j in range(0, b, EMIT):
                prefetch_pass2(ahead1, ahead2, j, 1, far)
                _y_block(yr, j, xr, w_pairs, b_pairs, stage, mhi, mlo, row_rstd, stream, True, True, EMIT)
        else:
            for j in range(0, b, EMIT):
                prefetch_pass2(ahead1, ahead2, j, 1, far)
                _y_block(yr, j, xr, w_pairs, b_pairs, stage, mhi, mlo, row_rstd, stream, True, False, EMIT)
    for j in range(c, b, EMIT):
        prefetch_pass2(ahead1, ahead2, j, 1, far)
        _y_block(yr, j, xr, w, bias, stage, mhi, mlo, row_rstd, stream, False, False, EMIT)
    _ln_write_tail(xr, w, bias, yr, mhi, mlo, row_rstd, b, stage, stream)


@njit(inline="always")
def _ln_write_tail(xr, w, bias, yr, mhi, mlo, row_rstd, b, stage, stream):
    """The outputs past the row's whole blocks, from b: a HALF block if that many are left."""
    d = yr.shape[0]
    if d - b >= HALF:  # in pair_order w and b are in place past the whole blocks: plain order serves
        _y_block(yr, b, xr, w, bias, stage, mhi, mlo, row_rstd, stream, False, False, HALF)
        b += HALF
    for i in range(b, d):
        _ln_y(xr, w, bias, yr, mhi, mlo, row_rstd, i)


def _ln_write_pair(x, res, w, b, y, mean, rstd, r, stage, stream, far, skip):  # pragma: no cover
    """_ln_write of rows r and r + 1 (_in_pair), their whole blocks side by side, each weight read
    once for the two: a row's bits are those it gets alone. Prefetches the second halves of the
    two rows after them. A function of its own, not inlined: inlined into the rows' loop, a
    first bf16 call compiled in 25 s instead of 9 (docs/cpu-kernels.md). w and b are in place:
    where rows pair, bf16 is not written in pairs (rows.writes_pairs)."""
    raise NotImplementedError


@overload(_ln_write_pair)
def _ov_ln_write_pair(x, res, w, b, y, mean, rstd, r, stage, stream, far, skip):
    if not _pairs_fit(x, res):
        return lambda x, res, w, b, y, mean, rstd, r, stage, stream, far, skip: None
    return _write_pair


def _write_pair(x, res, w, b, y, mean, rstd, r, stage, stream, far, skip):
    xr, xr2, yr, yr2 = row_of(x, r), row_of(x, r + 1), row_of(y, r), row_of(y, r + 1)
    px, px2 = row_of(x, r + 1 + skip), row_of(x, r + 2 + skip)
    d = xr.shape[0]
    a, e = block_spans(yr, 0, d, stream)
    row_rstd, row_rstd2 = rstd[r], rstd[r + 1]
    mhi, mlo = split_mean(mean[r])
    mhi2, mlo2 = split_mean(mean[r + 1])
    for i in range(a):
        _ln_y(xr, w, b, yr, mhi, mlo, row_rstd, i)
        _ln_y(xr2, w, b, yr2, mhi2, mlo2, row_rstd2, i)
    for j in range(a, e, EMIT):
        prefetch_pass2(px, px2, j, 1, far)
        at = np.uint64(j)
        if stream:
            _y_pair_streamed(yr, yr2, at, xr, xr2, w, b, stage, mhi, mlo, row_rstd, mhi2, mlo2, row_rstd2)
        else:
            _y_pair(yr, yr2, at, xr, xr2, w, b, stage, mhi, mlo, row_rstd, mhi2, mlo2, row_rstd2)
    _ln_write_tail(xr, w, b, yr, mhi, mlo, row_rstd, e, stage, stream)
    _ln_write_tail(xr2, w, b, yr2, mhi2, mlo2, row_rstd2, e, stage, stream)


@njit
def _ln_y(xr, w, bias, out, mhi, mlo, row_rstd, i):
    store_at(out, i, _centred(load_at(xr, i), mhi, mlo) * row_rstd * load_at(w, i) + load_at(bias, i))


def _y_vector(builder, x, w, b, mhi, mlo, row_rstd):
    """_ln_y on 16 lanes."""
    t = builder.fmul(builder.fsub(builder.fsub(x, mhi), mlo), row_rstd)
    return builder.fadd(builder.fmul(t, w()), b())


_Y_BLOCK = {(stream, paired, finite, size): forward_block(_y_vector, False, stream, paired=paired,
                                                          finite=finite, size=size)
            for stream in (False, True)
            for paired, finite, size in ((False, False, EMIT), (True, False, EMIT), (True, True, EMIT),
                                         (False, False, HALF))}
_y_pair, _y_pair_streamed = (forward_block(_y_vector, False, stream, rows=2) for stream in (False, True))


# replaced by the overload below
def _y_block(y, j, x, w, b, stage, mhi, mlo, row_rstd, stream, paired, finite, size):  # pragma: no cover
    """The output block y[j:j + size] (simd.forward_block; ``paired`` and ``finite`` literal
    bools: x and y in bf16 pairs, w and b in pair_order; no nan select; ``size`` EMIT or HALF,
    the latter in order only)."""
    raise NotImplementedError


@overload(_y_block, prefer_literal=True)
def _ov_y_block(y, j, x, w, b, stage, mhi, mlo, row_rstd, stream, paired, finite, size):
    pairs = paired.literal_value
    if pairs and not pairs_fit(x, y):
        # not called: writes_pairs is False
        return lambda y, j, x, w, b, stage, mhi, mlo, row_rstd, stream, paired, finite, size: None
    plain, streamed = (_Y_BLOCK[t, pairs, finite.literal_value, size.literal_value] for t in (False, True))

    def block(y, j, x, w, b, stage, mhi, mlo, row_rstd, stream, paired, finite, size):
        if stream:
            streamed(y, np.uint64(j), x, w, b, stage, mhi, mlo, row_rstd)
        else:
            plain(y, np.uint64(j), x, w, b, stage, mhi, mlo, row_rstd)

    return block
