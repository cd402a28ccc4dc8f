"""tanh and erf, and the slopes their backward passes need, as float32 LLVM IR on 16 lanes: the
functions the DyT and Derf kernels (pointwise.py) compute. A scalar is a vector's first lane, so
every element gets the same bits wherever it falls in its row. The accuracy of each is measured
over every float32 by tools/pointwise_ulp.py; erf's polynomials come from tools/erf_fit.py.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils

from .codecs import LANES
from .simd import AVX512, fma_ir

# ------------------------------------------------------------------------------------- tanh
# With e = exp(-2|z|) and m = e - 1 = expm1(-2|z|):
#
#     tanh z = sign(z) * -m / (1 + e)
#     1 - tanh^2 z = 4 h (1 - h),   h = e / (1 + e)       (no cancellation near +-1)
#
# m keeps small z accurate (1 - e would cancel), and the denominator comes from e rather than
# from 2 + m, so m's rounding is not doubled. Both come from one exponential, reduced as
# -|z| = n ln2 / 2 + r with |r| <= ln2 / 4: exp(-2|z|) = 2^n e^(2r), q = expm1(2r) / 2 =
# r + r^2 P(r) (below), and with p = 2^n, m = 2p q + (p - 1), e = 2p q + p and
# 1 + e = 2p q + (p + 1), one fma each. Halving the reduction saves doubling z, and
# fma(|z|, -2 log2 e, 1.5 * 2^23) - 1.5 * 2^23 rounds in two operations where rint takes two and
# a multiply. tanh is within 1.95 ulp over every float32 (float32's own: about 1;
# tools/pointwise_ulp.py), and 4h (1 - h) within 2.5e-7 of sech^2 (same tool). |z| is capped at
# 10 to keep the reduction finite: t rounds to +-1 from |z| = 9.01 on, and the backward sets h
# to 0 from 10, so nothing flows back through a saturated element (and nothing subnormal is
# made). The IR works on 16-lane vectors with no fast-math flags; a scalar is a vector's first
# lane. Every operation counts: these loops run at the limit of the vector ports
# (docs/cpu-kernels.md, "DyT").

TANH_CAP = 10.0
# expm1(s) = s + s^2 P0(s), P0 fitted on [-0.35, 0.35] (highest degree first); with s = 2r,
# expm1(2r) / 2 = r + r^2 P(r) for P(r) = 2 P0(2r): each coefficient times a power of 2, exactly.
_EXPM1_P0 = (1.3857560697942972e-3, 8.367335423827171e-3, 4.16676327586174e-2, 0.16666537523269653,
             0.4999999701976776)
_EXPM1_POLY = tuple(c * 2.0 ** (len(_EXPM1_P0) - i) for i, c in enumerate(_EXPM1_P0))
_TWO_LOG2E = 2 * 1.44269504088896341
_ROUND = 1.5 * 2.0**23  # x + _ROUND - _ROUND rounds x to a whole number (|x| < 2^22)
_LN2_HI, _LN2_LO = 0.693359375 / 2, -2.12194440e-4 / 2  # (ln 2) / 2 = HI + LO, n * HI exact for the n here
F32 = ir.VectorType(ir.FloatType(), LANES)
I32 = ir.VectorType(ir.IntType(32), LANES)


def const(value, ty=F32):
    """A vector constant (float32 values rounded to float32)."""
    return ir.Constant(ty, [float(np.float32(value)) if ty == F32 else value] * LANES)


def _llvm(builder, name, *args):
    """The LLVM intrinsic ``name`` (fabs, copysign) on float32 vectors."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32] * len(args)),
                                        f"llvm.{name}.v16f32")
    return builder.call(fn, list(args))


def pow2(builder, n, scale=1, scalef=AVX512):
    """scale * 2^n (scale 1 or 2) for n a whole number in [-29, 0] or nan (then nan, or with the
    float32 bits, any value: tanh's nan comes through q anyway). ``scalef``: AVX-512's vscalefps,
    one operation."""
    if scalef:
        ty = ir.FunctionType(F32, [F32, F32, F32, ir.IntType(16), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, ty, "llvm.x86.avx512.mask.scalef.ps.512")
        return builder.call(fn, [const(scale), n, const(0.0), ir.Constant(ir.IntType(16), -1),
                                 ir.Constant(ir.IntType(32), 4)])
    n = builder.select(builder.fcmp_ordered("ord", n, n), n, const(0.0))  # fptosi of a nan would be poison
    bias = 127 + scale.bit_length() - 1
    return builder.bitcast(builder.shl(builder.add(builder.fptosi(n, I32), const(bias, I32)), const(23, I32)),
                           F32)


def _exps(builder, z):
    """(q, n, u) for 16 lanes: u = min(|z|, 10), -u = n ln2 / 2 + r, q = expm1(2r) / 2, so
    exp(-2u) = 2^n (2q + 1). A nan stays nan."""
    az = _llvm(builder, "fabs", z)
    # min(10, |z|), nan kept
    u = builder.select(builder.fcmp_ordered("<", const(TANH_CAP), az), const(TANH_CAP), az)
    n = builder.fsub(fma_ir(builder, u, const(-_TWO_LOG2E), const(_ROUND)), const(_ROUND))
    r = fma_ir(builder, n, const(-_LN2_HI), builder.fneg(u))
    r = fma_ir(builder, n, const(-_LN2_LO), r)
    poly = const(_EXPM1_POLY[0])
    for coef in _EXPM1_POLY[1:]:
        poly = fma_ir(builder, poly, r, const(coef))
    return fma_ir(builder, builder.fmul(r, r), poly, r), n, u


def tanh(builder, z):
    """The forward's tanh z, for 16 lanes."""
    q, n, _ = _exps(builder, z)
    p2 = pow2(builder, n, 2)
    m = fma_ir(builder, p2, q, fma_ir(builder, p2, const(0.5), const(-1.0)))  # 2p q + (p - 1)
    # 2p q + (p + 1) = 1 + e, one rounding
    den = fma_ir(builder, p2, q, fma_ir(builder, p2, const(0.5), const(1.0)))
    return _llvm(builder, "copysign", builder.fdiv(m, den), z)


def tanh_grad(builder, z):
    """The backward's (t, s) for 16 lanes: t = tanh z and s = (1 - t^2) / 4 = h (1 - h), 0 from
    the cap on. t is m times 1 / (1 + e), the division that h needs (the forward divides m
    itself: up to an ulp apart)."""
    q, n, u = _exps(builder, z)
    p, p2 = pow2(builder, n), pow2(builder, n, 2)
    m, e = fma_ir(builder, p2, q, builder.fsub(p, const(1.0))), fma_ir(builder, p2, q, p)
    rden = builder.fdiv(const(1.0), builder.fadd(e, const(1.0)))  # (an estimate and a Newton step: no faster)
    t = _llvm(builder, "copysign", builder.fmul(m, rden), z)
    h = builder.select(builder.fcmp_ordered(">=", u, const(TANH_CAP)), const(0.0), builder.fmul(e, rden))
    return t, fma_ir(builder, builder.fneg(h), h, h)  # h (1 - h) = h - h^2


# ------------------------------------------------------------------------------------- erf
# erf z = z + z P(z^2) below |z| = ERF_SPLIT, and sign(z) (1 - exp(-r)) above it, with
# r = t + t Q(t), t = min(|z|, 4): r fits -log(erfc t), and erf rounds to 1 in float32 from
# |z| = 3.92, so the cap leaves the value exact and keeps Q inside its fitted range. Vectors do
# not branch: both halves are computed for every lane and one is selected. P and Q are least-
# squares fits at Chebyshev nodes, rounded to float32 (tools/erf_fit.py). erf is within 1.04 ulp
# over every float32 (float32's own: about 1; tools/pointwise_ulp.py --fn erf), and the slope
# within 2.2e-7 of erf' (same tool). exp(-r) reuses tanh's expm1 polynomial on a reduction by ln 2. The
# backward's slope erf'(z) / 4 = exp(-z^2) / (2 sqrt(pi))
# takes z^2 exactly as u2 + e (one fma finds e) and is 0 from |z| = 6, where it is below 1e-16:
# nothing subnormal is made, and nothing flows back through a saturated element.

ERF_SPLIT = 0.921875
ERF_P = (8.616668492322788e-05, -0.0008205609046854079, 0.005207051523029804, -0.02686205320060253,
          0.11283748596906662, -0.37612637877464294, 0.12837916612625122)
ERF_Q = (1.0140879567188676e-05, -0.0003126828814856708, 0.0036043254658579826, -0.02368735335767269,
          0.10615653544664383, 0.635196328163147, 0.12863820791244507)
ERF_CAP = 4.0
SLOPE_CAP = 6.0
SLOPE = 0.5 / np.sqrt(np.pi)  # erf'(z) / 4 = exp(-z^2) / (2 sqrt(pi))
_LOG2E = 1.44269504088896341


def _poly(builder, coefs, v):
    """The polynomial with ``coefs`` (highest degree first) at v, by Horner's rule in fmas."""
    out = const(coefs[0])
    for coef in coefs[1:]:
        out = fma_ir(builder, out, v, const(coef))
    return out


def _min_cap(builder, v, cap):
    """min(v, cap) for v >= 0 or nan (a nan stays nan)."""
    return builder.select(builder.fcmp_ordered("<", const(cap), v), const(cap), v)


def _exp_neg(builder, r):
    """exp(-r) for 16 lanes with 0 <= r <= 36 (a nan stays nan): -r = n ln 2 + f with |f| <= ln2 / 2,
    exp(f) = 1 + expm1(f), times 2^n."""
    n = builder.fsub(fma_ir(builder, r, const(-_LOG2E), const(_ROUND)), const(_ROUND))
    f = fma_ir(builder, n, const(-2 * _LN2_HI), builder.fneg(r))
    f = fma_ir(builder, n, const(-2 * _LN2_LO), f)
    q = fma_ir(builder, builder.fmul(f, f), _poly(builder, _EXPM1_P0, f), f)
    p = pow2(builder, n)
    return fma_ir(builder, p, q, p)


def erf(builder, z):
    """The forward's erf z, for 16 lanes."""
    az = _llvm(builder, "fabs", z)
    small = fma_ir(builder, z, _poly(builder, ERF_P, builder.fmul(z, z)), z)
    t = _min_cap(builder, az, ERF_CAP)
    r = fma_ir(builder, t, _poly(builder, ERF_Q, t), t)
    large = _llvm(builder, "copysign", builder.fsub(const(1.0), _exp_neg(builder, r)), z)
    return builder.select(builder.fcmp_ordered("<", az, const(ERF_SPLIT)), small, large)


def erf_grad(builder, z):
    """The backward's (t, s) for 16 lanes: t = erf z and s = erf'(z) / 4, 0 from |z| = 6 on."""
    u = _min_cap(builder, _llvm(builder, "fabs", z), SLOPE_CAP)
    u2 = builder.fmul(u, u)
    e = fma_ir(builder, u, u, builder.fneg(u2))  # u^2 = u2 + e exactly
    ex = _exp_neg(builder, u2)
    # exp(-u2 - e) = exp(-u2) (1 - e)
    s = builder.fmul(fma_ir(builder, builder.fneg(e), ex, ex), const(SLOPE))
    return erf(builder, z), builder.select(builder.fcmp_ordered(">=", u, const(SLOPE_CAP)), const(0.0), s)
