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
import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
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
def _store_bf16_finite(a, i, v):
    a[np.uint64(i)] = _f32_to_bf16_bits_finite(v)


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


@njit
def _f32_to_bf16_bits_finite(v):
    """_f32_to_bf16_bits for a v that is not nan (no select): inf and overflow round right."""
    b = _f32_as_u32(v)
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


def _store_out(a, i, v, fast):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


def _round_out(a, v, fast):  # pragma: no cover
    raise NotImplementedError


# An output element: ``fast`` is () where the kernel has shown the value cannot be a nan with a
# payload (a row whose statistics are finite, finite weights), None elsewhere; then bf16
# rounding needs no nan select. Two marker types rather than a flag, so that numba compiles
# each loop without the test.


def _is_fast(fast):
    return not isinstance(fast, (types.NoneType, types.Omitted))


@overload(_store_out)
def _ov_store_out(a, i, v, fast):
    if a.dtype == types.uint16 and _is_fast(fast):
        return lambda a, i, v, fast: _store_bf16_finite(a, i, v)
    return lambda a, i, v, fast: _store(a, i, v)


@overload(_round_out)
def _ov_round_out(a, v, fast):
    if a.dtype == types.uint16 and _is_fast(fast):
        return lambda a, v, fast: _bf16_bits_to_f32(_f32_to_bf16_bits_finite(v))
    return lambda a, v, fast: _round_like(a, v)


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
# Every kernel works a row at a time in two passes: first the row's statistics (streaming it
# from memory), then its outputs (reading it again from L1/L2). A row's sums are formed by the
# same loops whatever the rest of the call looks like, so a row's result does not depend on the
# batch it came in, on where the chunk boundaries fall, or on the store path below.
#
# Row sums run in float32 over blocks of BLOCK elements (vectorized: LLVM keeps several float32
# lanes) and add the block sums in float64: as fast as a plain float32 sum (a float64 sum ran at
# half the speed and made the bf16 kernels compute-bound) and as accurate as a float64 one for
# any row length.
#
# ``rnd`` is a 1-element array whose dtype says where the normalized value is rounded before the
# weight multiply: the output dtype for the llama cast order, float32 (no rounding) for gemma.
# Making it a type keeps the choice out of the element loops.

BLOCK = 256


@njit
def _value(xr, rr, sr, i):
    """Element i of the row being normalized: x, or in the add variants (rr given) the residual
    sum x + r rounded to sr's dtype, which is stored in sr on the way."""
    if rr is None:
        return _load(xr, i)
    v = _round_like(sr, _load(xr, i) + _load(rr, i))
    _store(sr, i, v)
    return v


@njit
def _sumsq(xr, rr, sr, k):
    """Sum of the row's squares over [:k] (forming the whole residual sum when rr is given)."""
    total = 0.0
    full = k - k % BLOCK
    for j in range(0, full, BLOCK):
        part = np.float32(0.0)
        for i in range(j, j + BLOCK):
            v = _value(xr, rr, sr, i)
            part += v * v
        total += part
    part = np.float32(0.0)
    for i in range(full, k):
        v = _value(xr, rr, sr, i)
        part += v * v
    if rr is not None:
        for i in range(k, xr.shape[0]):  # past the statistic: the sum is still formed
            _value(xr, rr, sr, i)
    return total + part


@njit
def _moments(xr, rr, sr, row):
    """(mean, variance) of the row (``row`` is x, or the residual sum sr) in one pass: sums of
    u = x - c and u^2, with c the mean of the row's first block, then var = E[u^2] - E[u]^2.
    x - c is exact for x near c (Sterbenz), which keeps rows with a large mean (1e4) exact. The
    difference loses accuracy when E[u]^2 is not small against var (a first block unlike the
    rest of the row): then the variance comes from a second pass over the row, in cache."""
    d = row.shape[0]
    head = min(d, BLOCK)
    c = np.float32(0.0)
    for i in range(head):
        c += _value(xr, rr, sr, i)
    c = np.float32(c / head)
    s1 = 0.0
    s2 = 0.0
    full = d - d % BLOCK
    for j in range(0, full, BLOCK):
        p1 = np.float32(0.0)
        p2 = np.float32(0.0)
        for i in range(j, j + BLOCK):
            u = _value(xr, rr, sr, i) - c
            p1 += u
            p2 += u * u
        s1 += p1
        s2 += p2
    p1 = np.float32(0.0)
    p2 = np.float32(0.0)
    for i in range(full, d):
        u = _value(xr, rr, sr, i) - c
        p1 += u
        p2 += u * u
    m1 = (s1 + p1) / d
    mean = np.float64(c) + m1
    var = (s2 + p2) / d - m1 * m1
    if not m1 * m1 <= var * 0.0625:  # also taken for var <= 0 and nan
        var = _variance(row, d, mean)
    return mean, var


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
    """A second pass over a row in cache: mean((x - mean)^2), no cancellation."""
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


def _row(a, r):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_row)
def _ov_row(a, r):
    """a[r], or None when a is None (an optional input such as the residual gradient). An
    overload rather than an ``if a is None`` branch: numba would type that value Optional."""
    if isinstance(a, (types.NoneType, types.Omitted)):
        return lambda a, r: None
    return lambda a, r: a[r]


# ------------------------------------------------------------------------ streaming stores
# Outputs larger than the last-level cache go out with non-temporal stores. A normal store
# first reads the line it writes into the cache (read-for-ownership), so a kernel that reads x
# and writes y moves three streams through memory; a non-temporal store writes the line out
# whole: two streams. Measured on the 2-core EPYC (docs/results/cpu-bench-2026-11-29.md): y = 2x
# with non-temporal stores ran at 1.2x-1.5x the speed of torch's copy_, with normal stores at
# 0.9x-1.0x; on a tensor that fits in cache they are 3x slower, hence the size threshold in
# the launchers (``nt``).
#
# LLVM vectorizes a non-temporal store only where it can prove the vector aligned, which a
# scalar loop cannot state. So an output row is written as: plain stores up to its first
# 64-byte boundary, then blocks of BLOCK values computed into a small staging row (one per
# chunk, in L1) and copied out by ``_stream_block`` with aligned 64-byte non-temporal vector
# stores, then plain stores for the tail. The arithmetic is the same on every path.


@intrinsic
def _stream_block(typingctx, dst, j, src):
    """dst[j:j + BLOCK] = src[:BLOCK] with non-temporal stores; &dst[j] must be 64-byte aligned."""
    if dst.dtype != src.dtype:
        return None
    lanes = 64 // (src.dtype.bitwidth // 8)

    def codegen(context, builder, signature, args):
        dst_data = context.make_array(signature.args[0])(context, builder, args[0]).data
        src_data = context.make_array(signature.args[2])(context, builder, args[2]).data
        vec = ir.VectorType(context.get_data_type(signature.args[2].dtype), lanes)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        base = builder.gep(dst_data, [args[1]])
        for v in range(BLOCK // lanes):
            off = ir.Constant(ir.IntType(64), v * lanes)
            value = builder.load(builder.bitcast(builder.gep(src_data, [off]), vec.as_pointer()), align=1)
            target = builder.bitcast(builder.gep(base, [off]), vec.as_pointer())
            builder.store(value, target, align=64).set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return types.void(dst, types.uint64, src), codegen


X86 = platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def _store_fence(typingctx):
    """This thread's non-temporal stores become visible before anything after it: sfence on
    x86 (a plain fence there orders only normal stores), a full fence elsewhere."""

    def codegen(context, builder, signature, args):
        if X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.sfence"), [])
        else:
            builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@njit
def _spans(out, i0, i1, nt):
    """Split [i0, i1) of an output row into plain [i0, a), streamed [a, b) (whole blocks from a
    64-byte boundary) and plain [b, i1). Without ``nt`` everything is plain: a = b = i1."""
    if not nt:
        return i1, i1
    size = out.itemsize
    misalign = (np.int64(out.ctypes.data) + i0 * size) % 64
    a = i0 + min(i1 - i0, ((64 - misalign) % 64) // size)
    return a, a + (i1 - a) // BLOCK * BLOCK


# ----------------------------------------------------------------------------------- forward


@njit
def _rms_y(xr, w, out, rs, rnd, i, o, fast):
    _store_out(out, i - o, _round_out(rnd, _load(xr, i) * rs, fast) * _load(w, i), fast)


@njit
def _rms_write(xr, w, yr, rs, rnd, stage, nt, fast):
    d = yr.shape[0]
    a, b = _spans(yr, 0, d, nt)
    for i in range(a):
        _rms_y(xr, w, yr, rs, rnd, i, 0, fast)
    for j in range(a, b, BLOCK):
        for i in range(j, j + BLOCK):
            _rms_y(xr, w, stage, rs, rnd, i, j, fast)
        _stream_block(yr, np.uint64(j), stage)
    for i in range(b, d):
        _rms_y(xr, w, yr, rs, rnd, i, 0, fast)


@njit
def _ln_y(xr, w, bias, out, mhi, mlo, rs, i, o):
    _store(out, i - o, _centred(_load(xr, i), mhi, mlo) * rs * _load(w, i) + _load(bias, i))


@njit
def _ln_write(xr, w, bias, yr, mean, rs, stage, nt):
    d = yr.shape[0]
    mhi, mlo = _split(mean)
    a, b = _spans(yr, 0, d, nt)
    for i in range(a):
        _ln_y(xr, w, bias, yr, mhi, mlo, rs, i, 0)
    for j in range(a, b, BLOCK):
        for i in range(j, j + BLOCK):
            _ln_y(xr, w, bias, stage, mhi, mlo, rs, i, j)
        _stream_block(yr, np.uint64(j), stage)
    for i in range(b, d):
        _ln_y(xr, w, bias, yr, mhi, mlo, rs, i, 0)


# The kernels take ``stages`` (nchunks, >= BLOCK) in the output dtype, one staging row per
# chunk; its row count is the chunk count. ``nt`` turns the streaming stores on (see above).
# ``wfin`` (RMSNorm forward): the weights are finite. A row whose sum of squares is finite then
# holds no nan, and any nan the arithmetic makes from it is the hardware's default one, which
# the bf16 rounding without the nan select keeps a nan: such rows take the ``fast`` loops.
# Measured on one core, bf16 rows in L2: 7% (gemma order) to 10% (llama) faster; LayerNorm and
# the backward kernels gained 2-3%, not worth their second copy of the loops, which numba
# compiles for every dtype combination.


@njit(parallel=True, **JIT)
def rms_fwd(x, w, y, rstd, eps, inside, k, rnd, stages, nt, wfin):
    n, d = x.shape
    nchunks = stages.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        for r in range(r0, r1):
            ss = _sumsq(x[r], None, None, k)
            rs = _rms_scale(ss, k, eps, inside)
            rstd[r] = rs
            if wfin and k == d and math.isfinite(ss):
                _rms_write(x[r], w, y[r], rs, rnd, stages[c], nt, ())
            else:
                _rms_write(x[r], w, y[r], rs, rnd, stages[c], nt, None)
        if nt:
            _store_fence()


@njit(parallel=True, **JIT)
def add_rms_fwd(x, res, w, y, s, rstd, eps, inside, k, rnd, stages, nt, wfin):
    n, d = x.shape
    nchunks = stages.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        for r in range(r0, r1):
            # s is an output too, but the second pass reads it back: plain stores keep it cached
            ss = _sumsq(x[r], res[r], s[r], k)
            rs = _rms_scale(ss, k, eps, inside)
            rstd[r] = rs
            if wfin and k == d and math.isfinite(ss):
                _rms_write(s[r], w, y[r], rs, rnd, stages[c], nt, ())
            else:
                _rms_write(s[r], w, y[r], rs, rnd, stages[c], nt, None)
        if nt:
            _store_fence()


@njit(parallel=True, **JIT)
def ln_fwd(x, w, b, y, mean, rstd, eps, stages, nt):
    n = x.shape[0]
    nchunks = stages.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        for r in range(r0, r1):
            mu, var = _moments(x[r], None, None, x[r])
            rs = np.float32(1.0 / math.sqrt(var + eps))
            mean[r] = mu
            rstd[r] = rs
            _ln_write(x[r], w, b, y[r], mu, rs, stages[c], nt)
        if nt:
            _store_fence()


@njit(parallel=True, **JIT)
def add_ln_fwd(x, res, w, b, y, s, mean, rstd, eps, stages, nt):
    n = x.shape[0]
    nchunks = stages.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        for r in range(r0, r1):
            mu, var = _moments(x[r], res[r], s[r], s[r])
            rs = np.float32(1.0 / math.sqrt(var + eps))
            mean[r] = mu
            rstd[r] = rs
            _ln_write(s[r], w, b, y[r], mu, rs, stages[c], nt)
        if nt:
            _store_fence()


# ---------------------------------------------------------------------------------- backward
# ``ds`` is the gradient flowing into the residual sum (add variants) or None; numba compiles the
# None case without the add. ``dw_part`` / ``db_part`` are (nchunks, d) float32, zeroed by the
# launcher: each chunk adds its rows' terms to its own row, element by element.


@njit
def _dot_gx(dyr, w, xr, k):
    """(sum over the row of (dy * w) * x, sum of x^2 over [:k]), one pass over [:k]."""
    d = xr.shape[0]
    tgx = 0.0
    tss = 0.0
    full = k - k % BLOCK
    for j in range(0, full, BLOCK):
        pgx = np.float32(0.0)
        pss = np.float32(0.0)
        for i in range(j, j + BLOCK):
            xv = _load(xr, i)
            pgx += (_load(dyr, i) * _load(w, i)) * xv
            pss += xv * xv
        tgx += pgx
        tss += pss
    pgx = np.float32(0.0)
    pss = np.float32(0.0)
    for i in range(full, k):
        xv = _load(xr, i)
        pgx += (_load(dyr, i) * _load(w, i)) * xv
        pss += xv * xv
    for i in range(k, d):  # past the statistic (pRMSNorm): g * x only
        pgx += (_load(dyr, i) * _load(w, i)) * _load(xr, i)
    return tgx + pgx, tss + pss


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
def _rms_dx(dyr, xr, w, dsr, out, dwc, rs, coef, rnd, i, o, in_head):
    xv = _load(xr, i)
    dyv = _load(dyr, i)
    v = rs * (dyv * _load(w, i))
    if in_head:
        v -= coef * xv
    if dsr is not None:
        v += _load(dsr, i)
    _store(out, i - o, v)
    _accumulate(dwc, i, dyv * _round_like(rnd, xv * rs))


@njit
def _rms_bwd_write(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, i0, i1, head, stage, nt):
    """dx over [i0, i1) and its dw terms (``head``: inside the first k, where the rstd term
    applies)."""
    a, b = _spans(dxr, i0, i1, nt)
    for i in range(i0, a):
        _rms_dx(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, i, 0, head)
    for j in range(a, b, BLOCK):
        for i in range(j, j + BLOCK):
            _rms_dx(dyr, xr, w, dsr, stage, dwc, rs, coef, rnd, i, j, head)
        _stream_block(dxr, np.uint64(j), stage)
    for i in range(b, i1):
        _rms_dx(dyr, xr, w, dsr, dxr, dwc, rs, coef, rnd, i, 0, head)


@njit(parallel=True, **JIT)
def rms_bwd(dy, x, w, rstd, ds, dx, dw_part, eps, inside, k, rnd, stages, nt):
    n, d = x.shape
    nchunks = stages.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        dwc = dw_part[c]
        for r in range(r0, r1):
            rs = rstd[r]
            gx, ss = _dot_gx(dy[r], w, x[r], k)
            coef = _rms_coef(rs, gx, ss, k, inside)
            dsr = _row(ds, r)
            _rms_bwd_write(dy[r], x[r], w, dsr, dx[r], dwc, rs, coef, rnd, 0, k, True, stages[c], nt)
            _rms_bwd_write(dy[r], x[r], w, dsr, dx[r], dwc, rs, coef, rnd, k, d, False, stages[c], nt)
        if nt:
            _store_fence()


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
def _ln_dx(dyr, xr, w, dsr, out, dwc, dbc, mhi, mlo, rs, mg, mgx, i, o):
    dyv = _load(dyr, i)
    xh = _centred(_load(xr, i), mhi, mlo) * rs
    v = rs * (dyv * _load(w, i) - mg - xh * mgx)
    if dsr is not None:
        v += _load(dsr, i)
    _store(out, i - o, v)
    _accumulate(dwc, i, dyv * xh)
    _accumulate(dbc, i, dyv)


@njit
def _ln_bwd_write(dyr, xr, w, dsr, dxr, dwc, dbc, mean, rs, sg, sgx, stage, nt):
    """dx of this row and its dw, db terms."""
    d = dxr.shape[0]
    mhi, mlo = _split(mean)
    mg = np.float32(sg / d)
    mgx = np.float32(sgx / d)
    a, b = _spans(dxr, 0, d, nt)
    for i in range(a):
        _ln_dx(dyr, xr, w, dsr, dxr, dwc, dbc, mhi, mlo, rs, mg, mgx, i, 0)
    for j in range(a, b, BLOCK):
        for i in range(j, j + BLOCK):
            _ln_dx(dyr, xr, w, dsr, stage, dwc, dbc, mhi, mlo, rs, mg, mgx, i, j)
        _stream_block(dxr, np.uint64(j), stage)
    for i in range(b, d):
        _ln_dx(dyr, xr, w, dsr, dxr, dwc, dbc, mhi, mlo, rs, mg, mgx, i, 0)


@njit(parallel=True, **JIT)
def ln_bwd(dy, x, w, mean, rstd, ds, dx, dw_part, db_part, stages, nt):
    n = x.shape[0]
    nchunks = stages.shape[0]
    for c in prange(nchunks):
        r0, r1 = _chunk(c, nchunks, n)
        dwc = dw_part[c]
        dbc = db_part[c]
        for r in range(r0, r1):
            sg, sgx = _ln_sums(dy[r], w, x[r], mean[r], rstd[r])
            _ln_bwd_write(dy[r], x[r], w, _row(ds, r), dx[r], dwc, dbc, mean[r], rstd[r], sg, sgx, stages[c], nt)
        if nt:
            _store_fence()
