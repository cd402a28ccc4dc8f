"""The CPU kernels' vector blocks and row helpers against scalar code and float64: bf16 and fp16
conversions, row sums, row pairs in the first pass and the backward, row views, streamed spans
and the partial rows' placement."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from opcheck import DTYPES, OPS, op_leaves, call_op, run_op, check

pytestmark = pytest.mark.xdist_group("kernels")  # in-process compiles, run on one worker (conftest.py)
pytest.importorskip("numba", reason="the cpu backend needs numba (pip install normlab[cpu])")
from numba import njit  # noqa: E402
from normlab.kernels.cpu import codecs, launch, memory, rows, simd  # noqa: E402
from normlab.kernels.cpu import layernorm as LN  # noqa: E402
from normlab.kernels.cpu import layernorm_bwd as LNB  # noqa: E402
from normlab.kernels.cpu import rmsnorm as RMS  # noqa: E402


def _make_emit(llama, stream, hw=simd.HW_BF16):
    """An intrinsic: dst[j:j + EMIT] = src[:EMIT] (a staging row) converted to dst's dtype by
    simd.store_block, the kernels' conversion, on its own."""
    from numba import types
    from numba.extending import intrinsic

    def emit(typingctx, dst, j, src, w):
        def codegen(context, builder, signature, args):
            dst_data, src_data, w_data = (
                context.make_array(signature.args[k])(context, builder, args[k]).data for k in (0, 2, 3)
            )
            values = [codecs.load_f32(builder, src_data, v) for v in range(simd.EMIT // codecs.LANES)]
            zero = builder.gep(src_data, [codecs.i64(simd.ZERO)])
            base, wbase = builder.gep(dst_data, [args[1]]), builder.gep(w_data, [args[1]])
            simd.store_block(builder, dst.dtype, base, wbase, values, llama, stream, hw, zero)
            return context.get_dummy_value()

        return types.void(dst, types.uint64, src, w), codegen

    return intrinsic(emit)


# (llama, stream) -> the conversion with the CPU's bf16 instruction where it has one; and with
# integer rounding, which the kernels take on CPUs without it, checked on every CPU
_EMIT = {(llama, stream): _make_emit(llama, stream) for llama in (False, True) for stream in (False, True)}
_EMIT_INTEGER_BF16 = {key: _make_emit(*key, hw=False) for key in _EMIT}


def _special_floats(gen, n):
    """float32 values where conversions go wrong: ties at bf16 and fp16 precision, values that
    round up to the next binade or overflow, signed zeros, infinities, then random ones."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F80_8001, 0x7F7F_FFFF, 0x7F7F_8000,
                         0x477F_F000,
                         0x3F80_1000, 0x3F80_3000, 0x0, 0x8000_0000, 0x7F80_0000, 0xFF80_0000],
                        dtype=torch.int64)
    special = bits.to(torch.int32).view(torch.float32)
    special = torch.cat([special, -special])
    rest = torch.randn(n - special.numel(), generator=gen) * torch.logspace(-30, 30, n - special.numel())
    return torch.cat([special, rest]).numpy()


@pytest.mark.parametrize("nt", [False, True], ids=["stored", "streamed"])
@pytest.mark.parametrize("path", ["kernels", "integer-bf16"] if simd.HW_BF16 else ["kernels"])
@pytest.mark.parametrize("llama", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_conversions_match_the_scalar_ones(gen, dtype, llama, path, nt):
    # Output blocks are converted as explicit vectors (_EMIT: the CPU's bf16 instruction where
    # it has one, else integer rounding, which "integer-bf16" checks on such a CPU too; streamed
    # 16-bit blocks convert two vectors at a time, into whole lines); heads and tails of rows by
    # the scalar store_at. Both must give the same bits on everything a normalized row can hold.
    from numba import njit

    src = _special_floats(gen, simd.EMIT)
    stage = np.zeros(simd.STAGE_WIDTH, np.float32)  # a staging row, as the launchers make them
    w = (torch.randn(simd.EMIT, generator=gen) * 3).numpy()
    code = memory.KERNEL_CODE[dtype]
    nbytes = simd.EMIT * np.dtype(code).itemsize
    vec = memory._aligned(memory._raw(nbytes), nbytes).view(code)  # streamed stores need 64-byte alignment
    scalar = np.zeros(simd.EMIT, code)
    emit = (_EMIT if path == "kernels" else _EMIT_INTEGER_BF16)[llama, nt]

    @njit
    def by_vectors(dst, src, w):
        emit(dst, np.uint64(0), src, w)
        simd.store_fence()

    @njit
    def by_scalars(dst, src, w):
        for i in range(src.shape[0]):
            v = codecs.round_like(dst, src[i]) * w[i] if llama else src[i]
            codecs.store_at(dst, i, v)

    stage[: simd.EMIT] = src
    by_vectors(vec, stage, w)
    by_scalars(scalar, src, w)
    assert np.array_equal(vec, scalar)
    if dtype != torch.float32:  # a nan stays a nan (its bits may differ: see codecs.py)
        stage[: simd.EMIT] = np.nan
        by_vectors(vec, stage, w)
        widened = torch.from_numpy(vec.view(np.int16)).view(dtype).float()
        assert torch.isnan(widened).all()


# Spans of pass 1's vector loops: none, TAIL blocks only (a qk-norm head), a BLOCK, BLOCKs and TAILs,
# and all three with the one HALF block
SPANS = (0, simd.TAIL, 3 * simd.TAIL, simd.BLOCK, 2 * simd.BLOCK + 3 * simd.TAIL,
         simd.BLOCK + simd.TAIL + simd.HALF)


@pytest.mark.parametrize("far", [False, True], ids=["into-L1", "into-L2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vector_row_sums_match_float64(gen, dtype, far):
    # Pass 1's sums over whole blocks are explicit vector loops (bf16 read two values to a 32-bit
    # lane, in another order than the row's), of BLOCK values then of TAIL; they must be the
    # float64 sums of the row's values to float32 accuracy (the wide ones, float64 terms, to
    # float64's), and stop at the given number of values, whichever way they prefetch.
    from numba import njit

    @njit
    def sums(row, n, c):
        return (simd.row_moments(row, n, c, row, None, far), simd.row_sumsq(row, n, c, row, None, far),
                simd.row_moments_wide(row, n, c, row, None, far))

    x = (torch.randn(3 * simd.BLOCK + 7, generator=gen) * 2 + 5).to(dtype)
    row = memory.as_numpy(x)
    c = np.float32(4.5)
    for n in SPANS:
        (s1, s2), (ss, zero), (w1, w2) = sums(row, n, c)
        v = x[:n].double()
        u = v - float(c)
        assert zero == 0.0
        checks = [(s1, u.sum(), u.abs().sum(), 1e-6), (s2, (u * u).sum(), (u * u).sum(), 1e-6),
                  (ss, (v * v).sum(), (v * v).sum(), 1e-6),
                  (w1, u.sum(), u.abs().sum(), 1e-13), (w2, (u * u).sum(), (u * u).sum(), 1e-13)]
        for got, want, scale, tol in checks:
            assert abs(got - want.item()) <= tol * max(scale.item(), 1e-30), (n, got, want)


@pytest.mark.parametrize("op", ["ln", "rms", "rms_llama"])
def test_backward_pair_order_sums_match_float64(gen, op):
    # The bf16 backward's first pass reads rows two values to a 32-bit lane, so it reads the
    # weight, and adds the dw (db) terms, in pair order (codecs.pair_order): its sums must be the
    # float64 ones, and its partial rows, put back in place, the float64 terms of each element.
    from numba import njit

    ln_sums = LNB._GRAD_SUMS[1]

    @njit
    def ln_pass(dy, x, wp, dwc, dbc, n, mhi, rstd, lo):
        return ln_sums(dy, x, wp, dwc, dbc, n, mhi, rstd, lo, 0, False)

    @njit
    def rms_pass(dy, x, wp, dwc, rnd, n, rstd):
        return RMS._rms_blocks(dy, wp, wp, x, n, dwc, rstd, rnd, True, False, dy, x, 0)  # first wp: not read

    d = 3 * simd.BLOCK + 7
    x, dy = ((torch.randn(d, generator=gen) * s + m).to(torch.bfloat16) for s, m in ((2, 5), (1, 0)))
    w = torch.randn(d, generator=gen).numpy()
    mean, rstd = 4.75, np.float32(0.6)
    for n in SPANS:
        v, g = x[:n].double(), dy[:n].double()
        wn = torch.from_numpy(w[:n]).double()
        dwc, dbc = np.zeros(d, np.float32), np.zeros(d, np.float32)
        wp = codecs.pair_order(w, n)
        if op == "ln":
            mhi, mlo = np.float32(mean), np.float32(0.0)
            lo = np.float32(-float(mlo) * rstd)
            got = ln_pass(memory.as_numpy(dy), memory.as_numpy(x), wp, dwc, dbc, n, mhi, rstd, lo)
            xhat = (v - mean) * float(rstd)
            want = ((g * wn).sum(), (g * wn * xhat).sum())
            assert np.allclose(codecs.pair_unorder(dbc, n)[:n], g.numpy(), rtol=1e-6, atol=0)
        else:
            rnd = launch._round_to(torch.bfloat16, op == "rms_llama")
            got = rms_pass(memory.as_numpy(dy), memory.as_numpy(x), wp, dwc, rnd, n, rstd)
            xhat = v * float(rstd)
            if op == "rms_llama":  # x * rstd rounded to bf16 before the multiply
                xhat = (v.float() * rstd).to(torch.bfloat16).double()
            want = ((g * wn * v).sum(), (v * v).sum())
            terms = ((g * wn * v).abs(), v * v)
        if op == "ln":
            terms = ((g * wn).abs(), (g * wn * xhat).abs())
        # Any order of fp32 sums of fp32 products errs by at most (n + 4) * 2^-24 * sum |term|:
        # a bound on the terms, not on the sum, as the sum may cancel to near zero.
        for got_sum, want_sum, t in zip(got, want, terms):
            bound = (n + 4) * 2.0 ** -24 * t.sum().item()
            assert abs(got_sum - want_sum.item()) <= bound, (op, n, got, want)
        assert np.allclose(codecs.pair_unorder(dwc, n)[:n], (g * xhat).numpy(), rtol=1e-5, atol=1e-6)
        assert not dwc[n:].any()  # and nothing past n


@pytest.mark.parametrize("op", ["ln", "rms", "rms_squares", "rms_llama"])
def test_first_pass_over_a_row_pair_is_bitwise_two_single_rows(gen, op):
    # Wide bf16 rows go through the backward's first pass two at a time (_make_grad_sums,
    # rows=2): the sums of each row and the partial rows it adds to must be the very bits that
    # two passes of one row give, so a row's gradient does not depend on its neighbour.
    from numba import njit

    if op == "ln":
        one, two = LNB._GRAD_SUMS[1], LNB._GRAD_SUMS[2]
    else:
        one, two = (RMS._GRAD_SUMS[op == "rms_llama", op == "rms_squares", rows] for rows in (1, 2))

    @njit
    def single(dy, x, dy2, x2, wp, dwc, aux, n, c, e):
        return one(dy, x, wp, dwc, aux, n, c[0], c[1], c[2], 0, False) + one(dy2, x2, wp, dwc, aux, n, e[0],
                                                                             e[1], e[2], 0, True)

    @njit
    def pair(dy, x, dy2, x2, wp, dwc, aux, n, c, e):
        return two(dy, x, dy2, x2, wp, dwc, aux, n, c[0], c[1], c[2], e[0], e[1], e[2], 0, True)

    d = 3 * simd.BLOCK + 7
    rows = [memory.as_numpy((torch.randn(d, generator=gen) * 3 + 2).to(torch.bfloat16)) for _ in range(4)]
    n = SPANS[-1]  # BLOCKs and TAILs
    wp = codecs.pair_order(torch.randn(d, generator=gen).numpy(), n)
    c, e = (np.array([m, s, lo], np.float32) for m, s, lo in ((2.0, 0.4, -0.01), (1.5, 0.7, 0.02)))
    start = torch.randn(2, d, generator=gen).numpy()  # partial rows that already hold sums
    results = []
    for run in (single, pair):
        part = start.copy()
        aux = part[1] if op == "ln" else launch._round_to(torch.bfloat16, op == "rms_llama")
        sums = run(*rows, wp, part[0], aux, n, c, e)
        results.append((np.array(sums), part))
    (s1, p1), (s2, p2) = results
    assert s1.tobytes() == s2.tobytes(), (s1, s2)
    assert p1.tobytes() == p2.tobytes()
    assert not np.array_equal(p1, start)  # the terms were added
    assert np.array_equal(p1[:, n:], start[:, n:])  # and nothing past n


@pytest.mark.parametrize("op", OPS)
def test_wide_bf16_rows_in_pairs(gen, op):
    # From rows.PAIR_ROWS_MIN values a row, the bf16 backward takes rows two at a time (a chunk's
    # odd row alone): gradients against float64, and each row's input gradient bitwise the one
    # it gets alone, which goes through the single-row path.
    d = rows.PAIR_ROWS_MIN + simd.TAIL + 37  # whole blocks, a block of TAIL, then the element tail
    options = [{}] if "layer" in op else [{}, {"eps_mode": "outside", "cast": "gemma"}, {"partial": 0.75}]
    for opts in options:
        check(gen, op, (7, d), torch.bfloat16, opts)
        leaves = op_leaves(gen, op, (7, d), torch.bfloat16)
        outs = call_op(op, leaves, opts, "cpu")
        grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
        _, together = run_op(op, leaves, opts, "cpu", grads)
        for r in (0, 3, 6):
            alone_leaves = {k: (v[r : r + 1] if v.dim() == 2 else v) for k, v in leaves.items()}
            _, alone = run_op(op, alone_leaves, opts, "cpu", [g[r : r + 1] for g in grads])
            assert torch.equal(together["x"][r : r + 1], alone["x"]), (opts, r)


@pytest.mark.parametrize("streamed", [False, True], ids=["plain stores", "streamed"])
@pytest.mark.parametrize("d", [rows.FORWARD_PAIRS_ABOVE + 2 * simd.EMIT + simd.HALF,
                               rows.FORWARD_PAIRS_ABOVE + 37], ids=["alike", "at other offsets"])
def test_wide_bf16_layer_norm_rows_in_pairs(gen, d, streamed, monkeypatch):
    # Above rows.FORWARD_PAIRS_ABOVE values a row, LayerNorm's bf16 forward converted by
    # AVX512-BF16 writes rows two at a time, each block of weights read once for both (a chunk's
    # odd row alone; with streamed stores, rows whose blocks start at different offsets, as every
    # other row of d + 37 does, one at a time). Outputs against float64, and each row's output
    # bitwise what the row gets alone, through the single-row path.
    monkeypatch.setattr(launch, "STREAM_MIN_BYTES", 0 if streamed else 1 << 62)
    check(gen, "layer_norm", (7, d), torch.bfloat16)
    leaves = op_leaves(gen, "layer_norm", (7, d), torch.bfloat16)
    (together,) = call_op("layer_norm", leaves, {}, "cpu")
    for r in range(7):
        row = {k: (v[r : r + 1] if v.dim() == 2 else v) for k, v in leaves.items()}
        (alone,) = call_op("layer_norm", row, {}, "cpu")
        assert torch.equal(together[r : r + 1], alone), r


def _printed_at_level(script, level, tmp_path):
    """The last line a script prints when numba compiles for an x86-64 level (a process of its own)."""
    from normlab.kernels.cpu import cache

    cpu_name, features = cache.llvm_target(level)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_CPU_NAME": cpu_name,
           "NUMBA_CPU_FEATURES": features}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.split("\n")[-2]


FORWARD_PAIR_RULE = """
import numpy as np
from numba import njit
from normlab.kernels.cpu import rows

@njit
def pairs(x, d):
    return rows.forward_pairs(x, d)

bf16, fp16, fp32 = (np.zeros((1, 1), t) for t in (np.uint16, np.int16, np.float32))  # as the kernels see them
print(pairs(bf16, 4096), pairs(bf16, 4097), pairs(bf16, 16384), pairs(fp16, 16384), pairs(fp32, 16384))
"""


@pytest.mark.skipif(not simd.X86, reason="compiles for x86-64 levels")
@pytest.mark.parametrize("level, want", [("x86-64-v3", "False False False False False"),
                                         ("x86-64-v4", "False False False False False"),
                                         ("x86-64-v4-bf16", "False True True False False")])
def test_forward_rows_go_in_pairs_only_in_bf16_with_its_conversion_instruction(tmp_path, level, want):
    # Pairs of rows gained 1.12-1.26x in LayerNorm's bf16 forward on a Zen 4 at 6144-16384
    # features (1.0 at 4096, where the float32 weight and bias just fill L1), but spilled and
    # lost 21-58% with integer rounding (AVX2, AVX-512 without AVX512-BF16), and gained nothing
    # in fp32 or fp16 (docs/cpu-kernels.md, "Row pairs in the bf16 forward").
    assert _printed_at_level(FORWARD_PAIR_RULE, level, tmp_path) == want


PAIR_RULE = """
import numpy as np
from numba import njit
from normlab.kernels.cpu import rows

@njit
def fit(round_to, inside):
    return rows.pair_registers(round_to, inside)

@njit
def layer():
    return rows.pair_registers(None, False)

llama, gemma = np.zeros(1, np.uint16), np.zeros(1, np.float32)  # launch._round_to's dtypes for bf16
print(fit(llama, True), fit(gemma, True), fit(gemma, False), layer())
"""


@pytest.mark.skipif(not simd.X86, reason="compiles for x86-64 levels")
@pytest.mark.parametrize("level, want", [("x86-64-v3", "False True False False"),
                                         ("x86-64-v4", "True True True True")])
def test_rows_go_in_pairs_only_where_both_rows_accumulators_fit_the_registers(tmp_path, level, want):
    # Compiled for AVX2 (16 registers of 8 lanes), the backward's pass 1 over two rows spilled and
    # ran 4-44% slower than single rows except RMSNorm's one sum in the gemma order; with AVX-512
    # (32 of 16) pairs are faster in every case (docs/cpu-kernels.md, "Row pairs in the bf16
    # backward"). Printed: rms llama, rms gemma, rms gemma with eps outside (two sums), layer_norm.
    assert _printed_at_level(PAIR_RULE, level, tmp_path) == want


@pytest.mark.parametrize("hw", [False, True] if simd.HW_BF16 else [False],
                         ids=["integer-bf16", "instruction"][: 2 if simd.HW_BF16 else 1])
def test_the_backwards_bf16_line_holds_each_pairs_rounded_bits_in_order(gen, hw):
    # The backward stores dx 32 bf16 values at a time from the evens and odds of bf16_pair's
    # order (codecs.pair_line): value 2i from even[i], 2i+1 from odd[i], each rounded to nearest
    # even as torch rounds, overflow to inf, a nan to a nan. The integer path (every CPU without
    # AVX512-BF16) builds each 32-bit lane in place; it is checked on every CPU.
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    @intrinsic
    def store_line(typingctx, src, dst, zero):
        def codegen(context, builder, signature, args):
            s, d, z = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args))
            f32x16 = ir.VectorType(ir.FloatType(), codecs.LANES)
            even = builder.load(builder.bitcast(s.data, f32x16.as_pointer()), align=4)
            odd = builder.load(builder.bitcast(builder.gep(s.data,
                                                           [ir.Constant(ir.IntType(64), codecs.LANES)]),
                                               f32x16.as_pointer()), align=4)
            line = codecs.pair_line(builder, even, odd, hw, z.data)
            builder.store(line, builder.bitcast(d.data, line.type.as_pointer()), align=2)
            return context.get_dummy_value()

        return types.void(src, dst, zero), codegen

    @njit
    def run(src, dst, zero):
        store_line(src, dst, zero)

    values = _special_floats(gen, 32 * 8).astype(np.float32)
    values[::37] = np.nan
    zero = np.zeros(32, np.uint16)
    for at in range(0, values.size, 32):
        src, dst = values[at:at + 32], np.zeros(32, np.uint16)
        run(src, dst, zero)
        in_order = np.empty(32, np.float32)
        in_order[0::2], in_order[1::2] = src[:16], src[16:]
        want = torch.from_numpy(in_order).to(torch.bfloat16)
        got = torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16)
        finite = ~torch.isnan(want)
        assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
        assert torch.isnan(got[~finite].float()).all()


@pytest.mark.parametrize("finite", [False, True], ids=["nan", "no-nan"])
@pytest.mark.parametrize("stream", [False, True], ids=["stored", "streamed"])
@pytest.mark.parametrize("op", ["rms gemma", "rms llama", "layer"])
def test_a_forward_block_in_pairs_gives_the_in_order_blocks_bits(gen, op, stream, finite):
    # Without AVX512-BF16 the bf16 forwards read x and write y in pairs (rows.writes_pairs), w and
    # b in pair_order: the same operations per value, so the same bits as the in-order block.
    # Both are built here with the integer rounding, so this runs on every CPU. ``finite``: the
    # paired block without the nan select, which rows whose outputs hold no nan take
    # (rows.nan_free): infinities, overflow to inf and ties must still round as with it.
    from numba import njit

    llama = op == "rms llama"
    math = LN._y_vector if op == "layer" else RMS._y_vector(llama)
    blocks = [simd.forward_block(math, llama, stream, hw=False, paired=False),
              simd.forward_block(math, llama, stream, hw=False, paired=True, finite=finite)]

    def runner(block):
        @njit
        def run(y, x, w, b, stage, mhi, mlo, rstd):
            for j in range(0, y.shape[0], simd.EMIT):
                block(y, np.uint64(j), x, w, b, stage, mhi, mlo, rstd)

        return run

    plain, paired = (runner(b) for b in blocks)
    n = 4 * simd.EMIT
    x = torch.from_numpy(_special_floats(gen, n)).bfloat16().view(torch.int16).numpy().view(np.uint16)
    if not finite:
        x[::29] = 0x7FC0  # nan
    w, b = (torch.randn(n, generator=gen).bfloat16().float().numpy() for _ in range(2))
    stage = memory.zero_stages(1)[0]
    # 64-byte aligned
    want, got = torch.zeros(n, dtype=torch.int16).numpy(), torch.zeros(n, dtype=torch.int16).numpy()
    args = (np.float32(0.25), np.float32(-1e-3), np.float32(1.7))
    plain(want.view(np.uint16), x, w, b, stage, *args)
    paired(got.view(np.uint16), x, codecs.pair_order(w, n), codecs.pair_order(b, n), stage, *args)
    assert np.array_equal(got, want)
    values = torch.from_numpy(want).view(torch.bfloat16)
    assert torch.isnan(values).any() != finite and torch.isinf(values).any()  # the cases each kind must round


@pytest.mark.parametrize("stream", [False, True], ids=["stored", "streamed"])
@pytest.mark.parametrize("dtype", [np.float32, np.uint16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", ["rms llama", "layer", "rms dx", "layer dx"])
def test_a_half_block_writes_the_first_half_of_a_whole_blocks_values(gen, op, dtype, stream):
    # A row with HALF or more values left after its EMIT blocks writes them in one HALF block
    # (qk-norm's 96 and 160 features): the values of a whole block's first half, and nothing
    # past them.
    llama = op == "rms llama"
    if op.endswith("dx"):
        math = LNB._dx_vector if op == "layer dx" else RMS._dx_vector(True)
        blocks = [simd.backward_block(math, stream, size=s) for s in (simd.EMIT, simd.HALF)]

        def runner(block):
            @njit
            def run(y, x, w, stage):
                block(y, np.uint64(0), x, x[::-1].copy(), w, None, stage, np.float32(0.3), np.float32(-0.2),
                      np.float32(0.01), np.float32(1.7))

            return run
    else:
        math = LN._y_vector if op == "layer" else RMS._y_vector(llama)
        blocks = [simd.forward_block(math, llama, stream, size=s) for s in (simd.EMIT, simd.HALF)]

        def runner(block):
            @njit
            def run(y, x, w, stage):
                block(y, np.uint64(0), x, w, w[::-1].copy(), stage, np.float32(0.25), np.float32(-1e-3),
                      np.float32(1.7))

            return run

    n = simd.EMIT
    values = torch.randn(n, generator=gen)
    x = values.bfloat16().view(torch.int16).numpy().view(np.uint16) if dtype == np.uint16 else values.numpy()
    w = (1 + 0.1 * torch.randn(n, generator=gen)).bfloat16().float().numpy()
    stage = memory.zero_stages(1)[0]
    sentinel = np.array(0x7FC1, np.uint16) if dtype == np.uint16 else np.float32(-7.0)
    # 64-byte aligned, as streamed stores need
    nbytes = 2 * n * x.itemsize
    outs = [memory._aligned(memory._raw(nbytes), nbytes).view(dtype)[:n] for _ in range(2)]
    for out, block in zip(outs, blocks):
        out[:] = sentinel
        runner(block)(out, x, w, stage)
    want, got = outs
    assert not np.array_equal(want[: simd.HALF], np.full(simd.HALF, sentinel, dtype))
    assert np.array_equal(got[: simd.HALF], want[: simd.HALF])
    assert np.array_equal(got[simd.HALF :], np.full(n - simd.HALF, sentinel, dtype))


def test_pair_order_is_undone_by_pair_unorder(gen):
    v = torch.randn(3 * 32 + 5, generator=gen).numpy()
    ordered = codecs.pair_order(v, 96)
    assert np.array_equal(ordered[:32], np.concatenate([v[0:32:2], v[1:32:2]]))  # evens, then odds
    assert np.array_equal(ordered[96:], v[96:])  # past the span: in place
    assert np.array_equal(codecs.pair_unorder(ordered, 96), v)


@njit
def _rows_plus_index(a, out):
    """out[r] = a[r] + r, every row read and written through rows.row_of."""
    for r in range(a.shape[0]):
        src, dst = rows.row_of(a, r), rows.row_of(out, r)
        for i in range(src.shape[0]):
            dst[i] = src[i] + r


def test_rows_of_a_matrix_are_its_rows_without_references():
    # rows.row_of builds the rows of a C-contiguous matrix itself, without a reference to its
    # memory (no runtime call a row): each must address its own row, for reads and writes, in
    # every dtype the kernels take; a matrix of another layout gets numba's a[r].
    for dtype in (np.float32, np.uint16, np.int16, np.float64):
        a = (np.arange(7 * 13) % 251).astype(dtype).reshape(7, 13)
        out = np.zeros_like(a)
        _rows_plus_index(a, out)
        assert np.array_equal(out, a + np.arange(7, dtype=dtype)[:, None]), dtype
    strided = np.arange(7 * 26, dtype=np.float32).reshape(7, 26)[:, ::2]
    out = np.zeros((7, 13), np.float32)
    _rows_plus_index(strided, out)
    assert np.array_equal(out, strided + np.arange(7, dtype=np.float32)[:, None])


def test_streamed_spans_are_aligned_blocks():
    x = torch.zeros(4, 1000).numpy()
    for r in range(4):
        row = x[r]
        a, b = rows.block_spans(row, 0, 1000, True)
        assert (row.ctypes.data + 4 * a) % 64 == 0 and 0 <= a < 16
        assert (b - a) % simd.EMIT == 0 and 1000 - b < simd.EMIT and b - a >= 14 * simd.EMIT
        assert rows.block_spans(row, 0, 1000, False) == (0, 960)  # blocks from the row's start
        a, b = rows.block_spans(row, 990, 1000, True)  # too short for a block: all plain
        assert a == b and 990 <= a <= 1000


def test_a_chunks_dw_and_db_partial_rows_sit_half_a_page_apart():
    # layer_norm's and DyT's backward load one partial row just after storing the other at the
    # same index: at the same address modulo 4 KiB the CPU stalls the load (4K aliasing), which
    # cost them 1.2-1.7x on two threads. Each chunk's two rows start 2 KiB apart modulo 4 KiB.
    for nchunks in (1, 2, 3):
        for d in (1, 100, 1024, 1025, 4096, 5000):
            parts = rows.partial_row_pairs(nchunks, d)
            assert parts.shape[0] == 2 * nchunks and parts.shape[1] >= d and not parts.any()
            for c in range(nchunks):
                gap = parts[2 * c + 1].ctypes.data - parts[2 * c].ctypes.data
                assert gap % 4096 == 2048, (nchunks, d, c)


def test_chunks_partial_rows_share_no_cache_line():
    # Each thread adds its rows' dw terms to its own chunk's float32 partial row, for every row:
    # two chunks' rows in one 64-byte line (numba aligns arrays to 32 bytes) made the threads
    # pass the line between them, and rms_norm's short-row backward ran at half speed in some
    # processes. What a chunk uses, [0, d), ends 128 bytes or more before the next chunk's row.
    for nchunks in (2, 3, 8):
        for d in (1, 8, 64, 96, 100, 1024, 1025):
            parts = rows.partial_rows(nchunks, d)
            assert parts.shape[0] == nchunks and parts.shape[1] >= d and not parts.any()
            for c in range(nchunks - 1):
                gap = parts[c + 1].ctypes.data - (parts[c].ctypes.data + 4 * d)
                assert gap >= 128, (nchunks, d, c, gap)
