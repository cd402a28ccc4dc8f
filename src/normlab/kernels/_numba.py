"""numba kernels for the CPU backend: the compute layer only (launchers live in cpu.py).

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


@overload(_load)
def _ov_load(a, i):
    if a.dtype == types.float32:
        return lambda a, i: a[i]
    if a.dtype == types.uint16:
        return lambda a, i: _bf16_bits_to_f32(a[i])
    if a.dtype == types.int16:
        return lambda a, i: _f16_bits_to_f32(a[i])


@njit
def _store_f32(a, i, v):
    a[i] = v


@njit
def _store_bf16(a, i, v):
    a[i] = _f32_to_bf16_bits(v)


@njit
def _store_f16(a, i, v):
    a[i] = _f32_to_f16_bits(v)


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

BLOCK = 256


@njit
def _mean(xr, n):
    # Shifted by the row's first element: x - x0 is exact for values near each other (Sterbenz)
    # and small, so float32 block sums stay accurate for rows with a large mean (1e4), where
    # summing the raw values in float32 loses about an ulp of the mean.
    x0 = _load(xr, 0)
    total = 0.0
    full = n - n % BLOCK
    for j in range(0, full, BLOCK):
        part = np.float32(0.0)
        for i in range(j, j + BLOCK):
            part += _load(xr, i) - x0
        total += part
    part = np.float32(0.0)
    for i in range(full, n):
        part += _load(xr, i) - x0
    return np.float64(x0) + (total + part) / n


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
def _sumsq_centred(xr, n, mhi, mlo):
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
    return total + part


@njit
def _dot_gx(dyr, w, xr, n):
    """sum over the row of (dy * w) * x."""
    total = 0.0
    full = n - n % BLOCK
    for j in range(0, full, BLOCK):
        part = np.float32(0.0)
        for i in range(j, j + BLOCK):
            part += (_load(dyr, i) * w[i]) * _load(xr, i)
        total += part
    part = np.float32(0.0)
    for i in range(full, n):
        part += (_load(dyr, i) * w[i]) * _load(xr, i)
    return total + part


@njit
def _dot_g_gxh(dyr, w, xr, n, mhi, mlo, rs):
    """(sum of g, sum of g * xhat) with g = dy * w, xhat = (x - mean) * rstd."""
    tg = 0.0
    tgx = 0.0
    full = n - n % BLOCK
    for j in range(0, full, BLOCK):
        pg = np.float32(0.0)
        pgx = np.float32(0.0)
        for i in range(j, j + BLOCK):
            g = _load(dyr, i) * w[i]
            pg += g
            pgx += g * (_centred(_load(xr, i), mhi, mlo) * rs)
        tg += pg
        tgx += pgx
    pg = np.float32(0.0)
    pgx = np.float32(0.0)
    for i in range(full, n):
        g = _load(dyr, i) * w[i]
        pg += g
        pgx += g * (_centred(_load(xr, i), mhi, mlo) * rs)
    return tg + pg, tgx + pgx


@njit
def _split(mean):
    mhi = np.float32(mean)
    return mhi, np.float32(mean - np.float64(mhi))


@njit
def _add_row(xr, rr, sr):
    """sr = xr + rr in sr's dtype (float32 add, rounded once on store: torch's semantics)."""
    for i in range(sr.shape[0]):
        _store(sr, i, _load(xr, i) + _load(rr, i))


@njit
def _rms_rstd(xr, k, eps, inside):
    ms = _sumsq(xr, k) / k
    if inside:
        return np.float32(1.0 / math.sqrt(ms + eps))
    return np.float32(1.0 / (math.sqrt(ms) + eps))


@njit
def _rms_out_row(xr, w, yr, rstd, llama):
    d = yr.shape[0]
    if llama:  # normalize in fp32, round to the output dtype, then multiply by the weight
        for i in range(d):
            _store(yr, i, _round_like(yr, _load(xr, i) * rstd) * w[i])
    else:  # multiply in fp32, round once on store
        for i in range(d):
            _store(yr, i, _load(xr, i) * rstd * w[i])


@njit
def _ln_stats(xr):
    d = xr.shape[0]
    mean = _mean(xr, d)
    mhi, mlo = _split(mean)
    # second pass over a row in cache: no E[x^2] - E[x]^2 cancellation
    return mean, _sumsq_centred(xr, d, mhi, mlo) / d


@njit
def _ln_out_row(xr, w, b, yr, mean, rstd):
    mhi, mlo = _split(mean)
    for i in range(yr.shape[0]):
        _store(yr, i, _centred(_load(xr, i), mhi, mlo) * rstd * w[i] + b[i])


# ----------------------------------------------------------------------------------- forward


@njit(parallel=True, **JIT)
def rms_fwd(x, w, y, rstd, eps, inside, k, llama, nchunks):
    n = x.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        for r in range(r0, r1):
            rs = _rms_rstd(x[r], k, eps, inside)
            rstd[r] = rs
            _rms_out_row(x[r], w, y[r], rs, llama)


@njit(parallel=True, **JIT)
def add_rms_fwd(x, res, w, y, s, rstd, eps, inside, k, llama, nchunks):
    n = x.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        for r in range(r0, r1):
            _add_row(x[r], res[r], s[r])
            rs = _rms_rstd(s[r], k, eps, inside)
            rstd[r] = rs
            _rms_out_row(s[r], w, y[r], rs, llama)


@njit(parallel=True, **JIT)
def ln_fwd(x, w, b, y, mean, rstd, eps, nchunks):
    n = x.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        for r in range(r0, r1):
            mu, var = _ln_stats(x[r])
            rs = np.float32(1.0 / math.sqrt(var + eps))
            mean[r] = mu
            rstd[r] = rs
            _ln_out_row(x[r], w, b, y[r], mu, rs)


@njit(parallel=True, **JIT)
def add_ln_fwd(x, res, w, b, y, s, mean, rstd, eps, nchunks):
    n = x.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        for r in range(r0, r1):
            _add_row(x[r], res[r], s[r])
            mu, var = _ln_stats(s[r])
            rs = np.float32(1.0 / math.sqrt(var + eps))
            mean[r] = mu
            rstd[r] = rs
            _ln_out_row(s[r], w, b, y[r], mu, rs)


# ---------------------------------------------------------------------------------- backward
# ``ds`` is the gradient flowing into the residual sum (add variants) or None; numba compiles the
# None case without the add. ``dw_part`` / ``db_part`` are (nchunks, d) float32, zeroed by the
# launcher. Loop-invariant choices are hoisted out of the element loops so that those vectorize.


@njit
def _rms_dx_row(dyr, xr, w, dsr, dxr, rs, coef, k):
    d = dxr.shape[0]
    if dsr is None:
        for i in range(k):
            _store(dxr, i, rs * (_load(dyr, i) * w[i]) - coef * _load(xr, i))
        for i in range(k, d):  # features outside the statistic: no term from d rstd
            _store(dxr, i, rs * (_load(dyr, i) * w[i]))
    else:
        for i in range(k):
            _store(dxr, i, rs * (_load(dyr, i) * w[i]) - coef * _load(xr, i) + _load(dsr, i))
        for i in range(k, d):
            _store(dxr, i, rs * (_load(dyr, i) * w[i]) + _load(dsr, i))


@njit
def _rms_dw_row(dyr, xr, rs, dwc, llama):
    d = dwc.shape[0]
    if llama:  # the weight multiplied xhat rounded to the output dtype
        for i in range(d):
            dwc[i] += _load(dyr, i) * _round_like(dyr, _load(xr, i) * rs)
    else:
        for i in range(d):
            dwc[i] += _load(dyr, i) * (_load(xr, i) * rs)


@njit(parallel=True, **JIT)
def rms_bwd(dy, x, w, rstd, ds, dx, dw_part, eps, inside, k, llama, nchunks):
    n, d = x.shape
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        dwc = dw_part[c]
        for r in range(r0, r1):
            xr, dyr = x[r], dy[r]
            rs = rstd[r]
            # sum(g * x) runs over all d features (every one is scaled by rstd), the sum of
            # squares over the first k (only they enter rstd). DESIGN.md's pRMSNorm formula sums
            # g * x over i < k only, which is wrong for k < d.
            gx = _dot_gx(dyr, w, xr, d)
            # d rstd / d ms: inside -rstd^3 / 2; outside -rstd^2 / (2 sqrt(ms))
            if inside:
                coef = np.float64(rs) ** 3 * gx / k
            else:
                rms = math.sqrt(_sumsq(xr, k) / k)
                coef = (np.float64(rs) ** 2 / rms * gx / k) if rms > 0.0 else 0.0
            if ds is None:  # resolved when numba compiles (ds has NoneType or an array type)
                _rms_dx_row(dyr, xr, w, None, dx[r], rs, np.float32(coef), k)
            else:
                _rms_dx_row(dyr, xr, w, ds[r], dx[r], rs, np.float32(coef), k)
            _rms_dw_row(dyr, xr, rs, dwc, llama)


@njit
def _ln_dx_row(dyr, xr, w, dsr, dxr, mhi, mlo, rs, mg, mgx):
    d = dxr.shape[0]
    if dsr is None:
        for i in range(d):
            xh = _centred(_load(xr, i), mhi, mlo) * rs
            _store(dxr, i, rs * (_load(dyr, i) * w[i] - mg - xh * mgx))
    else:
        for i in range(d):
            xh = _centred(_load(xr, i), mhi, mlo) * rs
            _store(dxr, i, rs * (_load(dyr, i) * w[i] - mg - xh * mgx) + _load(dsr, i))


@njit
def _ln_dwb_row(dyr, xr, mhi, mlo, rs, dwc, dbc):
    for i in range(dwc.shape[0]):
        dyv = _load(dyr, i)
        dwc[i] += dyv * (_centred(_load(xr, i), mhi, mlo) * rs)
        dbc[i] += dyv


@njit(parallel=True, **JIT)
def ln_bwd(dy, x, w, mean, rstd, ds, dx, dw_part, db_part, nchunks):
    n, d = x.shape
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        dwc = dw_part[c]
        dbc = db_part[c]
        for r in range(r0, r1):
            xr, dyr = x[r], dy[r]
            mhi, mlo = _split(mean[r])
            rs = rstd[r]
            sg, sgx = _dot_g_gxh(dyr, w, xr, d, mhi, mlo, rs)
            mg, mgx = np.float32(sg / d), np.float32(sgx / d)
            if ds is None:
                _ln_dx_row(dyr, xr, w, None, dx[r], mhi, mlo, rs, mg, mgx)
            else:
                _ln_dx_row(dyr, xr, w, ds[r], dx[r], mhi, mlo, rs, mg, mgx)
            _ln_dwb_row(dyr, xr, mhi, mlo, rs, dwc, dbc)
