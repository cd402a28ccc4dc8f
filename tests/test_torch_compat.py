"""normlab in place of torch's norms: torch's call forms, torch's modules' arguments and
state_dicts, the d = 1 gradient, and torch's dtype rules."""

import itertools

import pytest
import torch
import torch.nn.functional as TF

import normlab.torch_compat as NC
from normlab import functional as F
from normlab import kernels
from normlab.nn import LayerNorm, RMSNorm

BACKENDS = [b for b in ("reference", "cpu", "triton") if kernels.unavailable_reason(b) is None]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(6,), (2, 3), (2, 3, 4)])
def test_multidimensional_normalized_shape_matches_torch_in_float64(gen, backend, shape):
    x = torch.randn(5, *shape, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    for ours, theirs in ((lambda: NC.layer_norm(x, shape, w, b, 1e-5, backend=backend),
                          lambda: TF.layer_norm(x, shape, w, b)),
                         (lambda: NC.rms_norm(x, shape, w, backend=backend),
                          lambda: TF.rms_norm(x, shape, w))):
        got = torch.autograd.grad(ours(), (x, w), g)
        want = torch.autograd.grad(theirs(), (x, w), g)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_multidimensional_runs_the_fused_kernel_and_keeps_torchs_error(gen, backend):
    x = torch.randn(4, 3, 40, generator=gen)
    w = torch.randn(3, 40, generator=gen)
    truth = TF.rms_norm(x.double(), (3, 40), w.double(), eps=torch.finfo(torch.float32).eps)
    ours = NC.rms_norm(x, (3, 40), w, backend=backend)  # eps=None: float32's machine epsilon, as torch
    theirs = TF.rms_norm(x, (3, 40), w)
    assert (ours.double() - truth).abs().max() <= 2 * (theirs.double() - truth).abs().max() + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_eps_none_is_torchs_default(gen, dtype):
    # torch takes the machine epsilon of the dtype it computes in: float32's for half-precision
    # input (1.2e-7), not the input dtype's (bfloat16's 0.0078 moves every output of a row this small)
    x = (torch.full((2, 8), 1e-2, dtype=torch.float32) + 1e-3 * torch.randn(2, 8, generator=gen)).to(dtype)
    w = torch.randn(8, generator=gen).to(dtype)
    torch.testing.assert_close(NC.rms_norm(x, (8,), w), TF.rms_norm(x, (8,), w))
    module = torch.nn.RMSNorm(8, dtype=dtype)
    ours = RMSNorm(8, eps=None, cast="gemma", dtype=dtype)
    ours.load_state_dict(module.state_dict())
    torch.testing.assert_close(ours(x), module(x))
    if dtype == torch.float32:
        assert not torch.allclose(NC.rms_norm(x, (8,)), F.rms_norm(x))  # normlab's own default (1e-6) differs


def test_empty_inputs_give_empty_results_with_gradients():
    for x, shape in ((torch.randn(4, 0, requires_grad=True), (0,)),
                     (torch.randn(0, 5, requires_grad=True), (5,))):
        for fn in (NC.layer_norm, NC.rms_norm):
            y = fn(x, shape)
            assert y.shape == TF.layer_norm(x, shape).shape == x.shape
            y.sum().backward()
            assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_layer_norm_over_one_feature_has_exactly_zero_input_gradient(gen, backend, dtype):
    x = (torch.randn(7, 1, generator=gen) * 100).to(dtype).requires_grad_()
    r = torch.randn(7, 1, generator=gen).to(dtype).requires_grad_()
    w, b = torch.randn(1, generator=gen).to(dtype), torch.randn(1, generator=gen).to(dtype)
    g = torch.randn(7, 1, generator=gen).to(dtype)
    (dx,) = torch.autograd.grad(F.layer_norm(x, w, b, backend=backend), x, g)
    assert torch.equal(dx, torch.zeros_like(dx))
    y, s = F.add_layer_norm(x, r, w, b, backend=backend)
    gs = torch.randn(7, 1, generator=gen).to(dtype)
    dx, dr = torch.autograd.grad((y, s), (x, r), (g, gs))
    # autograd adds ds to two cancelling terms of size rstd * |g w|: their ulps stay
    if backend == "reference":
        tol = dict(atol=4 * torch.finfo(dtype).eps * 316 * (g.abs().max() * w.abs().max()).item(), rtol=0)
        torch.testing.assert_close(dx, gs.to(dx.dtype), **tol)
        torch.testing.assert_close(dr, gs.to(dr.dtype), **tol)
    else:  # only s's own gradient
        assert torch.equal(dx, gs.to(dx.dtype)) and torch.equal(dr, gs.to(dr.dtype))


def test_mixed_dtypes_follow_torchs_rules_on_cpu(gen):
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    for xd, wd in itertools.product(dtypes, dtypes):
        x, w, b = (
            torch.randn(3, 8, generator=gen).to(xd),
            torch.randn(8, generator=gen).to(wd),
            torch.randn(8).to(wd),
        )
        for ours, theirs in ((lambda: NC.layer_norm(x, (8,), w, b), lambda: TF.layer_norm(x, (8,), w, b)),
                             (lambda: NC.rms_norm(x, (8,), w), lambda: TF.rms_norm(x, (8,), w))):
            try:
                want = theirs()
            except RuntimeError:
                with pytest.raises(TypeError, match="must match"):
                    ours()
                continue
            got = ours()
            assert got.dtype == want.dtype == xd
            torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def test_layer_norms_weight_and_bias_of_two_dtypes_follow_torchs_rules_on_cpu(gen):
    # torch refuses a weight and a bias of two dtypes even where each alone would do (a float32
    # weight and a bfloat16 bias for bfloat16 input), and takes either one alone.
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    for xd, wd, bd in itertools.product(dtypes, (*dtypes, None), (*dtypes, None)):
        if wd == bd:
            continue  # the test above
        x = torch.randn(3, 8, generator=gen).to(xd)
        w, b = (None if d is None else torch.randn(8, generator=gen).to(d) for d in (wd, bd))
        try:
            want = TF.layer_norm(x, (8,), w, b)
        except RuntimeError:
            with pytest.raises(TypeError, match="must match"):
                NC.layer_norm(x, (8,), w, b, backend="reference")
            continue
        got = NC.layer_norm(x, (8,), w, b, backend="reference")
        assert got.dtype == want.dtype == xd, (xd, wd, bd)
        torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def test_bad_normalized_shapes_are_named():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError,
                       match=r"normalized_shape \[4\] must be the trailing dimensions of input, whose shape"):
        NC.layer_norm(x, (4,))
    with pytest.raises(ValueError, match="weight has shape \\[2\\], expected normalized_shape \\[3\\]"):
        NC.rms_norm(x, 3, torch.ones(2))
    with pytest.raises(ValueError, match="non-empty sequence"):
        NC.rms_norm(x, ())


def test_modules_take_torchs_arguments_and_state_dicts(gen):
    x = torch.randn(4, 2, 3, generator=gen, dtype=torch.float64)
    theirs = torch.nn.LayerNorm((2, 3), 1e-5, True, False, dtype=torch.float64)  # positional, as torch's
    ours = LayerNorm((2, 3), 1e-5, True, False, dtype=torch.float64)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(2, 3, generator=gen))
    ours.load_state_dict(theirs.state_dict())
    assert ours.bias is None and ours.weight.shape == (2, 3)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-12)
    theirs_rms = torch.nn.RMSNorm([2, 3], None, True, dtype=torch.float64)
    ours_rms = RMSNorm([2, 3], None, True, dtype=torch.float64)
    with torch.no_grad():
        theirs_rms.weight.copy_(torch.randn(2, 3, generator=gen))
    ours_rms.load_state_dict(theirs_rms.state_dict())
    torch.testing.assert_close(ours_rms(x), theirs_rms(x), rtol=1e-12, atol=1e-12)
    torch.nn.RMSNorm(5).load_state_dict(RMSNorm(5).state_dict())  # and back
    with pytest.raises(ValueError, match="trailing dimensions"):
        ours(torch.randn(4, 3, 2))


def test_a_model_with_torchs_layernorm_swapped_for_normlabs_matches_in_float64(gen):
    def model(norm):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Unflatten(1, (2, 3)), norm, torch.nn.Flatten(),
                                   torch.nn.Linear(6, 4)).double()

    theirs = model(torch.nn.LayerNorm((2, 3)))
    ours = model(torch.nn.LayerNorm((2, 3)))
    ours[1] = LayerNorm((2, 3), dtype=torch.float64)
    ours[1].load_state_dict(theirs[1].state_dict())
    x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-12)
    ours(x).sum().backward()
    theirs(x).sum().backward()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
