"""The fused CPU (numba) backend against the float64 reference, outputs and every gradient.

The bound (normlab.testing): a fused result may be at most twice as far from the float64 truth
as the reference computed in the same low-precision dtype, plus about one rounding step.
"""

import json
import os
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from normlab import functional as F
from normlab import kernels, reference
from normlab.testing import assert_close

pytest.importorskip("numba", reason="the cpu backend needs numba (pip install normlab[cpu])")
from normlab.kernels.cpu import codecs, launch, memory, rows, simd  # noqa: E402
from normlab.kernels.cpu import layernorm as LN  # noqa: E402
from normlab.kernels.cpu import rmsnorm as RMS  # noqa: E402
from normlab.kernels import cpu  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_a_numba_older_than_the_kernels_need_is_named_in_the_reason():
    assert kernels._too_old("numba", "0.68.1") is None and kernels._too_old("numba", "1.0") is None
    reason = kernels._too_old("numba", "0.59.0")
    assert "numba 0.59.0" in reason and ">=0.68" in reason
    assert kernels._too_old("triton", "2.0") is None  # no floor set


def test_cpu_backend_is_what_auto_picks_for_cpu_tensors():
    assert kernels.unavailable_reason("cpu") is None
    assert kernels.resolve(None, torch.device("cpu")) == "cpu"


def _leaves(gen, op, shape, dtype, *, weight=True, bias=True, res_dtype=None, mean=0.0, scale=1.0):
    d = shape[-1]
    x = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + mean).to(dtype)
    leaves = {"x": x}
    if op.startswith("add"):
        leaves["residual"] = torch.randn(*shape, generator=gen, dtype=torch.float64).to(res_dtype or dtype)
    if weight:
        leaves["weight"] = (1 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)).to(dtype)
    if bias and "layer" in op:
        leaves["bias"] = torch.randn(d, generator=gen, dtype=torch.float64).to(dtype)
    return leaves


def _call(op, leaves, opts, backend):
    fn = getattr(F, op)
    args = [leaves["x"]]
    if op.startswith("add"):
        args.append(leaves["residual"])
    args.append(leaves.get("weight"))
    if "layer" in op:
        args.append(leaves.get("bias"))
    out = fn(*args, backend=backend, **opts)
    return out if isinstance(out, tuple) else (out,)


def _run(op, leaves, opts, backend, grads, convert=None):
    leaves = {k: (convert(v) if convert else v.clone()).requires_grad_() for k, v in leaves.items()}
    outs = _call(op, leaves, opts, backend)
    names = list(leaves)
    gs = torch.autograd.grad(outs, [leaves[n] for n in names], [g.to(o.dtype) for g, o in zip(grads, outs)])
    return outs, dict(zip(names, gs))


def check(gen, op, shape, dtype, opts=None, backend="cpu", leaves=None, **leaf_kw):
    """Outputs and all gradients of ``op`` on ``backend`` against the float64 reference (the
    triton tests use it too). ``leaves`` replaces the random inputs."""
    opts = opts or {}
    leaves = leaves or _leaves(gen, op, shape, dtype, **leaf_kw)
    with torch.no_grad():
        outs = _call(op, leaves, opts, "reference")
    # Output gradients in the outputs' dtypes, so the float64 truth sees the very same values.
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
    fast, fast_g = _run(op, leaves, opts, backend, grads)
    lowp, lowp_g = _run(op, leaves, opts, "reference", grads)
    if op.startswith("add"):
        truth, truth_g = _add_truth(op, leaves, opts, grads, lowp[1])
    else:
        truth, truth_g = _run(op, leaves, opts, "reference", grads, convert=lambda t: t.double())
    out_mag = _output_terms(op, leaves, lowp)
    for i, (f, t, lp) in enumerate(zip(fast, truth, lowp)):
        assert f.dtype == lp.dtype and f.shape == lp.shape
        assert_close(f, t, lowp=lp, dtype=lp.dtype, name=f"{op} output {i}", magnitude=out_mag if i == 0 else None)
    mag = _grad_terms(op, leaves, opts, grads[0])
    for name in fast_g:
        if name in ("weight", "bias"):
            assert_close(fast_g[name], truth_g[name], lowp=lowp_g[name], dtype=leaves[name].dtype, name=f"{op} d{name}",
                         rule="tensor", magnitude=_param_grad_terms(op, leaves, opts, grads[0], name))
        else:
            assert_close(fast_g[name], truth_g[name], lowp=lowp_g[name], dtype=leaves[name].dtype, name=f"{op} d{name}",
                         rule="row", magnitude=mag)
    return fast, fast_g


def _output_terms(op, leaves, lowp):
    """LayerNorm's x - mean cancels for rows of close values: its output error scales with
    (|x| + |mean|) * rstd * |w|, not with the output (see assert_close's ``magnitude``)."""
    if "layer" not in op:
        return None
    x = lowp[1].double() if op.startswith("add") else leaves["x"].double()
    centred = x - x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)
    w = leaves["weight"].double().abs() if "weight" in leaves else 1.0
    return (x.abs() + x.mean(-1, keepdim=True).abs()) * rstd * w


def _normalized(op, leaves, opts):
    """xhat and rstd in float64, of the sum for the add ops."""
    x = leaves["x"].double()
    if op.startswith("add"):
        x = x + leaves["residual"].double()
    if "layer" in op:
        x = x - x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    else:
        k = reference.partial_size(x.shape[-1], opts.get("partial"))
        rstd = torch.rsqrt(x[..., :k].pow(2).mean(-1, keepdim=True) + 1e-6)
    return x * rstd, rstd


def _grad_terms(op, leaves, opts, dy):
    """|rstd * dy * w|: the size of the terms a norm's input gradient is a difference of (see
    normlab.testing.assert_close's ``magnitude``)."""
    rstd = _normalized(op, leaves, opts)[1]
    w = leaves["weight"].double() + opts.get("offset", 0.0) if "weight" in leaves else 1.0
    return (rstd * dy.double() * w).abs()


def _param_grad_terms(op, leaves, opts, dy, name):
    """The sum over rows of |dy * xhat| (|dy| for the bias): the size of the terms a weight
    gradient adds up. The llama cast rounds xhat to the input's dtype before the weight sees it,
    so each term carries up to half a rounding step of its own size, and where the terms cancel
    the float64 truth can sit that far from a correct kernel."""
    dy = dy.double()
    terms = dy if name == "bias" else dy * _normalized(op, leaves, opts)[0]
    return terms.abs().reshape(-1, terms.shape[-1]).sum(0)


def _add_truth(op, leaves, opts, grads, s_lowp):
    """The float64 truth of a fused add + norm. The sum is part of the op's definition: it is
    rounded to its dtype (it is the residual stream the model carries on), so the truth
    normalizes that rounded sum in float64; the gradient reaching x and residual is the norm's
    gradient plus the sum's own."""
    norm = op[len("add_"):]
    s64 = s_lowp.detach().double().requires_grad_()
    params = {k: leaves[k].double().requires_grad_() for k in ("weight", "bias") if k in leaves}
    kw = {k: v for k, v in opts.items() if k != "residual_in_fp32"}
    args = [s64, params.get("weight")] + ([params.get("bias")] if "layer" in op else [])
    y = getattr(F, norm)(*args, backend="reference", **kw)
    dy, ds = grads
    y.backward(dy.double())
    dsum = s64.grad + ds.double()
    g = {"x": dsum, "residual": dsum}
    g.update({k: p.grad for k, p in params.items()})
    return (y, s64.detach()), g


OPS = ["rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 3, 123, 3000])
@pytest.mark.parametrize("op", OPS)
def test_every_op_dtype_and_size(gen, op, dtype, d):
    check(gen, op, (7, d), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [3, 123])
@pytest.mark.parametrize("op", ["rms_norm", "add_layer_norm"])
def test_the_weight_gradient_bound_catches_a_dropped_row(gen, op, d, dtype, monkeypatch):
    # The bound grows with the sum of the terms' sizes; a kernel that leaves out a row of them
    # must still fail it. The row holding the largest term: at 3 features a row of three tiny
    # terms hides under the bound about once in a thousand draws.
    run = _run

    def dropping_a_row(op, leaves, opts, backend, grads, convert=None):
        outs, g = run(op, leaves, opts, backend, grads, convert)
        if backend == "cpu":
            terms = grads[0].double() * _normalized(op, leaves, opts)[0]
            row = terms.abs().amax(-1).argmax()
            g["weight"] = (g["weight"].double() - terms[row]).to(g["weight"].dtype)
        return outs, g

    monkeypatch.setitem(globals(), "_run", dropping_a_row)  # check looks _run up in this module
    with pytest.raises(AssertionError, match="dweight"):
        check(gen, op, (7, d), dtype)


@pytest.mark.parametrize("op", OPS)
def test_a_row_of_65537_features(gen, op):
    for dtype in (torch.float32, torch.bfloat16):
        check(gen, op, (3, 65537), dtype)


@pytest.mark.parametrize("lead", [(0,), (1,), (2, 3, 5)], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_leading_dims(gen, op, lead):
    check(gen, op, (*lead, 40), torch.bfloat16)


RMS_OPTIONS = [
    {"eps_mode": "outside"},
    {"cast": "gemma"},
    {"cast": "gemma", "offset": 1.0},
    {"cast": "llama", "offset": 1.0},
    {"partial": 0.0625},
    {"partial": 0.3, "eps_mode": "outside", "cast": "gemma"},
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opts", RMS_OPTIONS, ids=str)
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_rms_options(gen, op, opts, dtype):
    check(gen, op, (9, 160), dtype, opts)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_without_weight_or_bias(gen, op, dtype):
    check(gen, op, (5, 77), dtype, weight=False, bias=False)
    if "layer" in op:
        check(gen, op, (5, 77), dtype, weight=True, bias=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["add_rms_norm", "add_layer_norm"])
def test_residual_in_fp32_and_mixed_residual_dtype(gen, op, dtype):
    fast, _ = check(gen, op, (6, 96), dtype, {"residual_in_fp32": True})
    assert fast[0].dtype == dtype and fast[1].dtype == torch.float32
    fast, _ = check(gen, op, (6, 96), dtype, res_dtype=torch.float32)  # an fp32 residual stream
    assert fast[1].dtype == torch.float32


def test_fp32_weights_on_bf16_activations(gen):
    x = torch.randn(8, 64, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(64, generator=gen).requires_grad_()  # mixed precision: master weights in fp32
    y = F.rms_norm(x, w, backend="cpu")
    truth = F.rms_norm(x.double(), w.double(), backend="reference")
    assert y.dtype == torch.bfloat16
    assert_close(y, truth, lowp=F.rms_norm(x, w, backend="reference"), dtype=torch.bfloat16)
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_float64_runs_the_reference(gen):
    x = torch.randn(4, 33, generator=gen, dtype=torch.float64)
    assert torch.equal(F.rms_norm(x, backend="cpu"), F.rms_norm(x, backend="reference"))


def test_fused_dtypes_do_not_fall_back_to_the_reference(gen, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the reference ran")

    for name in ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm"):
        monkeypatch.setattr(reference, name, boom)
    x = torch.randn(4, 16, generator=gen).bfloat16()
    F.rms_norm(x, backend="cpu"), F.layer_norm(x, backend="cpu")
    F.add_rms_norm(x, x, backend="cpu"), F.add_layer_norm(x, x, backend="cpu")


def test_non_contiguous_inputs(gen):
    base = torch.randn(6, 2, 80, generator=gen)
    for x in (base[:, 0], base.transpose(0, 1), base[..., ::2], base[::2, :, 10:70]):
        assert not x.is_contiguous()
        w = torch.randn(x.shape[-1], generator=gen)
        assert_close(F.rms_norm(x, w, backend="cpu"), F.rms_norm(x.double(), w.double()), lowp=F.rms_norm(x, w, backend="reference"), dtype=torch.float32)
        assert_close(F.layer_norm(x, w, w, backend="cpu"), F.layer_norm(x.double(), w.double(), w.double()), lowp=F.layer_norm(x, w, w, backend="reference"), dtype=torch.float32)
        y, s = F.add_rms_norm(x, x.flip(-1), w, backend="cpu")
        assert torch.equal(s, x + x.flip(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_of_zeros_give_zeros(dtype):
    x = torch.zeros(3, 50, dtype=dtype, requires_grad=True)
    w = torch.randn(50).to(dtype)
    for fn in (lambda: F.rms_norm(x, w, backend="cpu"), lambda: F.rms_norm(x, w, eps_mode="outside", backend="cpu"),
               lambda: F.layer_norm(x, w, None, backend="cpu"), lambda: F.add_rms_norm(x, x, w, backend="cpu")[0]):
        y = fn()
        assert torch.equal(y, torch.zeros_like(y))
        (g,) = torch.autograd.grad(y.float().sum(), x)
        # rstd = 1/eps outside the root: that gradient is 1e6 * w, which overflows fp16 to inf,
        # as the true value should; it must never be nan.
        assert not torch.isnan(g).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_mean_rows(gen, dtype):
    mean = 1e4 if dtype != torch.float16 else 1e3
    check(gen, "layer_norm", (8, 1000), dtype, mean=mean)
    check(gen, "rms_norm", (8, 1000), dtype, mean=mean)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_rows_whose_first_block_is_unlike_the_rest(gen, op, dtype):
    # LayerNorm's statistics are one pass over sums shifted by the mean of the row's first block
    # of 256; where that block sits far from the rest (a shifted mean much larger than the
    # spread), E[u^2] - E[u]^2 would cancel, and the kernel must take its second pass instead.
    # Long rows: the first block's offset adds to the variance too, so E[u]^2 / var is at most
    # d / 256 (64 here: without the second pass the saved rstd of the 300-offset row was off by
    # 4.5e-7 to 8e-7, 4 to 7 ulps, its outputs by 8x torch's error; with it, under an ulp).
    leaves = _leaves(gen, op, (6, 16384), dtype)
    x = leaves["x"].double()
    x[:, :256] += torch.tensor([30.0, -30.0, 300.0, 3.0, 1.0, 0.0]).view(6, 1)
    leaves["x"] = x.to(dtype)
    check(gen, op, None, dtype, leaves=leaves)
    res = leaves.get("residual")
    _, s, mean, rstd = launch.ln_fwd_launch(leaves["x"], None, None, 1e-5, residual=res)
    row = (s if res is not None else leaves["x"]).double()
    true_rstd = torch.rsqrt(row.var(-1, unbiased=False) + 1e-5)
    assert torch.allclose(mean, row.mean(-1), rtol=0, atol=1e-6 * row.abs().max().item())
    assert ((rstd.double() - true_rstd).abs() / true_rstd).max() < 2 * 2.0**-23  # 1 to 2 ulps


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_streaming_stores_give_the_same_bits(gen, op, dtype, monkeypatch):
    # Large outputs are written with non-temporal stores (16-bit ones two vectors to a line); the
    # values must be those of the plain path, bit for bit, whatever the alignment of the rows
    # (d = 1000: every row of a float32 output starts at a different offset from a 64-byte
    # boundary).
    leaves = _leaves(gen, op, (37, 1000), dtype)
    runs = []
    for min_bytes in (1 << 62, 0):
        monkeypatch.setattr(launch, "STREAM_MIN_BYTES", min_bytes)
        grads = torch.Generator().manual_seed(7)
        runs.append(_run(op, leaves, {}, "cpu", [torch.randn(leaves["x"].shape, generator=grads).to(dtype)] * 2))
    (plain, plain_g), (streamed, streamed_g) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain, streamed))
    assert all(torch.equal(plain_g[k], streamed_g[k]) for k in plain_g)


def test_shared_staging_rows_stay_zero_and_aligned(gen, monkeypatch):
    # The launchers share one set of staging rows per chunk count between calls and threads
    # (memory._zero_stages), and the streamed 16-bit stores read a line of zeros from them. A kernel
    # that wrote there would corrupt every later call: run every op forward and backward, plain
    # and streamed, in every dtype, then look.
    shape = (37, 1000)
    for min_bytes in (1 << 62, 0):
        monkeypatch.setattr(launch, "STREAM_MIN_BYTES", min_bytes)
        for op in OPS:
            for dtype in DTYPES:
                leaves = _leaves(gen, op, shape, dtype)
                grads = [torch.randn(shape, generator=gen).to(dtype)] * 2
                _run(op, leaves, {}, "cpu", grads)
    stages = memory._zero_stages(launch.nchunks(shape[0]))
    assert stages.shape[0] == launch.nchunks(shape[0]) and not stages.any()
    assert stages.ctypes.data % 64 == 0


def _special_floats(gen, n):
    """float32 values where conversions go wrong: ties at bf16 and fp16 precision, values that
    round up to the next binade or overflow, signed zeros, infinities, then random ones."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F80_8001, 0x7F7F_FFFF, 0x7F7F_8000, 0x477F_F000,
                         0x3F80_1000, 0x3F80_3000, 0x0, 0x8000_0000, 0x7F80_0000, 0xFF80_0000], dtype=torch.int64)
    special = bits.to(torch.int32).view(torch.float32)
    special = torch.cat([special, -special])
    rest = torch.randn(n - special.numel(), generator=gen) * torch.logspace(-30, 30, n - special.numel())
    return torch.cat([special, rest]).numpy()


@pytest.mark.parametrize("nt", [False, True], ids=["stored", "streamed"])
@pytest.mark.parametrize("path", ["kernels", "integer-bf16"] if simd.HW_BF16 else ["kernels"])
@pytest.mark.parametrize("llama", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_conversions_match_the_scalar_ones(gen, dtype, llama, path, nt):
    # Output blocks are converted as explicit vectors (_emit: the CPU's bf16 instruction where
    # it has one, else integer rounding, which "integer-bf16" checks on such a CPU too; streamed
    # 16-bit blocks convert two vectors at a time, into whole lines); heads and tails of rows by
    # the scalar _store. Both must give the same bits on everything a normalized row can hold.
    from numba import njit

    src = _special_floats(gen, simd.EMIT)
    stage = np.zeros(simd.STAGE_WIDTH, np.float32)  # a staging row, as the launchers make them
    w = (torch.randn(simd.EMIT, generator=gen) * 3).numpy()
    code = launch._NP_CODE[dtype]
    nbytes = simd.EMIT * np.dtype(code).itemsize
    vec = memory._aligned(memory._raw(nbytes), nbytes).view(code)  # streamed stores need 64-byte alignment
    scalar = np.zeros(simd.EMIT, code)
    emit = (simd._EMIT if path == "kernels" else simd._EMIT_INTEGER_BF16)[llama, nt]

    @njit
    def by_vectors(dst, src, w):
        emit(dst, np.uint64(0), src, w)
        simd._store_fence()

    @njit
    def by_scalars(dst, src, w):
        for i in range(src.shape[0]):
            v = codecs._round_like(dst, src[i]) * w[i] if llama else src[i]
            codecs._store(dst, i, v)

    stage[: simd.EMIT] = src
    by_vectors(vec, stage, w)
    by_scalars(scalar, src, w)
    assert np.array_equal(vec, scalar)
    if dtype != torch.float32:  # a nan stays a nan (its bits may differ: see codecs.py)
        stage[: simd.EMIT] = np.nan
        by_vectors(vec, stage, w)
        widened = torch.from_numpy(vec.view(np.int16)).view(dtype).float()
        assert torch.isnan(widened).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vector_row_sums_match_float64(gen, dtype):
    # Pass 1's sums over whole blocks are explicit vector loops (bf16 read two values to a 32-bit
    # lane, in another order than the row's); they must be the float64 sums of the row's values
    # to float32 accuracy, and stop at the given number of values.
    from numba import njit

    @njit
    def sums(row, n, c):
        return simd._row_moments(row, n, c, row, None), simd._row_sumsq(row, n, c, row, None)

    x = (torch.randn(3 * simd.BLOCK + 7, generator=gen) * 2 + 5).to(dtype)
    row = memory._as_numpy(x)
    c = np.float32(4.5)
    for blocks in (0, 1, 3):
        n = blocks * simd.BLOCK
        (s1, s2), (ss, zero) = sums(row, n, c)
        v = x[:n].double()
        u = v - float(c)
        assert zero == 0.0
        for got, want, scale in ((s1, u.sum(), u.abs().sum()), (s2, (u * u).sum(), (u * u).sum()), (ss, (v * v).sum(), (v * v).sum())):
            assert abs(got - want.item()) <= 1e-6 * max(scale.item(), 1e-30), (blocks, got, want)


@pytest.mark.parametrize("op", ["ln", "rms", "rms_llama"])
def test_backward_pair_order_sums_match_float64(gen, op):
    # The bf16 backward's first pass reads rows two values to a 32-bit lane, so it reads the
    # weight, and adds the dw (db) terms, in pair order (simd.pair_order): its sums must be the
    # float64 ones, and its partial rows, put back in place, the float64 terms of each element.
    from numba import njit

    ln_sums = LN._GRAD_SUMS[1]

    @njit
    def ln_pass(dy, x, wp, dwc, dbc, n, mhi, rstd, lo):
        return ln_sums(dy, x, wp, dwc, dbc, n, mhi, rstd, lo)

    @njit
    def rms_pass(dy, x, wp, dwc, rnd, n, rstd):
        return RMS._rms_blocks(dy, wp, wp, x, n, dwc, rstd, rnd, True)  # the first wp: not read (bf16)

    d = 3 * simd.BLOCK + 7
    x, dy = ((torch.randn(d, generator=gen) * s + m).to(torch.bfloat16) for s, m in ((2, 5), (1, 0)))
    w = torch.randn(d, generator=gen).numpy()
    mean, rstd = 4.75, np.float32(0.6)
    for blocks in (0, 1, 3):
        n = blocks * simd.BLOCK
        v, g = x[:n].double(), dy[:n].double()
        wn = torch.from_numpy(w[:n]).double()
        dwc, dbc = np.zeros(d, np.float32), np.zeros(d, np.float32)
        wp = simd.pair_order(w, n)
        if op == "ln":
            mhi, mlo = np.float32(mean), np.float32(0.0)
            lo = np.float32(-float(mlo) * rstd)
            got = ln_pass(memory._as_numpy(dy), memory._as_numpy(x), wp, dwc, dbc, n, mhi, rstd, lo)
            xhat = (v - mean) * float(rstd)
            want = ((g * wn).sum(), (g * wn * xhat).sum())
            assert np.allclose(simd.pair_unorder(dbc, n)[:n], g.numpy(), rtol=1e-6, atol=0)
        else:
            rnd = launch._rnd(torch.bfloat16, op == "rms_llama")
            got = rms_pass(memory._as_numpy(dy), memory._as_numpy(x), wp, dwc, rnd, n, rstd)
            xhat = v * float(rstd)
            if op == "rms_llama":  # x * rstd rounded to bf16 before the multiply
                xhat = (v.float() * rstd).to(torch.bfloat16).double()
            want = ((g * wn * v).sum(), (v * v).sum())
        for got_sum, want_sum in zip(got, want):
            assert abs(got_sum - want_sum.item()) <= 1e-5 * max(abs(want_sum.item()), 1.0), (op, blocks, got, want)
        assert np.allclose(simd.pair_unorder(dwc, n)[:n], (g * xhat).numpy(), rtol=1e-5, atol=1e-6)
        assert not dwc[n:].any()  # and nothing past n


@pytest.mark.parametrize("op", ["ln", "rms", "rms_squares", "rms_llama"])
def test_first_pass_over_a_row_pair_is_bitwise_two_single_rows(gen, op):
    # Wide bf16 rows go through the backward's first pass two at a time (_make_grad_sums,
    # rows=2): the sums of each row and the partial rows it adds to must be the very bits that
    # two passes of one row give, so a row's gradient does not depend on its neighbour.
    from numba import njit

    if op == "ln":
        one, two = LN._GRAD_SUMS[1], LN._GRAD_SUMS[2]
    else:
        one, two = (RMS._GRAD_SUMS[op == "rms_llama", op == "rms_squares", rows] for rows in (1, 2))

    @njit
    def single(dy, x, dy2, x2, wp, dwc, aux, n, c, e):
        return one(dy, x, wp, dwc, aux, n, c[0], c[1], c[2]) + one(dy2, x2, wp, dwc, aux, n, e[0], e[1], e[2])

    @njit
    def pair(dy, x, dy2, x2, wp, dwc, aux, n, c, e):
        return two(dy, x, dy2, x2, wp, dwc, aux, n, c[0], c[1], c[2], e[0], e[1], e[2])

    d = 3 * simd.BLOCK + 7
    rows = [memory._as_numpy((torch.randn(d, generator=gen) * 3 + 2).to(torch.bfloat16)) for _ in range(4)]
    wp = simd.pair_order(torch.randn(d, generator=gen).numpy(), 3 * simd.BLOCK)
    c, e = (np.array([m, s, lo], np.float32) for m, s, lo in ((2.0, 0.4, -0.01), (1.5, 0.7, 0.02)))
    start = torch.randn(2, d, generator=gen).numpy()  # partial rows that already hold sums
    results = []
    for run in (single, pair):
        part = start.copy()
        aux = part[1] if op == "ln" else launch._rnd(torch.bfloat16, op == "rms_llama")
        sums = run(*rows, wp, part[0], aux, 3 * simd.BLOCK, c, e)
        results.append((np.array(sums), part))
    (s1, p1), (s2, p2) = results
    assert s1.tobytes() == s2.tobytes(), (s1, s2)
    assert p1.tobytes() == p2.tobytes()
    assert not np.array_equal(p1, start)  # the terms were added
    assert np.array_equal(p1[:, 3 * simd.BLOCK :], start[:, 3 * simd.BLOCK :])  # and nothing past n


@pytest.mark.parametrize("op", OPS)
def test_wide_bf16_rows_in_pairs(gen, op):
    # From rows.PAIR_ROWS_MIN values a row, the bf16 backward takes rows two at a time (a chunk's
    # odd row alone): gradients against float64, and each row's input gradient bitwise the one
    # it gets alone, which goes through the single-row path.
    d = rows.PAIR_ROWS_MIN + 37
    options = [{}] if "layer" in op else [{}, {"eps_mode": "outside", "cast": "gemma"}, {"partial": 0.75}]
    for opts in options:
        check(gen, op, (7, d), torch.bfloat16, opts)
        leaves = _leaves(gen, op, (7, d), torch.bfloat16)
        outs = _call(op, leaves, opts, "cpu")
        grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
        _, together = _run(op, leaves, opts, "cpu", grads)
        for r in (0, 3, 6):
            alone_leaves = {k: (v[r : r + 1] if v.dim() == 2 else v) for k, v in leaves.items()}
            _, alone = _run(op, alone_leaves, opts, "cpu", [g[r : r + 1] for g in grads])
            assert torch.equal(together["x"][r : r + 1], alone["x"]), (opts, r)


def test_pair_order_is_undone_by_pair_unorder(gen):
    v = torch.randn(3 * 32 + 5, generator=gen).numpy()
    ordered = simd.pair_order(v, 96)
    assert np.array_equal(ordered[:32], np.concatenate([v[0:32:2], v[1:32:2]]))  # evens, then odds
    assert np.array_equal(ordered[96:], v[96:])  # past the span: in place
    assert np.array_equal(simd.pair_unorder(ordered, 96), v)


def test_streamed_spans_are_aligned_blocks():
    x = torch.zeros(4, 1000).numpy()
    for r in range(4):
        row = x[r]
        a, b = rows._spans(row, 0, 1000, True)
        assert (row.ctypes.data + 4 * a) % 64 == 0 and 0 <= a < 16
        assert (b - a) % simd.EMIT == 0 and 1000 - b < simd.EMIT and b - a >= 14 * simd.EMIT
        assert rows._spans(row, 0, 1000, False) == (0, 960)  # blocks from the row's start
        a, b = rows._spans(row, 990, 1000, True)  # too short for a block: all plain
        assert a == b and 990 <= a <= 1000


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_non_finite_rows_stay_in_their_row(gen, op, dtype, bad):
    leaves = _leaves(gen, op, (6, 37), dtype)
    leaves["x"][3, 5] = bad
    x = leaves["x"].requires_grad_()
    outs = _call(op, leaves, {}, "cpu")
    good = [0, 1, 2, 4, 5]
    # rows are independent: the good rows come out bitwise as if the bad row were not there
    alone = _call(op, {k: (v[good].detach() if v.dim() == 2 else v) for k, v in leaves.items()}, {}, "cpu")
    for o, r in zip(outs, alone):
        assert torch.isfinite(o[good]).all()
        assert not torch.isfinite(o[3]).all()
        assert torch.equal(o[good], r)
    (g,) = torch.autograd.grad(outs[0].float().sum(), x)
    assert torch.isfinite(g[good]).all()


def check_deterministic_weight_grads(gen, op, shape, backend="cpu"):
    """The weight gradient of ``op`` is bitwise the same over three runs (the triton tests use it)."""
    x = torch.randn(*shape, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(shape[-1], generator=gen).requires_grad_()
    dy = torch.randn(*shape, generator=gen).bfloat16()
    results = []
    for _ in range(3):
        w.grad = None
        getattr(F, op)(x, w, backend=backend).backward(dy)
        results.append(w.grad.clone())
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_weight_gradients_are_bitwise_deterministic(gen, op):
    check_deterministic_weight_grads(gen, op, (300, 257))


def test_threads_follow_torch():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert launch.nchunks(1000) == 1
        import numba

        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert launch.nchunks(1000) == min(before, launch.numba.config.NUMBA_NUM_THREADS)


def test_out_writes_into_the_given_tensor(gen):
    x = torch.randn(16, 64, generator=gen).bfloat16()
    w = torch.randn(64, generator=gen).bfloat16()
    out = torch.empty_like(x)
    assert F.rms_norm(x, w, out=out, backend="cpu") is out
    assert torch.equal(out, F.rms_norm(x, w, backend="cpu"))
    assert F.layer_norm(x, w, w, out=out, backend="cpu") is out
    assert torch.equal(out, F.layer_norm(x, w, w, backend="cpu"))
    with pytest.raises(ValueError, match=r"out has shape \(16, 32\).*expected \(16, 64\)"):
        F.rms_norm(x, out=torch.empty(16, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="out= does not support autograd"):
        F.rms_norm(x.requires_grad_(), out=out)


def test_cache_status_reports_every_kernel():
    status = cpu.cache_status()
    assert set(status["kernels"]) == {k.__name__ for k in cpu.KERNELS}
    assert status["warm"] == all(status["kernels"].values())


def test_every_file_with_numba_code_is_in_the_cache_key():
    # cache.SOURCES decides which edits recompile the kernels: a file of jitted helpers left out
    # of it would let an edit there reach no kernel until the cache is cleared.
    import re

    from normlab.kernels.cpu import cache

    jitted = re.compile(r"^@(njit|intrinsic|overload|kernel)\b|= (intrinsic|forward_block|backward_block|grad_sums)\(", re.M)
    folder = Path(cache.__file__).parent
    with_code = {p.name for p in folder.glob("*.py") if jitted.search(p.read_text())}
    assert with_code and with_code <= set(cache.SOURCES), with_code - set(cache.SOURCES)
    assert all((folder / name).exists() for name in cache.SOURCES)


_CACHE_PROBE = """
import torch
from normlab import functional as F
from normlab.kernels.cpu import rmsnorm
y = F.rms_norm(torch.linspace(-1, 1, 64 * 32).view(64, 32), backend="cpu")
stats = rmsnorm.rms_fwd.stats
print(sum(stats.cache_hits.values()), sum(stats.cache_misses.values()), float(y.abs().sum()))
"""


def test_a_changed_helper_recompiles_the_kernels_that_inline_it(tmp_path):
    # numba keys its cache by the defining file alone; rms_fwd inlines _recip from rows.py, so
    # with numba's own key an edit to _recip would be served stale from the cache.
    import shutil
    import subprocess
    import sys

    src = tmp_path / "src"
    shutil.copytree(Path(cpu.__file__).parents[2], src / "normlab", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(src), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}

    said = []

    def probe():
        done = subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        said.append(done.stderr)
        hits, misses, total = done.stdout.split()
        return int(hits), int(misses), float(total)

    hits, misses, first = probe()
    assert misses == 1 and hits == 0  # cold: compiled
    # and said so, once, with what to do about it (a first call blocked for seconds silently)
    assert said[-1].count("normlab: compiling the fused CPU kernels") == 1 and "normlab warmup" in said[-1]
    hits, misses, again = probe()
    assert hits == 1 and misses == 0 and again == first  # warm: from the cache
    assert "compiling" not in said[-1]
    rows = src / "normlab" / "kernels" / "cpu" / "rows.py"
    text = rows.read_text()
    assert "np.float32(1.0 / x)" in text
    rows.write_text(text.replace("np.float32(1.0 / x)", "np.float32(2.0 / x)"))
    hits, misses, changed = probe()
    assert misses == 1 and hits == 0
    assert changed == pytest.approx(2 * first, rel=1e-6)  # the edit reached the kernel


# --------------------------------------------------------------------------- torch.compile


class _Block(torch.nn.Module):
    """A small decoder-style stack of normlab norms around linear layers."""

    def __init__(self, d):
        super().__init__()
        import normlab

        self.n1 = normlab.RMSNorm(d)
        self.n2 = normlab.LayerNorm(d)
        self.n3 = normlab.RMSNorm(d, cast="gemma", offset=1.0, partial=0.25)
        self.f1 = torch.nn.Linear(d, d)
        self.f2 = torch.nn.Linear(d, d)

    def forward(self, x):
        h = x + self.f1(self.n1(x))
        y, h = F.add_rms_norm(self.f2(self.n2(h)), h, self.n1.weight)
        y2, h = F.add_layer_norm(y, h, self.n2.weight, self.n2.bias)
        return self.n3(h + y2)


def test_compiled_stack_matches_eager_with_no_graph_break(gen):
    torch.manual_seed(gen.initial_seed() % 2**31)
    m = _Block(32)
    x = torch.randn(2, 5, 32, generator=gen, requires_grad=True)
    eager = m(x)
    (gx_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")  # fullgraph: a break is an error
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert torch.allclose(out, eager, atol=1e-6) and torch.allclose(gx, gx_eager, atol=1e-6)
    explain = torch._dynamo.explain(m)(x)
    assert explain.graph_break_count == 0
    ops = {str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("normlab.cpu_rms_norm" in o for o in ops), ops


def test_compiles_fullgraph_with_dynamic_shapes(gen):
    """dynamic=True makes float attributes such as eps symbolic; the argument checks must not
    graph-break on them, and the rows may change without a recompile per shape."""
    torch.manual_seed(gen.initial_seed() % 2**31)
    m = _Block(32)
    compiled = torch.compile(m, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (3, 7):
        x = torch.randn(2, rows, 32, generator=gen)
        assert torch.allclose(compiled(x), m(x), atol=1e-6)


# ---------------------------------------------------------------------- property-based tests


@settings(max_examples=40, deadline=None)
@given(
    op=st.sampled_from(OPS),
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(0, 9),
    d=st.integers(1, 300),
    partial=st.one_of(st.none(), st.floats(0.01, 1.0)),
    eps_mode=st.sampled_from(["inside", "outside"]),
    cast=st.sampled_from(["llama", "gemma"]),
    weight=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_properties(op, dtype, rows, d, partial, eps_mode, cast, weight, seed):
    gen = torch.Generator().manual_seed(seed)
    opts = {"eps_mode": eps_mode, "cast": cast, "partial": partial} if "rms" in op else {}
    check(gen, op, (rows, d), dtype, opts, weight=weight)


# ----------------------------------------------------------------------------- output buffers


def test_buffer_pool_reuses_only_unreferenced_buffers():
    pool = memory.BufferPool(max_bytes=64 << 20, min_bytes=0)
    a = pool.take(1 << 20)
    b = pool.take(1 << 20)
    assert a.ctypes.data != b.ctypes.data  # a is still held
    addr = a.ctypes.data
    del a
    c = pool.take(1 << 20)
    assert c.ctypes.data == addr  # a's buffer came back
    view = torch.from_numpy(c.view(np.float32))[3:]  # a tensor view keeps it held
    del c
    assert pool.take(1 << 20).ctypes.data != addr
    del view
    assert pool.take(1 << 20).ctypes.data == addr
    assert pool.stats()["buffers"] == 3


def test_buffer_pool_respects_its_cap():
    pool = memory.BufferPool(max_bytes=3 << 20, min_bytes=0)
    held = [pool.take(1 << 20) for _ in range(5)]  # beyond the cap: served, not pooled
    assert pool.stats()["held_bytes"] == 3 << 20
    del held
    pool.take(2 << 20)  # evicts free 1 MiB buffers to make room
    assert pool.stats()["held_bytes"] <= 3 << 20
    pool.clear()
    assert pool.stats()["held_bytes"] == 0


def test_outputs_from_the_pool_are_not_overwritten_while_alive(gen):
    x = torch.randn(512, 1024, generator=gen)
    y1 = F.rms_norm(x, backend="cpu")
    keep = y1.clone()
    y2 = F.rms_norm(x * 2, backend="cpu")  # must not land in y1's buffer
    assert y1.data_ptr() != y2.data_ptr() and torch.equal(y1, keep)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_forward_is_batch_invariant(gen, op, dtype):
    # a row's output does not depend on how many rows share the call (chunk boundaries move)
    leaves = _leaves(gen, op, (9, 300), dtype)
    full = _call(op, leaves, {}, "cpu")
    for picked in ([4], [0, 8], [2, 3, 4, 5, 6]):
        part = _call(op, {k: (v[picked] if v.dim() == 2 else v) for k, v in leaves.items()}, {}, "cpu")
        assert all(torch.equal(f[picked], p) for f, p in zip(full, part)), picked


@pytest.mark.parametrize("name, value", [("NORMLAB_CPU_POOL_MB", "lots"), ("NORMLAB_CPU_STREAM_MB", "-4"),
                                         ("NORMLAB_CPU_ALLOC", "malloc")])
def test_a_bad_environment_setting_names_its_variable(name, value):
    import subprocess
    import sys

    code = "import torch, normlab; normlab.rms_norm(torch.randn(2, 8), backend='cpu')"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, name: value}, capture_output=True, text=True)
    assert out.returncode != 0 and f"environment variable {name} must be" in out.stderr, out.stderr[-500:]


@pytest.mark.parametrize("how", ["torch.set_num_threads(1)", "OMP_NUM_THREADS=1"])
def test_the_first_kernel_call_leaves_torchs_thread_count_and_gradients_alone(how):
    """numba's OpenMP layer resets the process's thread count when it starts; a fresh process
    checks that torch's count is still the user's after the first call, and that the first
    call's weight gradient is bitwise that of later calls."""
    import subprocess
    import sys

    code = (
        "import torch, normlab\n"
        + ("torch.set_num_threads(1)\n" if how.startswith("torch") else "")
        + "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(512, 1000, generator=g); dy = torch.randn(512, 1000, generator=g)\n"
        "grads = []\n"
        "for _ in range(3):\n"
        "    w = torch.ones(1000, requires_grad=True); xx = x.clone().requires_grad_()\n"
        "    normlab.layer_norm(xx, w, torch.zeros(1000), backend='cpu').backward(dy)\n"
        "    grads.append(w.grad)\n"
        "print(torch.get_num_threads(), all(torch.equal(grads[0], g) for g in grads[1:]))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if how.startswith("OMP") else {k: v for k, v in os.environ.items()
                                                                                 if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["1", "True"], out.stdout + out.stderr[-500:]


def test_a_chunks_dw_and_db_partial_rows_sit_half_a_page_apart():
    # layer_norm's and DyT's backward load one partial row just after storing the other at the
    # same index: at the same address modulo 4 KiB the CPU stalls the load (4K aliasing), which
    # cost them 1.2-1.7x on two threads. Each chunk's two rows start 2 KiB apart modulo 4 KiB.
    for nchunks in (1, 2, 3):
        for d in (1, 100, 1024, 1025, 4096, 5000):
            parts = rows._partial_row_pairs(nchunks, d)
            assert parts.shape[0] == 2 * nchunks and parts.shape[1] >= d and not parts.any()
            for c in range(nchunks):
                assert (parts[2 * c + 1].ctypes.data - parts[2 * c].ctypes.data) % 4096 == 2048, (nchunks, d, c)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_weight_gradients_stay_accurate_over_many_rows(gen, op):
    # A float32 sum over all of a chunk's rows lost accuracy with their count: at 16384 rows dw was
    # 17 times further from float64 than torch's float32 sum. Flushed to float64 every FLUSH rows,
    # it stays within twice torch's error plus one rounding step.
    rows, d = 16384, 128
    x64, dy64 = (torch.randn(rows, d, generator=gen, dtype=torch.float64) * 2 + 0.5 for _ in range(2))
    w64, b64 = torch.randn(d, generator=gen, dtype=torch.float64), torch.randn(d, generator=gen, dtype=torch.float64)
    grads = {}
    for name, backend, dtype in (("truth", "reference", torch.float64), ("torch", "reference", torch.float32),
                                 ("normlab", "cpu", torch.float32)):
        w, b = (t.detach().to(dtype).requires_grad_() for t in (w64, b64))
        x = x64.to(dtype)
        y = F.rms_norm(x, w, backend=backend, cast="gemma") if op == "rms_norm" else F.layer_norm(x, w, b, backend=backend)
        y.backward(dy64.to(dtype))
        grads[name] = [t.grad.double() for t in ((w,) if op == "rms_norm" else (w, b))]
    for truth, ref, ours in zip(grads["truth"], grads["torch"], grads["normlab"]):
        scale = truth.abs().max()
        err_ref, err_ours = ((ref - truth).abs().max() / scale).item(), ((ours - truth).abs().max() / scale).item()
        assert err_ours <= 2 * err_ref + torch.finfo(torch.float32).eps, (err_ours, err_ref)


_BIG = np.ones(2_000_000)  # a large global array: numba will not cache code that embeds it


def test_a_kernel_numba_cannot_cache_warns_and_runs():
    from numba.core.errors import NumbaWarning

    from normlab.kernels.cpu import cache

    def uses_a_big_global(x):
        return x[0] + _BIG[0]

    kernel = cache.kernel(uses_a_big_global)
    with pytest.warns(NumbaWarning, match="Cannot cache"):
        assert kernel(np.full(3, 2.0)) == 3.0


def _toy_sum(x):  # elementwise, so that its bits do not depend on how the threads split the loop
    out = np.empty_like(x)
    for i in numba.prange(x.shape[0]):
        out[i] = x[i] * 2.0 + 1.0
    return out


def _toy_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*_toy_sum*") if p.suffix in (".nbi", ".nbc"))


@pytest.mark.parametrize("damage", ["index cut short", "index garbled", "data at 30%", "data at 50%", "data at 80%",
                                    "data emptied", "data another valid pickle"])
def test_a_damaged_cache_entry_is_discarded_and_compiled_again(damage, tmp_path, monkeypatch):
    # a damaged entry crashed numba (EOFError, UnpicklingError, LLVM aborting the process); it
    # must instead warn, compile again and give the same answer
    import pickle

    from numba.core import config

    from normlab.kernels.cpu import cache

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    x = np.random.default_rng().standard_normal(1000)
    first = cache.kernel(_toy_sum)
    want = first(x)
    assert sum(first.stats.cache_misses.values()) == 1
    index = next(p for p in _toy_files(tmp_path) if p.suffix == ".nbi")
    data = next(p for p in _toy_files(tmp_path) if p.suffix == ".nbc")
    if damage.startswith("index"):
        blob = index.read_bytes()
        index.write_bytes(blob[: len(blob) // 2] if damage == "index cut short" else blob[:-40] + os.urandom(40))
    elif damage == "data emptied":
        data.write_bytes(b"")
    elif damage == "data another valid pickle":
        data.write_bytes(pickle.dumps({"not": "a kernel"}))
    else:
        blob = bytearray(data.read_bytes())
        at = len(blob) * int(damage[-3:-1]) // 100
        blob[at:at + 64] = os.urandom(64)
        data.write_bytes(bytes(blob))
    again = cache.kernel(_toy_sum)  # a new process's dispatcher: it loads from the cache first
    with pytest.warns(RuntimeWarning, match="could not be loaded.*compiling the kernel again"):
        assert np.array_equal(again(x), want)
    assert sum(again.stats.cache_misses.values()) == 1 and sum(again.stats.cache_hits.values()) == 0
    third = cache.kernel(_toy_sum)  # what the recompile saved loads cleanly
    assert np.array_equal(third(x), want) and sum(third.stats.cache_hits.values()) == 1


def test_the_cache_is_user_wide_by_default(tmp_path, monkeypatch):
    # keyed by the sources' hash, one cache serves every clone and environment of the same sources
    from numba.core import config

    from normlab.kernels.cpu import cache

    monkeypatch.setattr(config, "CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernel = cache.kernel(_toy_sum)
    kernel(np.ones(10))
    assert _toy_files(tmp_path / "normlab" / "numba" / f"normlab-{cache.sources_hash()}")


_FORK_PROBE = """
import json, torch
from torch.utils.data import DataLoader, Dataset
from normlab import functional as F, reference as R
from normlab.kernels.cpu import launch, rmsnorm

class Rows(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(i), dtype=torch.bfloat16)
        y = F.rms_norm(x, backend="cpu")
        ran = rmsnorm.rms_fwd.serial().signatures if launch.serial() else rmsnorm.rms_fwd.signatures
        return x, y, launch.serial(), len(ran)

F.rms_norm(torch.randn(4, 256), backend="cpu")  # the parent starts the threading layer first
err, serial, ran = 0.0, set(), []
for x, y, was_serial, kernels in DataLoader(Rows(), batch_size=2, num_workers=2, multiprocessing_context="fork"):
    truth = R.rms_norm(x.double())
    err = max(err, ((y.double() - truth).abs() / truth.abs().clamp_min(1)).max().item())
    serial |= set(was_serial.tolist())
    ran += kernels.tolist()
print(json.dumps({"layer": launch.threading_layer(), "serial": sorted(serial), "ran": min(ran), "err": err}))
"""


def test_dataloader_workers_forked_after_a_kernel_call_run_the_kernels():
    # with GNU OpenMP as numba's layer, a worker forked after the parent's first kernel died
    # ("fork() called from a process already using GNU OpenMP"); the workers now run the same
    # kernels compiled serially (their own signatures compiled there, not the reference)
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FORK_PROBE], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["err"] <= 2 ** -8  # bf16 output: within one rounding of the float64 math
    assert got["ran"] >= 1  # a compiled rms_fwd signature in every worker: the kernels ran there
    assert got["serial"] == [got["layer"] == "omp"], got
