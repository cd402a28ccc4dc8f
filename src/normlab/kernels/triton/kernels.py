"""Triton kernels: one forward and one backward for every norm, with compile-time flags.

Flags (``tl.constexpr``): IS_RMS (else LayerNorm), HAS_W, HAS_B, HAS_RES (fused residual add:
s = x + residual is written and normalized), HAS_DS (backward: the gradient of s is added), LLAMA
(round xhat to the output dtype before the weight multiply), INSIDE (eps inside the square root).
Run-time scalars stay fp32 (eps, offset) or int (rows, columns, k, strides): a new batch shape does
not recompile.

Rows are walked in column blocks of BLOCK, so every hidden size works (a row wider than BLOCK is
read more than once, no cliff). Addresses are int64. Statistics are fp32. The backward runs a
fixed number of programs, each over a fixed, strided set of rows, and writes its dw/db partial
sums to its own row of a (programs, d) buffer that is then summed in a fixed order: the same
inputs give bitwise the same gradients, with no atomics.

Low-precision rounding is done explicitly (``_round``: round-to-nearest-even through the bits for
bf16) before every store and wherever the op's definition rounds (LLAMA's xhat, the residual sum):
the result is exact on a GPU and also under TRITON_INTERPRET=1, whose own float-to-bf16
conversion truncates.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP32, BF16, FP16 = 0, 1, 2  # rounding kinds


@triton.jit
def _round(x, KIND: tl.constexpr):
    """x (fp32) rounded to the dtype KIND, kept in fp32."""
    if KIND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _row_value(X, R, row_x, row_r, cols, mask, HAS_RES: tl.constexpr, SUM_KIND: tl.constexpr):
    """x, or the residual sum s = x + r rounded to the sum's dtype, as fp32."""
    x = tl.load(X + row_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, SUM_KIND)
    return x


@triton.jit
def _rms_rstd(ss, k, eps, INSIDE: tl.constexpr):
    ms = ss / k
    if INSIDE:
        return 1.0 / tl.sqrt(ms + eps)
    else:
        return 1.0 / (tl.sqrt(ms) + eps)


@triton.jit
def _centred(x, mean, IS_RMS: tl.constexpr):
    """x - mean in fp32 from the float64 mean (LayerNorm; rows with a mean of 1e4 and unit spread
    lose nothing), or x itself (RMSNorm)."""
    if IS_RMS:
        return x
    else:
        return (x.to(tl.float64) - mean).to(tl.float32)


@triton.jit
def _write_y(Y, W, B, row_y, x, mean, rstd, cols, mask, offset, IS_RMS: tl.constexpr, HAS_W: tl.constexpr,
             HAS_B: tl.constexpr, LLAMA: tl.constexpr, OUT_KIND: tl.constexpr):
    """Normalize, scale, shift, round once (twice in the LLAMA order) and store one block."""
    xhat = _centred(x, mean, IS_RMS) * rstd
    if LLAMA:
        xhat = _round(xhat, OUT_KIND)
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset
        if LLAMA:
            w = _round(w, OUT_KIND)
        xhat = xhat * w
    if HAS_B:
        xhat += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row_y + cols, _round(xhat, OUT_KIND).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def norm_fwd(
    X, R, W, B, Y, S, MEAN, RSTD,
    n_rows, n_cols, k, stride_x, stride_r, stride_y, stride_s, eps, offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr,
    LLAMA: tl.constexpr,
    INSIDE: tl.constexpr, OUT_KIND: tl.constexpr, SUM_KIND: tl.constexpr, BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
    ROWS: tl.constexpr,
):
    """SINGLE (a row fits one block): ROWS rows per program, each read once and kept in
    registers (many rows per program for small hidden sizes: q/k norms over head_dim). Otherwise
    one row per program, walked in blocks: once for the statistics (twice for LayerNorm's
    variance) and once more for the output."""
    base = tl.arange(0, BLOCK)
    if SINGLE:
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        r2 = rows[:, None]
        cols = base[None, :]
        mask = rmask[:, None] & (cols < n_cols)
        x = _row_value(X, R, r2 * stride_x, r2 * stride_r, cols, mask, HAS_RES, SUM_KIND)
        if HAS_RES:
            tl.store(S + r2 * stride_s + cols, x.to(S.dtype.element_ty), mask=mask)
        if IS_RMS:
            rstd = _rms_rstd(tl.sum(tl.where(cols < k, x * x, 0.0), axis=1), k, eps, INSIDE)
            mean2 = 0.0
        else:
            mean = tl.sum(x.to(tl.float64), axis=1) / n_cols
            mean2 = mean[:, None]
            # the variance around the mean, never E[x^2] - E[x]^2
            xc = tl.where(mask, _centred(x, mean2, IS_RMS), 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
            tl.store(MEAN + rows, mean, mask=rmask)
        tl.store(RSTD + rows, rstd, mask=rmask)
        _write_y(Y, W, B, r2 * stride_y, x, mean2, rstd[:, None], cols, mask, offset, IS_RMS, HAS_W, HAS_B,
                 LLAMA, OUT_KIND)
    else:
        row = tl.program_id(0).to(tl.int64)
        row_x, row_r, row_y, row_s = row * stride_x, row * stride_r, row * stride_y, row * stride_s
        # pass 1: the sum (LayerNorm's mean) or the sum of squares over the first k (RMSNorm)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        acc64 = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, n_cols, BLOCK):
            cols = start + base
            mask = cols < n_cols
            x = _row_value(X, R, row_x, row_r, cols, mask, HAS_RES, SUM_KIND)
            if HAS_RES:
                tl.store(S + row_s + cols, x.to(S.dtype.element_ty), mask=mask)
            if IS_RMS:
                acc += tl.where(cols < k, x * x, 0.0)
            else:
                acc64 += x.to(tl.float64)
        if IS_RMS:
            rstd = _rms_rstd(tl.sum(acc, axis=0), k, eps, INSIDE)
            mean = 0.0
        else:
            mean = tl.sum(acc64, axis=0) / n_cols
            # pass 2 (LayerNorm): the variance around the mean
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                cols = start + base
                mask = cols < n_cols
                x = _row_value(X, R, row_x, row_r, cols, mask, HAS_RES, SUM_KIND)
                xc = tl.where(mask, _centred(x, mean, IS_RMS), 0.0)
                acc += xc * xc
            rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
            tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)
        # last pass: the output
        for start in range(0, n_cols, BLOCK):
            cols = start + base
            mask = cols < n_cols
            x = _row_value(X, R, row_x, row_r, cols, mask, HAS_RES, SUM_KIND)
            _write_y(Y, W, B, row_y, x, mean, rstd, cols, mask, offset, IS_RMS, HAS_W, HAS_B, LLAMA, OUT_KIND)


@triton.jit
def _bwd_inputs(DY, X, W, row_dy, row_x, cols, mask, offset, HAS_W: tl.constexpr, LLAMA: tl.constexpr,
                IN_KIND: tl.constexpr):
    """dy, x and g = dy * (offset + w) (w rounded to the input dtype in the llama order), as fp32."""
    dy = tl.load(DY + row_dy + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + row_x + cols, mask=mask, other=0.0).to(tl.float32)
    g = dy
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) + offset
        if LLAMA:
            w = _round(w, IN_KIND)
        g = dy * w
    return dy, x, g


@triton.jit
def _row_terms(g, x, xc, rstd, cols, mask, k, IS_RMS: tl.constexpr):
    """Per element: (g, g * xhat or g * x, x^2 within the first k), the row sums' terms."""
    if IS_RMS:
        return g, g * x, tl.where(cols < k, x * x, 0.0)
    else:
        return g, g * tl.where(mask, xc * rstd, 0.0), g


@triton.jit
def _coefs(sum_g, sum_gx, sum_ss, rstd, k, n_cols, IS_RMS: tl.constexpr, INSIDE: tl.constexpr):
    """RMSNorm: the coefficient of x in dx (d rstd / d ms: -rstd^3/2 inside the root, -rstd^2 /
    (2 rms) outside; g * x summed over all d features, ms over the first k), formed from the mean
    of g * x outwards: each step stays near the size of g, where rstd^3 first would leave float32
    for rows far from unit scale (1e45 at 1e-15, 1e-45 at 1e15). LayerNorm: mean(g) and
    mean(g * xhat)."""
    if IS_RMS:
        if INSIDE:
            coef = rstd * (rstd * (rstd * (sum_gx / k)))
        else:
            rms = tl.sqrt(sum_ss / k)
            coef = tl.where(rms > 0.0, rstd * (rstd * (sum_gx / k / tl.maximum(rms, 1e-38))), 0.0)
        return coef, 0.0, 0.0
    else:
        return 0.0, sum_g / n_cols, sum_gx / n_cols


@triton.jit
def _write_dx(DX, DS, row_dx, row_ds, g, x, xc, rstd, coef, mg, mgx, cols, mask, k, IS_RMS: tl.constexpr,
              HAS_DS: tl.constexpr, DX_KIND: tl.constexpr):
    if IS_RMS:
        dx = rstd * g - tl.where(cols < k, coef * x, 0.0)
    else:
        dx = rstd * (g - mg - xc * rstd * mgx)
    if HAS_DS:
        dx += tl.load(DS + row_ds + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + row_dx + cols, _round(dx, DX_KIND).to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _dw_term(dy, xc, rstd, LLAMA: tl.constexpr, IN_KIND: tl.constexpr):
    """dy * xhat, xhat rounded to the input dtype in the LLAMA order (as the forward multiplied it)."""
    xhat = xc * rstd
    if LLAMA:
        xhat = _round(xhat, IN_KIND)
    return dy * xhat


@triton.jit
def norm_bwd(
    DY, X, W, MEAN, RSTD, DS, DX, DW, DB,
    n_rows, n_cols, k, stride_dy, stride_x, stride_ds, stride_dx, offset,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DS: tl.constexpr, LLAMA: tl.constexpr,
    INSIDE: tl.constexpr, IN_KIND: tl.constexpr, DX_KIND: tl.constexpr, BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
    ROWS: tl.constexpr,
):
    """dx for rows pid, pid + P, ... and this program's dw/db partial sums in DW[pid], DB[pid].
    SINGLE (a row fits one block): tiles of ROWS rows (row blocks pid, pid + P, ...), each row
    read once, the partials in registers; otherwise rows are walked in blocks twice (sums, then
    dx) and the partials live in DW/DB."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    base = tl.arange(0, BLOCK)
    part_row = pid.to(tl.int64) * n_cols
    zero64 = pid.to(tl.int64) * 0  # int64 rows (the loop variable is a plain int under the interpreter)
    if SINGLE:
        cols = base[None, :]
        colmask = cols < n_cols
        acc_dw = tl.zeros([BLOCK], dtype=tl.float32)
        acc_db = tl.zeros([BLOCK], dtype=tl.float32)
        for rb in range(pid, tl.cdiv(n_rows, ROWS), n_prog):
            rows = zero64 + rb * ROWS + tl.arange(0, ROWS)
            rmask = rows < n_rows
            mask = rmask[:, None] & colmask
            r2 = rows[:, None]
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            rstd2 = rstd[:, None]
            if IS_RMS:
                mean2 = 0.0
            else:
                mean2 = tl.load(MEAN + rows, mask=rmask, other=0.0)[:, None]
            dy, x, g = _bwd_inputs(DY, X, W, r2 * stride_dy, r2 * stride_x, cols, mask, offset, HAS_W, LLAMA,
                                   IN_KIND)
            xc = _centred(x, mean2, IS_RMS)
            t_g, t_gx, t_ss = _row_terms(g, x, xc, rstd2, cols, mask, k, IS_RMS)
            coef, mg, mgx = _coefs(tl.sum(t_g, axis=1), tl.sum(t_gx, axis=1), tl.sum(t_ss, axis=1), rstd, k,
                                   n_cols,
                                   IS_RMS, INSIDE)
            if IS_RMS:
                coef2 = coef[:, None]
                mg2 = 0.0
                mgx2 = 0.0
            else:
                coef2 = 0.0
                mg2 = mg[:, None]
                mgx2 = mgx[:, None]
            _write_dx(DX, DS, r2 * stride_dx, r2 * stride_ds, g, x, xc, rstd2, coef2, mg2, mgx2, cols, mask,
                      k,
                      IS_RMS, HAS_DS, DX_KIND)
            if HAS_W:
                acc_dw += tl.sum(_dw_term(dy, xc, rstd2, LLAMA, IN_KIND), axis=0)
            if HAS_B:
                acc_db += tl.sum(dy, axis=0)
        if HAS_W:
            tl.store(DW + part_row + base, acc_dw, mask=base < n_cols)
        if HAS_B:
            tl.store(DB + part_row + base, acc_db, mask=base < n_cols)
    else:
        for row in range(pid, n_rows, n_prog):
            row64 = zero64 + row
            rstd = tl.load(RSTD + row64)
            if IS_RMS:
                mean = 0.0
            else:
                mean = tl.load(MEAN + row64)
            acc_g = tl.zeros([BLOCK], dtype=tl.float32)
            acc_gx = tl.zeros([BLOCK], dtype=tl.float32)
            acc_ss = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                cols = start + base
                mask = cols < n_cols
                dy, x, g = _bwd_inputs(DY, X, W, row64 * stride_dy, row64 * stride_x, cols, mask, offset,
                                       HAS_W, LLAMA, IN_KIND)
                t_g, t_gx, t_ss = _row_terms(g, x, _centred(x, mean, IS_RMS), rstd, cols, mask, k, IS_RMS)
                acc_g += t_g
                acc_gx += t_gx
                acc_ss += t_ss
            coef, mg, mgx = _coefs(tl.sum(acc_g, axis=0), tl.sum(acc_gx, axis=0), tl.sum(acc_ss, axis=0),
                                   rstd, k, n_cols,
                                   IS_RMS, INSIDE)
            for start in range(0, n_cols, BLOCK):
                cols = start + base
                mask = cols < n_cols
                dy, x, g = _bwd_inputs(DY, X, W, row64 * stride_dy, row64 * stride_x, cols, mask, offset,
                                       HAS_W, LLAMA, IN_KIND)
                xc = _centred(x, mean, IS_RMS)
                _write_dx(DX, DS, row64 * stride_dx, row64 * stride_ds, g, x, xc, rstd, coef, mg, mgx, cols,
                          mask, k,
                          IS_RMS, HAS_DS, DX_KIND)
                if HAS_W:
                    dw = tl.load(DW + part_row + cols, mask=mask, other=0.0)
                    tl.store(DW + part_row + cols, dw + _dw_term(dy, xc, rstd, LLAMA, IN_KIND), mask=mask)
                if HAS_B:
                    db = tl.load(DB + part_row + cols, mask=mask, other=0.0)
                    tl.store(DB + part_row + cols, db + dy, mask=mask)


# ------------------------------------------------------------------------------------- DyT
# y = w * tanh(a x) + b, elementwise (a: one learned scalar). tanh as in the cpu kernel
# (kernels/cpu/pointwise.py): an odd polynomial below |z| = 0.625, else 1 - s with
# s = 2e / (1 + e), e = exp(-2|z|); the backward's 1 - t^2 is s (2 - s) there, without cancellation.


@triton.jit
def _dyt_tanh(z):
    """(tanh z, sech^2 z) in fp32."""
    a = tl.minimum(tl.abs(z), 9.0)
    z2 = z * z
    p = ((((-5.70498872745e-3 * z2 + 2.06390887954e-2) * z2 - 5.37397155531e-2) * z2 + 1.33314422036e-1) * z2
         - 3.33332819422e-1)
    small = p * z2 * z + z
    e = tl.exp(-2.0 * a)
    s = tl.where(a >= 9.0, 0.0, 2.0 * e / (1.0 + e))
    big = tl.where(z < 0, s - 1.0, 1.0 - s)
    near = tl.abs(z) < 0.625
    t = tl.where(near, small, big)
    sech2 = tl.where(near, 1.0 - t * t, s * (2.0 - s))
    return tl.where(z == z, t, z), tl.where(z == z, sech2, z)  # tl.minimum drops a NaN: keep it


@triton.jit
def dyt_fwd(X, ALPHA, W, B, Y, n_rows, n_cols, stride_x, stride_y,
            HAS_W: tl.constexpr, HAS_B: tl.constexpr, OUT_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """One block of one row: program (row, column block)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(ALPHA).to(tl.float32)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y, _ = _dyt_tanh(a * x)
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, _round(y, OUT_KIND).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def dyt_bwd(DY, X, ALPHA, W, DX, DA, DW, DB, n_rows, n_cols, stride_dy, stride_x, stride_dx,
            HAS_W: tl.constexpr, DX_KIND: tl.constexpr, BLOCK: tl.constexpr):
    """dx for rows pid, pid + P, ...; this program's partial sums of da (DA[pid]), dw and db
    (DW[pid], DB[pid]), column block by column block, kept in registers over the rows."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    zero64 = pid.to(tl.int64) * 0
    part_row = pid.to(tl.int64) * n_cols
    a = tl.load(ALPHA).to(tl.float32)
    acc_da = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) if HAS_W else 1.0
        acc_dw = tl.zeros([BLOCK], dtype=tl.float32)
        acc_db = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, n_rows, n_prog):
            row64 = zero64 + row
            dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            t, sech2 = _dyt_tanh(a * x)
            u = dy * w * sech2
            tl.store(DX + row64 * stride_dx + cols, _round(a * u, DX_KIND).to(DX.dtype.element_ty), mask=mask)
            acc_da += tl.where(mask, u * x, 0.0)
            acc_dw += dy * t
            acc_db += dy
        tl.store(DW + part_row + cols, acc_dw, mask=mask)
        tl.store(DB + part_row + cols, acc_db, mask=mask)
    tl.store(DA + pid, tl.sum(acc_da, axis=0))
