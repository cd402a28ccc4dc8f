"""DyT on CPU, fused: the forward and the backward (Zhu et al. 2025, "Transformers without
Normalization").

Forward, elementwise (no statistics: a is one learned scalar, w and b are per feature):

    y = w * tanh(a * x) + b

Backward, with t = tanh(a * x) and u = dy * w * (1 - t^2):

    dx = a * u
    da = sum over every element of u * x
    dw = sum over rows of dy * t,     db = sum over rows of dy

Each row is read once and written once, like a copy. tanh is computed in a form LLVM vectorizes
(libm's tanh is a call per element), see _tanh. The sums are float64, one set per chunk of rows,
added in chunk order by the launcher: the same inputs and thread count give the same bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cache import kernel
from .codecs import _load, _store, _u32_as_f32
from .rows import FLUSH, _chunk, _flush, _partial_rows

# tanh in float32, vectorizable, as Cephes computes it: an odd polynomial below |z| = 0.625, and
# above it 1 - s with s = 2 / (exp(2|z|) + 1) = 2e / (1 + e), e = exp(-2|z|). Keeping s also gives
# the derivative 1 - t^2 = s (2 - s) without the cancellation of 1 - t*t near saturation (where
# float32's own 1 - tanh^2 can be wrong in every digit). Within 1.4 ulp of tanh, and s (2 - s)
# within 3e-7 of sech^2; past |z| = 9, t = +-1 and s = 0, as float32's tanh rounds there.
_SMALL = np.float32(0.625)
_SATURATED = np.float32(9.0)
_TANH_POLY = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1, -3.33332819422e-1)
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)


@njit(inline="always")
def _exp_neg(x):
    """exp(x) for -18 <= x <= 0 in float32 (Cephes' expf: x = n ln2 + r, a polynomial in r, times 2^n)."""
    n = np.floor(x * _LOG2E + np.float32(0.5))  # np.floor keeps float32 (math.floor gives an int64)
    r = x - n * _LN2_HI - n * _LN2_LO
    p = np.float32(_EXP_POLY[0])
    p = p * r + np.float32(_EXP_POLY[1])
    p = p * r + np.float32(_EXP_POLY[2])
    p = p * r + np.float32(_EXP_POLY[3])
    p = p * r + np.float32(_EXP_POLY[4])
    p = p * r + np.float32(_EXP_POLY[5])
    p = p * (r * r) + r + np.float32(1.0)
    return p * _u32_as_f32(np.uint32((np.int32(n) + 127) << 23))


@njit(inline="always")
def _tanh(z):
    """(tanh z, s): s = 1 - |tanh z| where |z| >= 0.625 (else unused), computed without cancellation."""
    a = min(abs(z), _SATURATED)
    z2 = z * z
    p = np.float32(_TANH_POLY[0])
    p = p * z2 + np.float32(_TANH_POLY[1])
    p = p * z2 + np.float32(_TANH_POLY[2])
    p = p * z2 + np.float32(_TANH_POLY[3])
    p = p * z2 + np.float32(_TANH_POLY[4])
    small = p * z2 * z + z
    e = _exp_neg(np.float32(-2.0) * a)
    s = np.float32(2.0) * e / (np.float32(1.0) + e)
    if a >= _SATURATED:
        s = np.float32(0.0)
    big = np.float32(1.0) - s
    if z < 0:
        big = -big
    t = small if a < _SMALL else big
    return t, s


@njit(inline="always")
def _sech2(t, s, z):
    """1 - tanh(z)^2, from _tanh's (t, s)."""
    return np.float32(1.0) - t * t if abs(z) < _SMALL else s * (np.float32(2.0) - s)


# ---------------------------------------------------------------------------------- forward


@kernel
def dyt_fwd(x, a, w, b, y, nchunks):
    n, d = x.shape
    a32 = np.float32(a)
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        for r in range(r0, r1):
            xr, yr = x[r], y[r]
            for i in range(d):
                _store(yr, i, _load(w, i) * _tanh(a32 * _load(xr, i))[0] + _load(b, i))


# --------------------------------------------------------------------------------- backward
# dw and db terms go to a chunk's float32 partial rows, added to its float64 rows (dw_sum,
# db_sum: (nchunks, d)) every FLUSH rows, as in the norms' backward (rows.py); da_sum (nchunks,)
# takes each chunk's da in float64.


@kernel
def dyt_bwd(dy, x, a, w, dx, da_sum, dw_sum, db_sum, nchunks):
    n, d = x.shape
    a32 = np.float32(a)
    dw_part = _partial_rows(nchunks, d)
    db_part = _partial_rows(nchunks, d)
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        dwc, dbc = dw_part[c], db_part[c]
        da = 0.0
        for r in range(r0, r1):
            dyr, xr, dxr = dy[r], x[r], dx[r]
            for i in range(d):
                g = _load(dyr, i)
                xv = _load(xr, i)
                z = a32 * xv
                t, sat = _tanh(z)
                u = g * _load(w, i) * _sech2(t, sat, z)
                _store(dxr, i, a32 * u)
                da += np.float64(u * xv)
                j = np.uint64(i)  # unsigned: an affine address (see codecs.py)
                dwc[j] += g * t
                dbc[j] += g
            if (r - r0) % FLUSH == FLUSH - 1:
                _flush(dwc, dw_sum[c])
                _flush(dbc, db_sum[c])
        _flush(dwc, dw_sum[c])
        _flush(dbc, db_sum[c])
        da_sum[c] = da
