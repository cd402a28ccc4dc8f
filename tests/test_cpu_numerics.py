"""The fused CPU (numba) ops against the float64 reference, outputs and every gradient: each op,
dtype and size, the RMSNorm options, missing weights, mixed dtypes, odd and non-finite rows, and
random cases drawn by hypothesis (the check: tests/opcheck.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from normlab import functional as F
from normlab import reference
from normlab.testing import assert_close

import opcheck
from opcheck import (DTYPES, FAR_SCALE_OPTIONS, OPS, RMS_OPTIONS, call_op, check,
                     check_deterministic_weight_grads,
                     check_far_from_unit_scale, op_leaves)

# minutes cold on 2 cores; in-process compiles, run on one worker (conftest.py)
pytestmark = [pytest.mark.slow(minutes=6), pytest.mark.xdist_group("kernels")]
pytest.importorskip("numba", reason="the cpu backend needs numba (pip install normlab[cpu])")
from normlab.kernels.cpu import launch  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# 64: a row of one vector block of TAIL, no tail; 96: one of EMIT, then one of HALF, no tail
@pytest.mark.parametrize("d", [1, 3, 64, 96, 123, 3000])
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
    run = opcheck.run_op

    def dropping_a_row(op, leaves, opts, backend, grads, convert=None):
        outs, g = run(op, leaves, opts, backend, grads, convert)
        if backend == "cpu":
            terms = grads[0].double() * opcheck._normalized(op, leaves, opts)[0]
            row = terms.abs().amax(-1).argmax()
            g["weight"] = (g["weight"].double() - terms[row]).to(g["weight"].dtype)
        return outs, g

    monkeypatch.setattr(opcheck, "run_op", dropping_a_row)  # check looks run_op up in its module
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_llama_offset_weight_is_rounded_where_the_sum_is_float32(gen, dtype):
    """A 16-bit x with the residual stream in float32: the residual's gradient is float32, so a
    check with float32 tolerance sees whether (w + offset) is rounded to x's dtype as the llama
    order defines it (opcheck's truth rounds it too; unrounded, about a quarter of these checks
    failed on correct kernels)."""
    for _ in range(12):
        check(gen, "add_rms_norm", (17, 15), dtype, {"offset": 1.0, "eps_mode": "outside"},
              res_dtype=torch.float32)
        check(gen, "add_rms_norm", (9, 40), dtype, {"offset": 1.0, "residual_in_fp32": True})


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
        assert_close(F.rms_norm(x, w, backend="cpu"), F.rms_norm(x.double(), w.double()),
                     lowp=F.rms_norm(x, w, backend="reference"), dtype=torch.float32)
        assert_close(F.layer_norm(x, w, w, backend="cpu"), F.layer_norm(x.double(), w.double(), w.double()),
                     lowp=F.layer_norm(x, w, w, backend="reference"), dtype=torch.float32)
        y, s = F.add_rms_norm(x, x.flip(-1), w, backend="cpu")
        assert torch.equal(s, x + x.flip(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_tensors_give_the_bits_of_their_contiguous_copies(gen, dtype):
    # The launchers hand tensors to the kernels by address (launch._at). A strided tensor is
    # copied first, and the copy must live until the kernel returns: freed early, its memory
    # would go to the output allocated next, and the kernel would read that. Every tensor
    # strided here (x, residual, weight, bias, the incoming gradient), forward and backward.
    def strided(*shape):
        return (torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * 2).to(dtype)[..., 1::2]

    x, r, w, b, dy = strided(5, 3, 96), strided(5, 3, 96), strided(96), strided(96), strided(5, 3, 96)
    calls = [lambda x, r, w, b: F.rms_norm(x, w, backend="cpu"),
             lambda x, r, w, b: F.rms_norm(x, w, cast="gemma", offset=1.0, backend="cpu"),
             lambda x, r, w, b: F.layer_norm(x, w, b, backend="cpu"),
             lambda x, r, w, b: F.add_rms_norm(x, r, w, backend="cpu")[0],
             lambda x, r, w, b: F.add_layer_norm(x, r, w, b, backend="cpu")[0]]
    for call in calls:
        got, want = [], []
        for tensors, out in (((x, r, w, b), got), ((x.contiguous(), r.contiguous(), w.contiguous(),
                                                    b.contiguous()), want)):
            leaves = [t.detach().clone() if t.is_contiguous() else t.detach() for t in tensors]
            leaves = [t.requires_grad_() for t in leaves]
            y = call(*leaves)
            out += [y, *torch.autograd.grad(y, leaves, dy if out is got else dy.contiguous(),
                                            allow_unused=True)]
        assert not x.is_contiguous() and not w.is_contiguous()
        for a, c in zip(got, want):
            assert (a is None and c is None) or torch.equal(a, c)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_of_zeros_give_zeros(dtype):
    x = torch.zeros(3, 50, dtype=dtype, requires_grad=True)
    w = torch.randn(50).to(dtype)
    for fn in (lambda: F.rms_norm(x, w, backend="cpu"),
               lambda: F.rms_norm(x, w, eps_mode="outside", backend="cpu"),
               lambda: F.layer_norm(x, w, None, backend="cpu"),
               lambda: F.add_rms_norm(x, x, w, backend="cpu")[0]):
        y = fn()
        assert torch.equal(y, torch.zeros_like(y))
        (g,) = torch.autograd.grad(y.float().sum(), x)
        # rstd = 1/eps outside the root: that gradient is 1e6 * w, which overflows fp16 to inf,
        # as the true value should; it must never be nan.
        assert not torch.isnan(g).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_mean_rows(gen, dtype):
    mean = 1e4 if dtype != torch.float16 else 1e3
    for d in (64, 1000):  # LayerNorm's statistics differ below and above 256 features
        check(gen, "layer_norm", (8, d), dtype, mean=mean)
        check(gen, "rms_norm", (8, d), dtype, mean=mean)


@pytest.mark.parametrize("add", [False, True], ids=["layer_norm", "add_layer_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_short_rows_off_zero_keep_their_variance(gen, dtype, add):
    # LayerNorm's rows of at most 256 features take their statistics from float64 sums of x and
    # x^2, unshifted: one pass up to a mean 64 times the spread (30 and 60 here, where float32
    # sums would be off by hundreds of ulps), about the row's mean past it (1e3). The saved
    # rstd must stay within two ulps of float64's either way, tail values (17, 96) included.
    for d, mean in ((64, 0.0), (64, 30.0), (96, 30.0), (256, 60.0), (200, 1e3), (17, 30.0)):
        x = (torch.randn(6, d, generator=gen, dtype=torch.float64) + mean).to(dtype)
        res = torch.randn(6, d, generator=gen, dtype=torch.float64).to(dtype) if add else None
        _, s, mu, rstd = launch.ln_fwd_launch(x, None, None, 1e-5, residual=res)
        if add:
            assert torch.equal(s, (x.float() + res.float()).to(dtype))  # the residual sum, stored
        row = (s if add else x).double()
        true_rstd = torch.rsqrt(row.var(-1, unbiased=False) + 1e-5)
        assert ((rstd.double() - true_rstd).abs() / true_rstd).max() < 2 * 2.0**-23, (d, mean)
        assert torch.allclose(mu, row.mean(-1), rtol=0, atol=1e-6 * row.abs().max().item()), (d, mean)


@pytest.mark.parametrize("scale", [1e-15, 1e15])
@pytest.mark.parametrize("opts", FAR_SCALE_OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_rows_far_from_unit_scale(gen, dtype, opts, scale):
    check_far_from_unit_scale(gen, dtype, opts, scale, "cpu")  # rstd^3 alone leaves float32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_rows_whose_first_block_is_unlike_the_rest(gen, op, dtype):
    # LayerNorm's statistics are one pass over sums shifted by the mean of the row's first block
    # of 256; where that block sits far from the rest (a shifted mean much larger than the
    # spread), E[u^2] - E[u]^2 would cancel, and the kernel must take its second pass instead.
    # Long rows: the first block's offset adds to the variance too, so E[u]^2 / var is at most
    # d / 256 (64 here: without the second pass the saved rstd of the 300-offset row was off by
    # 4.5e-7 to 8e-7, 4 to 7 ulps, its outputs by 8x torch's error; with it, under an ulp).
    leaves = op_leaves(gen, op, (6, 16384), dtype)
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


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_non_finite_rows_stay_in_their_row(gen, op, dtype, bad):
    leaves = op_leaves(gen, op, (6, 37), dtype)
    leaves["x"][3, 5] = bad
    x = leaves["x"].requires_grad_()
    outs = call_op(op, leaves, {}, "cpu")
    good = [0, 1, 2, 4, 5]
    # rows are independent: the good rows come out bitwise as if the bad row were not there
    alone = call_op(op, {k: (v[good].detach() if v.dim() == 2 else v) for k, v in leaves.items()}, {}, "cpu")
    for o, r in zip(outs, alone):
        assert torch.isfinite(o[good]).all()
        assert not torch.isfinite(o[3]).all()
        assert torch.equal(o[good], r)
    (g,) = torch.autograd.grad(outs[0].float().sum(), x)
    assert torch.isfinite(g[good]).all()


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_weight_gradients_are_bitwise_deterministic(gen, op):
    check_deterministic_weight_grads(gen, op, (300, 257))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_forward_is_batch_invariant(gen, op, dtype):
    # a row's output does not depend on how many rows share the call (chunk boundaries move)
    leaves = op_leaves(gen, op, (9, 300), dtype)
    full = call_op(op, leaves, {}, "cpu")
    for picked in ([4], [0, 8], [2, 3, 4, 5, 6]):
        part = call_op(op, {k: (v[picked] if v.dim() == 2 else v) for k, v in leaves.items()}, {}, "cpu")
        assert all(torch.equal(f[picked], p) for f, p in zip(full, part)), picked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_short_rows_in_groups(gen, op, dtype):
    # 16-bit rows of up to rows.GROUP_ROW_BYTES go through the forward in groups of rows.ROW_GROUP:
    # here many groups, chunks that end inside one, a partial last group and a nan row among them
    check(gen, op, (3, 37, 96), dtype)
    leaves = op_leaves(gen, op, (37, 64), dtype)
    leaves["x"][10, 7] = float("nan")
    full = call_op(op, leaves, {}, "cpu")
    assert torch.isnan(full[0][10]).any() and torch.isfinite(full[0][torch.arange(37) != 10]).all()
    for picked in ([5], [7, 8], list(range(3, 21)), [36], [10, 11]):
        part = call_op(op, {k: (v[picked] if v.dim() == 2 else v) for k, v in leaves.items()}, {}, "cpu")
        for f, p in zip(full, part):
            torch.testing.assert_close(f[picked], p, rtol=0, atol=0, equal_nan=True, msg=str(picked))


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_weight_gradients_stay_accurate_over_many_rows(gen, op):
    # A float32 sum over all of a chunk's rows lost accuracy with their count: at 16384 rows dw was
    # 17 times further from float64 than torch's float32 sum. Flushed to float64 every FLUSH rows,
    # it stays within twice torch's error plus one rounding step.
    rows, d = 16384, 128
    x64, dy64 = (torch.randn(rows, d, generator=gen, dtype=torch.float64) * 2 + 0.5 for _ in range(2))
    w64, b64 = torch.randn(d, generator=gen, dtype=torch.float64), torch.randn(d, generator=gen,
                                                                               dtype=torch.float64)
    grads = {}
    for name, backend, dtype in (("truth", "reference", torch.float64), ("torch", "reference", torch.float32),
                                 ("normlab", "cpu", torch.float32)):
        w, b = (t.detach().to(dtype).requires_grad_() for t in (w64, b64))
        x = x64.to(dtype)
        y = F.rms_norm(x, w, backend=backend,
                       cast="gemma") if op == "rms_norm" else F.layer_norm(x, w, b, backend=backend)
        y.backward(dy64.to(dtype))
        grads[name] = [t.grad.double() for t in ((w,) if op == "rms_norm" else (w, b))]
    for truth, ref, ours in zip(grads["truth"], grads["torch"], grads["normlab"]):
        scale = truth.abs().max()
        err_ref = ((ref - truth).abs().max() / scale).item()
        err_ours = ((ours - truth).abs().max() / scale).item()
        assert err_ours <= 2 * err_ref + torch.finfo(torch.float32).eps, (err_ours, err_ref)


@settings(max_examples=40, deadline=None)
@given(
    op=st.sampled_from(OPS),
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(0, 9),
    d=st.integers(1, 300),
    partial=st.one_of(st.none(), st.floats(0.01, 1.0)),
    eps_mode=st.sampled_from(["inside", "outside"]),
    cast=st.sampled_from(["llama", "gemma"]),
    offset=st.sampled_from([0.0, 1.0]),
    weight=st.sampled_from([None, "same", torch.float32]),
    residual=st.sampled_from(["same", torch.float32, "in_fp32"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_properties(op, dtype, rows, d, partial, eps_mode, cast, offset, weight, residual, seed):
    """Random cases, mixed dtypes among them: a float32 weight on 16-bit x, a float32 residual
    (the sum then float32 by promotion) or residual_in_fp32."""
    gen = torch.Generator().manual_seed(seed)
    opts = {"eps_mode": eps_mode, "cast": cast, "partial": partial, "offset": offset} if "rms" in op else {}
    if op.startswith("add"):
        opts["residual_in_fp32"] = residual == "in_fp32"
    leaves = op_leaves(gen, op, (rows, d), dtype, weight=weight is not None,
                       res_dtype=residual if isinstance(residual, torch.dtype) else None)
    if weight is torch.float32:
        leaves.update({k: leaves[k].float() for k in ("weight", "bias") if k in leaves})
    check(gen, op, (rows, d), dtype, opts, leaves=leaves)
