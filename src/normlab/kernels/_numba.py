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
fptrunc), and numba compiles one specialization per dtype combination.

Statistics: the row sums (sum x, sum x^2, sum g*x) accumulate in float64, which is free on a
memory-bound kernel and keeps long rows (65537 features) accurate to a few fp32 ulps; the
per-element math and the weight-gradient partials are float32. LayerNorm's saved mean is float64
so that rows with a large mean (1e4) keep their centred values exact in the backward.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
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
# Row sums run in float32 over blocks of BLOCK elements (vectorized: LLVM keeps several float32
# lanes) and add the block sums in float64: as fast as a plain float32 sum (a float64 sum ran at
# half the speed and made the bf16 kernels compute-bound) and as accurate as a float64 one for
# any row length.
#
# Software pipelining: rows are contiguous, so x is one long stream. A two-pass kernel (sum the
# row, then write it) lets that stream idle while it writes from cache, and measured at about
# two thirds of copy speed. So each kernel reduces row r + 1, streaming it from memory, in the
# same loop that writes row r from cache: the ``*_next`` helpers below take the next row
# (``None`` for the last row of a chunk; numba compiles that case without the reduction).
#
# ``rnd`` is a 1-element array whose dtype says where the normalized value is rounded before the
# weight multiply: the output dtype for the llama cast order, float32 (no rounding) for gemma.
# Making it a type keeps the choice out of the element loops.

BLOCK = 256


@njit
def _sumsq(xr, n):
    total = 0.0
    full = n - n % BLOCK
    for j in range(0, full, BLOCK):
        part = np.float32(0.0)
        for i in range(j, j + BLOCK):
            v = _load(xr, i)
            part += v * v
        total += part
    part = np.float32(0.0)
    for i in range(full, n):
        v = _load(xr, i)
        part += v * v
    return total + part


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
    """Second pass over a row in cache: mean((x - mean)^2), no E[x^2] - E[x]^2 cancellation."""
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


@njit
def _rms_scale(ss, k, eps, inside):
    ms = ss / k
    if inside:
        return np.float32(1.0 / math.sqrt(ms + eps))
    return np.float32(1.0 / (math.sqrt(ms) + eps))


@njit
def _rms_y(xr, w, yr, rs, rnd, i):
    _store(yr, i, _round_like(rnd, _load(xr, i) * rs) * _load(w, i))


@njit
def _next_value(xn, rn, sn, i):
    """Element i of the next row: x, or the sum x + r rounded to and stored in sn."""
    if rn is None:
        return _load(xn, i)
    v = _round_like(sn, _load(xn, i) + _load(rn, i))
    _store(sn, i, v)
    return v


@njit
def _rms_write_next(xr, w, yr, rs, rnd, k, xn, rn, sn):
    """Write yr = norm(xr). Meanwhile stream the next row (forming sn = xn + rn first when rn is
    given) and return its sum of squares over [:k]; 0 when xn is None (the chunk's last row)."""
    d = yr.shape[0]
    if xn is None:
        for i in range(d):
            _rms_y(xr, w, yr, rs, rnd, i)
        return 0.0
    total = 0.0
    full = k - k % BLOCK
    for j in range(0, full, BLOCK):
        part = np.float32(0.0)
        for i in range(j, j + BLOCK):
            v = _next_value(xn, rn, sn, i)
            part += v * v
            _rms_y(xr, w, yr, rs, rnd, i)
        total += part
    part = np.float32(0.0)
    for i in range(full, k):
        v = _next_value(xn, rn, sn, i)
        part += v * v
        _rms_y(xr, w, yr, rs, rnd, i)
    for i in range(k, d):  # past the statistic: the sum is still formed, not accumulated
        if rn is not None:
            _next_value(xn, rn, sn, i)
        _rms_y(xr, w, yr, rs, rnd, i)
    return total + part


@njit
def _ln_y(xr, w, b, yr, mhi, mlo, rs, i):
    _store(yr, i, _centred(_load(xr, i), mhi, mlo) * rs * _load(w, i) + _load(b, i))


@njit
def _ln_write_next(xr, w, b, yr, mean, rs, xn, rn, sn):
    """Write yr = layer_norm(xr). Meanwhile stream the next row (forming sn = xn + rn first when
    rn is given) and return its mean. The sum is shifted by the row's first element: x - x0 is exact for
    values near each other (Sterbenz) and small, so float32 block sums stay accurate for rows with
    a large mean (1e4), where summing the raw values in float32 loses about an ulp of the mean."""
    d = yr.shape[0]
    mhi, mlo = _split(mean)
    if xn is None:
        for i in range(d):
            _ln_y(xr, w, b, yr, mhi, mlo, rs, i)
        return 0.0
    x0 = _next_value(xn, rn, sn, 0)
    total = 0.0
    full = d - d % BLOCK
    for j in range(0, full, BLOCK):
        part = np.float32(0.0)
        for i in range(j, j + BLOCK):
            part += _next_value(xn, rn, sn, i) - x0
            _ln_y(xr, w, b, yr, mhi, mlo, rs, i)
        total += part
    part = np.float32(0.0)
    for i in range(full, d):
        part += _next_value(xn, rn, sn, i) - x0
        _ln_y(xr, w, b, yr, mhi, mlo, rs, i)
    return np.float64(x0) + (total + part) / d


# ----------------------------------------------------------------------------------- forward


@njit(parallel=True, **JIT)
def rms_fwd(x, w, y, rstd, eps, inside, k, rnd, nchunks):
    n = x.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        if r1 > r0:
            # the chunk's first row goes through the same fused loop as the others (its output
            # is written again below): every row's sums then add in the same order, so a row's
            # result does not depend on where the chunk boundaries fall (batch invariance)
            ss = _rms_write_next(x[r0], w, y[r0], np.float32(0.0), rnd, k, x[r0], None, None)
            for r in range(r0, r1):
                rs = _rms_scale(ss, k, eps, inside)
                rstd[r] = rs
                if r + 1 < r1:
                    ss = _rms_write_next(x[r], w, y[r], rs, rnd, k, x[r + 1], None, None)
                else:
                    _rms_write_next(x[r], w, y[r], rs, rnd, k, None, None, None)


@njit(parallel=True, **JIT)
def add_rms_fwd(x, res, w, y, s, rstd, eps, inside, k, rnd, nchunks):
    n = x.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        if r1 > r0:
            # a scratch "current" row: s[r0] itself would alias the row being formed, and LLVM
            # then takes its scalar fallback loop, whose sums round differently
            scratch = np.zeros_like(s[r0])
            ss = _rms_write_next(scratch, w, y[r0], np.float32(0.0), rnd, k, x[r0], res[r0], s[r0])
            for r in range(r0, r1):
                rs = _rms_scale(ss, k, eps, inside)
                rstd[r] = rs
                if r + 1 < r1:
                    ss = _rms_write_next(s[r], w, y[r], rs, rnd, k, x[r + 1], res[r + 1], s[r + 1])
                else:
                    _rms_write_next(s[r], w, y[r], rs, rnd, k, None, None, None)


@njit(parallel=True, **JIT)
def ln_fwd(x, w, b, y, mean, rstd, eps, nchunks):
    n, d = x.shape
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        if r1 > r0:
            mu = _ln_write_next(x[r0], w, b, y[r0], 0.0, np.float32(0.0), x[r0], None, None)
            for r in range(r0, r1):
                rs = np.float32(1.0 / math.sqrt(_variance(x[r], d, mu) + eps))
                mean[r] = mu
                rstd[r] = rs
                if r + 1 < r1:
                    mu = _ln_write_next(x[r], w, b, y[r], mu, rs, x[r + 1], None, None)
                else:
                    _ln_write_next(x[r], w, b, y[r], mu, rs, None, None, None)


@njit(parallel=True, **JIT)
def add_ln_fwd(x, res, w, b, y, s, mean, rstd, eps, nchunks):
    n, d = x.shape
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        if r1 > r0:
            scratch = np.zeros_like(s[r0])  # not s[r0]: see add_rms_fwd
            mu = _ln_write_next(scratch, w, b, y[r0], 0.0, np.float32(0.0), x[r0], res[r0], s[r0])
            for r in range(r0, r1):
                rs = np.float32(1.0 / math.sqrt(_variance(s[r], d, mu) + eps))
                mean[r] = mu
                rstd[r] = rs
                if r + 1 < r1:
                    mu = _ln_write_next(s[r], w, b, y[r], mu, rs, x[r + 1], res[r + 1], s[r + 1])
                else:
                    _ln_write_next(s[r], w, b, y[r], mu, rs, None, None, None)


# ---------------------------------------------------------------------------------- backward
# ``ds`` is the gradient flowing into the residual sum (add variants) or None; numba compiles the
# None case without the add. ``dw_part`` / ``db_part`` are (nchunks, d) float32, zeroed by the
# launcher. Each row's reductions for row r + 1 stream alongside the writes of row r, as in the
# forward kernels.


@njit
def _dot_gx(dyr, w, xr, k):
    """(sum over the row of (dy * w) * x, sum of x^2 over [:k]) for a chunk's first row."""
    d = xr.shape[0]
    tgx = 0.0
    full = d - d % BLOCK
    for j in range(0, full, BLOCK):
        part = np.float32(0.0)
        for i in range(j, j + BLOCK):
            part += (_load(dyr, i) * _load(w, i)) * _load(xr, i)
        tgx += part
    part = np.float32(0.0)
    for i in range(full, d):
        part += (_load(dyr, i) * _load(w, i)) * _load(xr, i)
    return tgx + part, _sumsq(xr, k)


@njit
def _rms_coef(rs, gx, ss, k, inside):
    # d rstd / d ms: inside -rstd^3 / 2; outside -rstd^2 / (2 sqrt(ms)). The sum of g * x runs
    # over all d features (every one is scaled by rstd); only ms is over the first k. DESIGN.md's
    # pRMSNorm formula sums g * x over i < k only, which is wrong for k < d.
    if inside:
        return np.float32(np.float64(rs) ** 3 * gx / k)
    rms = math.sqrt(ss / k)
    return np.float32(np.float64(rs) ** 2 / rms * gx / k) if rms > 0.0 else np.float32(0.0)


@njit
def _rms_dx(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, i, in_head):
    xv = _load(xr, i)
    dyv = _load(dyr, i)
    v = rs * (dyv * _load(w, i))
    if in_head:
        v -= coef * xv
    if dsr is not None:
        v += _load(dsr, i)
    _store(dxr, i, v)
    _accumulate(dwc, i, dyv * _round_like(rnd, xv * rs))


@njit
def _rms_bwd_span(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, dyn, xn, i0, i1, head):
    """dx and dw terms for elements [i0, i1) of this row (``head``: inside the first k, where
    the rstd term applies); returns the next row's partial (sum g * x, sum x^2 if head)."""
    tgx = 0.0
    tss = 0.0
    full = i0 + (i1 - i0) - (i1 - i0) % BLOCK
    for j in range(i0, full, BLOCK):
        pgx = np.float32(0.0)
        pss = np.float32(0.0)
        for i in range(j, j + BLOCK):
            xv = _load(xn, i)
            pgx += (_load(dyn, i) * _load(w, i)) * xv
            if head:
                pss += xv * xv
            _rms_dx(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, i, head)
        tgx += pgx
        tss += pss
    pgx = np.float32(0.0)
    pss = np.float32(0.0)
    for i in range(full, i1):
        xv = _load(xn, i)
        pgx += (_load(dyn, i) * _load(w, i)) * xv
        if head:
            pss += xv * xv
        _rms_dx(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, i, head)
    return tgx + pgx, tss + pss


@njit
def _rms_bwd_write_next(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, k, dyn, xn):
    """Write dx of this row and add its dw terms; meanwhile return the next row's (sum g * x,
    sum x^2 over [:k]), or zeros when xn is None."""
    d = dxr.shape[0]
    if xn is None:
        for i in range(k):
            _rms_dx(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, i, True)
        for i in range(k, d):
            _rms_dx(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, i, False)
        return 0.0, 0.0
    gx, ss = _rms_bwd_span(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, dyn, xn, 0, k, True)
    gx2, _ = _rms_bwd_span(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, dyn, xn, k, d, False)
    return gx + gx2, ss


@njit(parallel=True, **JIT)
def rms_bwd(dy, x, w, rstd, ds, dx, dw_part, eps, inside, k, rnd, nchunks):
    n, d = x.shape
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        dwc = dw_part[c]
        if r1 > r0:
            gx, ss = _dot_gx(dy[r0], w, x[r0], k)
            for r in range(r0, r1):
                rs = rstd[r]
                coef = _rms_coef(rs, gx, ss, k, inside)
                # ds is None or an array: numba resolves these branches when it compiles
                if r + 1 < r1:
                    if ds is None:
                        gx, ss = _rms_bwd_write_next(dy[r], x[r], w, None, dx[r], dwc, rs, coef, rnd, k, dy[r + 1], x[r + 1])
                    else:
                        gx, ss = _rms_bwd_write_next(dy[r], x[r], w, ds[r], dx[r], dwc, rs, coef, rnd, k, dy[r + 1], x[r + 1])
                else:
                    if ds is None:
                        _rms_bwd_write_next(dy[r], x[r], w, None, dx[r], dwc, rs, coef, rnd, k, None, None)
                    else:
                        _rms_bwd_write_next(dy[r], x[r], w, ds[r], dx[r], dwc, rs, coef, rnd, k, None, None)


@njit
def _ln_sums(dyr, w, xr, mean, rs):
    """(sum of g, sum of g * xhat) with g = dy * w, xhat = (x - mean) * rstd."""
    mhi, mlo = _split(mean)
    d = xr.shape[0]
    tg = 0.0
    tgx = 0.0
    full = d - d % BLOCK
    for j in range(0, full, BLOCK):
        pg = np.float32(0.0)
        pgx = np.float32(0.0)
        for i in range(j, j + BLOCK):
            g = _load(dyr, i) * _load(w, i)
            pg += g
            pgx += g * (_centred(_load(xr, i), mhi, mlo) * rs)
        tg += pg
        tgx += pgx
    pg = np.float32(0.0)
    pgx = np.float32(0.0)
    for i in range(full, d):
        g = _load(dyr, i) * _load(w, i)
        pg += g
        pgx += g * (_centred(_load(xr, i), mhi, mlo) * rs)
    return tg + pg, tgx + pgx


@njit
def _ln_dx(dyr, xr, w, dsr, dxr, dwc, dbc, mhi, mlo, rs, mg, mgx, i):
    dyv = _load(dyr, i)
    xh = _centred(_load(xr, i), mhi, mlo) * rs
    v = rs * (dyv * _load(w, i) - mg - xh * mgx)
    if dsr is not None:
        v += _load(dsr, i)
    _store(dxr, i, v)
    _accumulate(dwc, i, dyv * xh)
    _accumulate(dbc, i, dyv)


@njit
def _ln_bwd_write_next(dyr, xr, w, dsr, dxr, dwc, dbc, mean, rs, sg, sgx, dyn, xn, mean_n, rs_n):
    """Write dx of this row and add its dw, db terms; meanwhile return the next row's sums."""
    d = dxr.shape[0]
    mhi, mlo = _split(mean)
    mg = np.float32(sg / d)
    mgx = np.float32(sgx / d)
    if xn is None:
        for i in range(d):
            _ln_dx(dyr, xr, w, dsr, dxr, dwc, dbc, mhi, mlo, rs, mg, mgx, i)
        return 0.0, 0.0
    nhi, nlo = _split(mean_n)
    tg = 0.0
    tgx = 0.0
    full = d - d % BLOCK
    for j in range(0, full, BLOCK):
        pg = np.float32(0.0)
        pgx = np.float32(0.0)
        for i in range(j, j + BLOCK):
            g = _load(dyn, i) * _load(w, i)
            pg += g
            pgx += g * (_centred(_load(xn, i), nhi, nlo) * rs_n)
            _ln_dx(dyr, xr, w, dsr, dxr, dwc, dbc, mhi, mlo, rs, mg, mgx, i)
        tg += pg
        tgx += pgx
    pg = np.float32(0.0)
    pgx = np.float32(0.0)
    for i in range(full, d):
        g = _load(dyn, i) * _load(w, i)
        pg += g
        pgx += g * (_centred(_load(xn, i), nhi, nlo) * rs_n)
        _ln_dx(dyr, xr, w, dsr, dxr, dwc, dbc, mhi, mlo, rs, mg, mgx, i)
    return tg + pg, tgx + pgx


@njit(parallel=True, **JIT)
def ln_bwd(dy, x, w, mean, rstd, ds, dx, dw_part, db_part, nchunks):
    n, d = x.shape
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        dwc = dw_part[c]
        dbc = db_part[c]
        if r1 > r0:
            sg, sgx = _ln_sums(dy[r0], w, x[r0], mean[r0], rstd[r0])
            for r in range(r0, r1):
                if r + 1 < r1:
                    if ds is None:
                        sg, sgx = _ln_bwd_write_next(dy[r], x[r], w, None, dx[r], dwc, dbc, mean[r], rstd[r], sg, sgx,
                                                     dy[r + 1], x[r + 1], mean[r + 1], rstd[r + 1])
                    else:
                        sg, sgx = _ln_bwd_write_next(dy[r], x[r], w, ds[r], dx[r], dwc, dbc, mean[r], rstd[r], sg, sgx,
                                                     dy[r + 1], x[r + 1], mean[r + 1], rstd[r + 1])
                else:
                    if ds is None:
                        _ln_bwd_write_next(dy[r], x[r], w, None, dx[r], dwc, dbc, mean[r], rstd[r], sg, sgx,
                                           None, None, 0.0, np.float32(0.0))
                    else:
                        _ln_bwd_write_next(dy[r], x[r], w, ds[r], dx[r], dwc, dbc, mean[r], rstd[r], sg, sgx,
                                           None, None, 0.0, np.float32(0.0))
