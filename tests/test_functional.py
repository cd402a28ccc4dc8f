"""The public functional API: gradients, backend dispatch, edge cases, and every input error."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import normlab
from normlab import functional as F
from normlab import kernels
from normlab import reference as R
from normlab.testing import assert_close


def rand(gen, *shape, dtype=torch.float64, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


# ------------------------------------------------------------------------------- gradients


def _gradcheck(fn, *inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("d", [1, 3, 17])
@pytest.mark.parametrize("affine", ["none", "weight", "weight+bias"])
def test_layer_norm_gradcheck(gen, d, affine):
    x = rand(gen, 3, 4, d).requires_grad_()
    w = rand(gen, d).requires_grad_() if affine != "none" else None
    b = rand(gen, d).requires_grad_() if affine == "weight+bias" else None
    _gradcheck(lambda x, w, b: F.layer_norm(x, w, b, 1e-5), x, w, b)


@pytest.mark.parametrize(
    "opts",
    [{}, {"eps_mode": "outside"}, {"cast": "gemma", "offset": 1.0}, {"partial": 0.25},
     {"partial": 0.6, "eps_mode": "outside"}],
    ids=str,
)
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_gradcheck(gen, opts, weighted):
    x = rand(gen, 5, 16).requires_grad_()
    w = rand(gen, 16).requires_grad_() if weighted else None
    _gradcheck(lambda x, w: F.rms_norm(x, w, 1e-6, **opts), x, w)


def test_add_norms_gradcheck(gen):
    x, r = rand(gen, 2, 3, 12).requires_grad_(), rand(gen, 2, 3, 12).requires_grad_()
    w, b = rand(gen, 12).requires_grad_(), rand(gen, 12).requires_grad_()
    # Both outputs carry gradient: the normalized one and the sum (the next residual).
    _gradcheck(lambda x, r, w: F.add_rms_norm(x, r, w, partial=0.5), x, r, w)
    _gradcheck(lambda x, r, w, b: F.add_layer_norm(x, r, w, b), x, r, w, b)


@pytest.mark.parametrize("training", [True, False])
def test_seq_batch_norm_gradcheck(gen, training):
    x = rand(gen, 3, 5, 6).requires_grad_()
    mask = torch.rand(3, 5, generator=gen) < 0.7
    mask[0, 0] = mask[1, 0] = True
    w, b = rand(gen, 6).requires_grad_(), rand(gen, 6).requires_grad_()
    rm, rv = rand(gen, 6), rand(gen, 6).abs() + 0.5

    def fn(x, w, b):
        # fresh running stats each call: gradcheck calls fn many times
        return F.seq_batch_norm(x, mask, rm.clone(), rv.clone(), w, b, training=training)

    _gradcheck(fn, x, w, b)


# ------------------------------------------------------------------------ agreement with torch


@pytest.mark.parametrize("shape", [(8, 1), (4, 3), (2, 6, 123), (5, 3000)])
def test_matches_torch_layer_norm_and_rms_norm_fp32(gen, shape):
    d = shape[-1]
    x, w, b = rand(gen, *shape,
                   dtype=torch.float32), rand(gen, d, dtype=torch.float32), rand(gen, d, dtype=torch.float32)
    tf = torch.nn.functional
    assert torch.allclose(F.layer_norm(x, w, b, 1e-5), tf.layer_norm(x, (d,), w, b, 1e-5), atol=1e-5,
                          rtol=1e-5)
    assert torch.allclose(F.layer_norm(x), tf.layer_norm(x, (d,)), atol=1e-5, rtol=1e-5)
    assert torch.allclose(F.rms_norm(x, w, 1e-6), tf.rms_norm(x, (d,), w, 1e-6), atol=1e-5, rtol=1e-5)
    assert torch.allclose(F.rms_norm(x), tf.rms_norm(x, (d,), eps=1e-6), atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_zero_rows_give_an_empty_result(op):
    x = torch.randn(0, 5, 16)
    w = torch.ones(16)
    out = getattr(F, op)(x, x.clone(), w) if op.startswith("add") else getattr(F, op)(x, w)
    outs = out if isinstance(out, tuple) else (out,)
    assert all(o.shape == (0, 5, 16) for o in outs)


def test_seq_batch_norm_zero_rows():
    assert F.seq_batch_norm(torch.randn(0, 4, 8), None, None, None, training=True).shape == (0, 4, 8)


def test_non_contiguous_and_strided_inputs(gen):
    base = rand(gen, 6, 40, dtype=torch.float32)
    w = rand(gen, 20, dtype=torch.float32)
    views = [base[:, ::2], base.t().contiguous().t()[:, :20], base[::2, 10:30],
             base.unsqueeze(0).expand(3, 6, 40)[..., 5:25]]
    for v in views:
        assert not v.is_contiguous() or v.stride() != (20, 1)
        # Reductions over strided memory may sum in another order: compare with the truth.
        assert_close(F.rms_norm(v, w), R.rms_norm(v.double(), w.double()), dtype=torch.float32)
        assert_close(F.layer_norm(v, w, w), R.layer_norm(v.double(), w.double(), w.double()),
                     dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_zero_rows_give_zeros(dtype):
    x = torch.zeros(3, 64, dtype=dtype)
    w = torch.randn(64).to(dtype)
    for opts in ({}, {"eps_mode": "outside"}, {"cast": "gemma", "offset": 1.0}, {"partial": 0.1}):
        y = F.rms_norm(x, w, **opts)
        assert torch.equal(y, torch.zeros_like(y)), opts
    y = F.layer_norm(x, w)
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_rows_stay_in_their_row(gen, bad):
    x = rand(gen, 5, 33, dtype=torch.float32)
    x[2, 7] = bad
    w = rand(gen, 33, dtype=torch.float32)
    good = torch.tensor([0, 1, 3, 4])
    for y in (F.rms_norm(x, w), F.layer_norm(x, w, w), F.add_rms_norm(x, x, w)[0],
              F.add_layer_norm(x, x, w)[0]):
        assert torch.isfinite(y[good]).all()
        assert not torch.isfinite(y[2]).all()
    assert torch.equal(F.rms_norm(x, w)[good], F.rms_norm(x[good], w))


# ---------------------------------------------------------------------------- backend dispatch


def test_reference_backend_is_always_available_and_auto_falls_back_to_it():
    assert "reference" in normlab.available_backends()
    assert kernels.resolve(None, torch.device("cpu")) in normlab.available_backends()


def test_backend_argument_context_manager_and_environment_in_that_order(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # so that triton cannot run on CPU tensors
    cpu = torch.device("cpu")
    monkeypatch.setenv("NORMLAB_BACKEND", "reference")
    assert kernels.resolve(None, cpu) == "reference"
    monkeypatch.setenv("NORMLAB_BACKEND", "bogus")
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'reference'.*got 'bogus'"):
        kernels.resolve(None, cpu)
    with normlab.use_backend("reference"):
        assert kernels.resolve(None, cpu) == "reference"  # the context wins over the environment
        with pytest.raises(RuntimeError, match="triton"):
            kernels.resolve("triton", cpu)  # the argument wins over the context
    monkeypatch.delenv("NORMLAB_BACKEND")
    with pytest.raises(ValueError, match="got 'fast'"):
        with normlab.use_backend("fast"):
            pass


def test_the_environment_variable_is_read_from_a_replaced_environ_too(monkeypatch):
    # kernels._env_backend reads os.environ's own dict (no KeyError per call); a test or tool
    # that replaces os.environ with a plain mapping must still be heard
    import os

    monkeypatch.setattr(os, "environ", {**os.environ, "NORMLAB_BACKEND": "reference"})
    assert kernels.resolve(None, torch.device("cpu")) == "reference"
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "NORMLAB_BACKEND"})
    assert kernels._env_backend() is None
    assert kernels.resolve(None, torch.device("cpu")) == kernels.resolve("auto", torch.device("cpu"))


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "add_rms_norm"])
def test_the_fused_call_records_a_graph_exactly_when_autograd_needs_one(gen, op):
    # Without a graph to record the call skips its autograd.Function (ops._records_nothing):
    # same bits, no grad_fn; any input that requires grad brings the graph back.
    x, r, w = (
        rand(gen, 6, 32, dtype=torch.float32),
        rand(gen, 6, 32, dtype=torch.float32),
        rand(gen, 32, dtype=torch.float32),
    )
    fn = getattr(F, op)

    def call(x, w):
        out = fn(x, r, w, backend="cpu") if op.startswith("add") else fn(x, w, backend="cpu")
        return out[0] if isinstance(out, tuple) else out

    plain = call(x, w)
    assert plain.grad_fn is None
    for grad_x, grad_w in ((True, False), (False, True)):
        y = call(x.clone().requires_grad_(grad_x), w.clone().requires_grad_(grad_w))
        assert y.grad_fn is not None and torch.equal(y.detach(), plain)
        with torch.no_grad():
            y = call(x.clone().requires_grad_(grad_x), w.clone().requires_grad_(grad_w))
        assert y.grad_fn is None and torch.equal(y, plain)


@pytest.mark.parametrize("which", ["x", "alpha"])
def test_forward_mode_ad_keeps_its_tangent_under_no_grad(gen, which):
    """no_grad does not turn forward AD off, and there the kernels' path skips the autograd
    Function: a dual input, even only DyT's scalar, must take the math that carries its tangent."""
    import torch.autograd.forward_ad as fwAD

    x, alpha = rand(gen, 4, 16, dtype=torch.float32), torch.tensor([0.7])
    tangent = rand(gen, *(x.shape if which == "x" else alpha.shape), dtype=torch.float32)
    with fwAD.dual_level(), torch.no_grad():
        if which == "x":
            y = F.rms_norm(fwAD.make_dual(x, tangent), backend="cpu")
        else:
            y = F.dyt(x, fwAD.make_dual(alpha, tangent), backend="cpu")
        got = fwAD.unpack_dual(y).tangent
    if which == "x":
        _, want = torch.func.jvp(lambda t: R.rms_norm(t), (x.double(),), (tangent.double(),))
    else:
        _, want = torch.func.jvp(lambda a: R.dyt(x.double(), a), (alpha.double(),), (tangent.double(),))
    assert got is not None, "the tangent was dropped"
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_unavailable_backend_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA to see triton refused")
    # not installed, no CUDA, or a Triton older than the kernels need
    refused = "backend 'triton' cannot run here: .*(not installed|CUDA|older than)"
    with pytest.raises(RuntimeError, match=refused):
        F.rms_norm(torch.randn(2, 8), backend="triton")


def test_explicit_reference_backend_equals_reference_module(gen):
    x, w = rand(gen, 4, 50, dtype=torch.float32), rand(gen, 50, dtype=torch.float32)
    assert torch.equal(F.rms_norm(x, w, partial=0.3, backend="reference"), R.rms_norm(x, w, partial=0.3))


# ------------------------------------------------------------------------------ input errors


x8 = torch.randn(4, 8)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: F.rms_norm(torch.ones(4, 8, dtype=torch.long)), TypeError,
         r"x must be a floating-point tensor, got dtype torch.int64"),
        (lambda: F.layer_norm([1.0, 2.0]), TypeError, r"x must be a torch.Tensor, got list"),
        (lambda: F.rms_norm(torch.tensor(1.0)), ValueError, r"x must have at least one dimension"),
        (lambda: F.rms_norm(torch.ones(4, 0)), ValueError, r"x has shape \(4, 0\): its last dimension"),
        (lambda: F.rms_norm(x8, torch.ones(7)), ValueError,
         r"weight has shape \(7,\), expected \(8,\) to match the last dimension of x"),
        (lambda: F.layer_norm(x8, torch.ones(8), torch.ones(2, 8)), ValueError,
         r"bias has shape \(2, 8\), expected \(8,\)"),
        (lambda: F.layer_norm(x8, torch.ones(8, dtype=torch.int32)), TypeError,
         r"weight must be a floating-point tensor"),
        (lambda: F.add_rms_norm(x8, torch.ones(4, 9)), ValueError,
         r"residual has shape \(4, 9\), expected \(4, 8\)"),
        (lambda: F.add_layer_norm(x8, torch.ones(4, 8, dtype=torch.int64)), TypeError,
         r"residual must be a floating-point tensor"),
        (lambda: F.rms_norm(x8, partial=0.0), ValueError, r"partial must be in \(0, 1\].*got 0.0"),
        (lambda: F.rms_norm(x8, partial=1.5), ValueError, r"partial must be in \(0, 1\].*got 1.5"),
        (lambda: F.rms_norm(x8, partial="half"), TypeError, r"partial must be a number"),
        (lambda: F.rms_norm(x8, eps=-1e-6), ValueError, r"eps must be a finite number >= 0, got -1e-06"),
        (lambda: F.layer_norm(x8, eps=math.inf), ValueError, r"eps must be a finite number >= 0, got inf"),
        (lambda: F.layer_norm(x8, eps=math.nan), ValueError, r"eps must be a finite number >= 0, got nan"),
        (lambda: F.layer_norm(x8, eps="1e-5"), TypeError, r"eps must be a real number, got str"),
        (lambda: F.rms_norm(x8, cast="mistral"), ValueError,
         r"cast must be one of 'llama', 'gemma'; got 'mistral'"),
        (lambda: F.rms_norm(x8, eps_mode="both"), ValueError,
         r"eps_mode must be one of 'inside', 'outside'; got 'both'"),
        (lambda: F.rms_norm(x8, offset=math.nan), ValueError, r"offset must be a finite number"),
        (lambda: F.rms_norm(x8, backend="cuda"), ValueError, r"backend must be one of .*; got 'cuda'"),
        (lambda: F.seq_batch_norm(torch.randn(2, 3, 8), torch.ones(2, 3), None, None, training=True),
         ValueError, r"mask must be a bool tensor.*got torch.float32"),
        (lambda: F.seq_batch_norm(torch.randn(2, 3, 8), torch.ones(3, 2, dtype=torch.bool), None, None,
                                  training=True), ValueError, r"mask has shape \(3, 2\), expected \(2, 3\)"),
        (lambda: F.seq_batch_norm(torch.randn(2, 3, 8), None, torch.zeros(8), None, training=True),
         ValueError, r"running_mean and running_var must be given together"),
        (lambda: F.seq_batch_norm(torch.randn(2, 3, 8), None, torch.zeros(4), torch.ones(4), training=True),
         ValueError, r"running_mean has shape \(4,\), expected \(8,\)"),
        (lambda: F.seq_batch_norm(torch.randn(2, 3, 8), None, None, None, training=True, momentum=2),
         ValueError, r"momentum must be a number in \[0, 1\], got 2"),
        (lambda: F.seq_batch_norm(torch.randn(8), None, None, None, training=True), ValueError,
         r"expects \(B, T, d\)"),
        (lambda: F.seq_batch_norm(torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.bool), None, None,
                                  training=True), ValueError, r"mask selects no positions"),
    ],
)
def test_errors_name_the_argument_and_what_was_expected(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_tensors_on_different_devices_are_rejected():
    # The meta device stands in for a second device on a CPU-only machine.
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"weight is on meta but x is on cpu"):
        F.rms_norm(x, torch.ones(8, device="meta"))
    with pytest.raises(ValueError, match=r"residual is on meta but x is on cpu"):
        F.add_rms_norm(x, torch.ones(4, 8, device="meta"))
    with pytest.raises(ValueError, match=r"mask is on meta but x is on cpu"):
        F.seq_batch_norm(torch.randn(2, 3, 8), torch.ones(2, 3, dtype=torch.bool, device="meta"), None, None,
                         training=True)


# ----------------------------------------------------------------------- property-based tests


@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(0, 4), min_size=0, max_size=3),
    d=st.integers(1, 200),
    partial=st.one_of(st.none(), st.floats(0.001, 1.0)),
    eps_mode=st.sampled_from(["inside", "outside"]),
    cast=st.sampled_from(["llama", "gemma"]),
    offset=st.sampled_from([0.0, 1.0]),
    weighted=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_rms_norm_properties(lead, d, partial, eps_mode, cast, offset, weighted, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=g)
    w = torch.randn(d, generator=g) if weighted else None
    y = F.rms_norm(x, w, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial)
    assert y.shape == x.shape and y.dtype == x.dtype
    # The truth, written independently in float64.
    k = R.partial_size(d, partial)
    ms = x.double()[..., :k].pow(2).sum(-1, keepdim=True) / k
    den = torch.sqrt(ms + 1e-6) if eps_mode == "inside" else torch.sqrt(ms) + 1e-6
    truth = x.double() / den * ((w.double() + offset) if weighted else 1.0)
    assert_close(y, truth)
    # Scale invariance of the statistic (eps aside): rms_norm(c x) ~ rms_norm(x) for c > 0.
    if x.numel():
        y2 = F.rms_norm(x * 8.0, w, eps=0.0, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial)
        y1 = F.rms_norm(x, w, eps=0.0, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial)
        finite = torch.isfinite(y1)
        assert torch.allclose(y2[finite], y1[finite], rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(0, 4), min_size=0, max_size=3),
    d=st.integers(1, 200),
    affine=st.sampled_from(["none", "weight", "both"]),
    mean=st.sampled_from([0.0, 1.0, 1e3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_layer_norm_properties(lead, d, affine, mean, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, d, generator=g) + mean
    w = torch.randn(d, generator=g) if affine != "none" else None
    b = torch.randn(d, generator=g) if affine == "both" else None
    y = F.layer_norm(x, w, b)
    assert y.shape == x.shape
    xd = x.double()
    mu = xd.sum(-1, keepdim=True) / d
    var = ((xd - mu) ** 2).sum(-1, keepdim=True) / d
    truth = (xd - mu) / torch.sqrt(var + 1e-5) * (w.double() if w is not None
                                                  else 1.0) + (b.double() if b is not None else 0.0)
    # fp32 x - mean carries an ulp of |x| (large for mean 1e3), scaled by rstd (large when a
    # row's few values are close): the bound follows the size of those terms.
    rstd = torch.rsqrt(var + 1e-5)
    terms = (xd.abs() + mu.abs()) * rstd * (w.double().abs() if w is not None else 1.0)
    assert torch.all((y.double() - truth).abs() <= 1e-5 + 1e-5 * truth.abs() + 4e-7 * terms)


@pytest.mark.parametrize("backend", kernels.available_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_eps_zero_on_zero_rows_gives_the_references_nan(backend, dtype):
    """eps = 0 is allowed (exact invariance checks use it); a row of zeros then has no scale, and
    every backend returns the reference's NaN instead of raising inside a kernel."""
    x = torch.zeros(3, 64, dtype=dtype)
    x[1] = torch.linspace(-1, 1, 64, dtype=dtype)  # a normal row beside them stays finite
    w, b = torch.ones(64, dtype=dtype), torch.zeros(64, dtype=dtype)
    for eps_mode in ("inside", "outside"):
        y = F.rms_norm(x, w, eps=0.0, eps_mode=eps_mode, backend=backend)
        torch.testing.assert_close(y, R.rms_norm(x, w, eps=0.0, eps_mode=eps_mode), equal_nan=True, atol=0.02,
                                   rtol=0.02)
        assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()
    y = F.layer_norm(x, w, b, eps=0.0, backend=backend)
    torch.testing.assert_close(y, R.layer_norm(x, w, b, eps=0.0), equal_nan=True, atol=0.02, rtol=0.02)
    assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_out_may_alias_x_exactly_but_not_in_part(gen, op, dtype):
    base = torch.randn(65, 128, generator=gen).to(dtype)
    w = torch.ones(128, dtype=dtype)
    norm = F.rms_norm if op == "rms_norm" else F.layer_norm
    call = lambda x, out: norm(x, w, out=out)
    with pytest.raises(ValueError, match="out overlaps x in part"):
        call(base[:-1], base[1:])
    x = base.clone()
    expected = call(x.clone(), torch.empty_like(x))
    assert torch.equal(call(x, x), expected)  # in place: out is x itself


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_llama_order_rounds_twice_and_the_gemma_order_once_as_torch_does(dtype):
    # why the precision table shows normlab's rms_norm at about twice torch's error: Llama's cast
    # order rounds x-hat to the dtype before the weight multiply; torch and cast="gemma" round once
    import torch.nn.functional as TF

    x = torch.randn(256, 1024, dtype=torch.float64).to(dtype)
    w = (1 + 0.1 * torch.randn(1024, dtype=torch.float64)).to(dtype)
    truth = R.rms_norm(x.double(), w.double(), eps=1e-6)

    def err(y):  # the mean error: stable where the max over a tensor is one element's luck
        return ((y.double() - truth).abs().mean() / truth.abs().mean()).item()

    llama, gemma = err(F.rms_norm(x, w, eps=1e-6)), err(F.rms_norm(x, w, eps=1e-6, cast="gemma"))
    torch_err = err(TF.rms_norm(x, (1024,), w, eps=1e-6))
    # measured 1.00 and 1.33-1.35
    assert gemma <= 1.02 * torch_err and llama >= 1.25 * torch_err, (llama, gemma, torch_err)
