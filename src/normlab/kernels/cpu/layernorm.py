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
from numba import njit, prange
from numba.extending import overload

from .cache import kernel
from .codecs import load_at, pair_order, store_at
from .rows import (all_finite, at, block_spans, chunk_span, nan_free, pairs_fit, recip, row_of, value_at,
                   vector_sums, writes_pairs)
from .simd import (BLOCK, EMIT, HALF, forward_block, prefetch_pass1, prefetch_pass2, row_moments,
                   row_moments_wide, store_fence)

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
    for c in prange(nchunks):
        r0, r1 = chunk_span(c, nchunks, n)
        stage = stages[c]
        for r in range(r0, r1):
            xr, px = row_of(x, r), row_of(x, r + skip)  # px: the row whose successor is prefetched
            mu, var = _moments(xr, None, None, xr, px, None, far)
            row_rstd = recip(math.sqrt(var + eps))
            mean[r] = mu
            rstd[r] = row_rstd
            _ln_write(xr, w, b, w_pairs, b_pairs, row_of(y, r), mu, row_rstd, stage, stream, far, px, None,
                      nan_free(wb_finite, row_rstd, mu))
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
        for r in range(r0, r1):
            xr, rr, sr = row_of(x, r), row_of(res, r), row_of(s, r)
            px, pr = row_of(x, r + skip), row_of(res, r + skip)
            mu, var = _moments(xr, rr, sr, sr, px, pr, far)
            row_rstd = recip(math.sqrt(var + eps))
            mean[r] = mu
            rstd[r] = row_rstd
            _ln_write(sr, w, b, w_pairs, b_pairs, row_of(y, r), mu, row_rstd, stage, stream, far, px, pr,
                      nan_free(wb_finite, row_rstd, mu))
        if stream:
            store_fence()


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
    if d - b >= HALF:  # in pair_order w and b are in place past the whole blocks: plain order serves
        _y_block(yr, b, xr, w, bias, stage, mhi, mlo, row_rstd, stream, False, False, HALF)
        b += HALF
    for i in range(b, d):
        _ln_y(xr, w, bias, yr, mhi, mlo, row_rstd, i)


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
