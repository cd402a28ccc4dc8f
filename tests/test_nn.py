"""Modules: state_dict compatibility with torch, repr, build_norm, and agreement with the functional API."""

import pytest
import torch

import normlab
from normlab import functional as F
from normlab.nn import DyT, L2Norm, LayerNorm, RMSNorm, ScaleNorm, SequenceBatchNorm, build_norm


def test_layer_norm_state_dict_moves_both_ways_with_torch(gen):
    ours, theirs = LayerNorm(24), torch.nn.LayerNorm(24)
    with torch.no_grad():
        theirs.weight.normal_(generator=gen), theirs.bias.normal_(generator=gen)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 24, generator=gen)
    assert torch.allclose(ours(x), theirs(x), atol=1e-6)
    with torch.no_grad():
        ours.weight.mul_(2)
    theirs.load_state_dict(ours.state_dict())
    assert torch.allclose(ours(x), theirs(x), atol=1e-6)
    # bias=False and elementwise_affine=False mirror torch's parameter sets.
    assert LayerNorm(8, bias=False).state_dict().keys() == torch.nn.LayerNorm(8,
                                                                              bias=False).state_dict().keys()
    assert not LayerNorm(8, elementwise_affine=False).state_dict()


def test_rms_norm_loads_torch_and_llama_state_dicts(gen):
    theirs = torch.nn.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        theirs.weight.normal_(generator=gen)
    ours = RMSNorm(32)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 7, 32, generator=gen)
    assert torch.allclose(ours(x), theirs(x), atol=1e-6)
    # Hugging Face's LlamaRMSNorm keeps one parameter, "weight" (dim,): a plain dict stands in.
    ours.load_state_dict({"weight": torch.full((32,), 0.5)})
    assert torch.allclose(ours(x), 0.5 * F.rms_norm(x), atol=1e-6)


def test_rms_norm_weight_starts_at_one_minus_offset():
    assert torch.equal(RMSNorm(4).weight, torch.ones(4))
    gemma = RMSNorm(4, cast="gemma", offset=1.0)
    assert torch.equal(gemma.weight, torch.zeros(4))
    x = torch.randn(2, 4)
    assert torch.allclose(gemma(x), F.rms_norm(x), atol=1e-6)  # effective scale 1 at init
    assert RMSNorm(4, elementwise_affine=False).weight is None


def test_modules_call_the_functional_api_with_their_options(gen):
    m = RMSNorm(40, eps=1e-5, cast="gemma", offset=1.0, eps_mode="outside", partial=0.25)
    with torch.no_grad():
        m.weight.normal_(generator=gen)
    x = torch.randn(3, 40, generator=gen)
    assert torch.equal(m(x), F.rms_norm(x, m.weight, 1e-5, cast="gemma", offset=1.0, eps_mode="outside",
                                        partial=0.25))
    x.requires_grad_()
    m(x).sum().backward()
    assert x.grad is not None and m.weight.grad is not None


def test_repr_shows_the_options():
    assert repr(LayerNorm(16, eps=1e-12)) == "LayerNorm(16, eps=1e-12, elementwise_affine=True, bias=True)"
    r = repr(RMSNorm(16, cast="gemma", offset=1.0, eps_mode="outside", partial=0.5, backend="reference"))
    assert r == ("RMSNorm(16, eps=1e-06, elementwise_affine=True, cast='gemma', offset=1, "
                 "eps_mode='outside', partial=0.5, backend='reference')")
    assert "momentum=0.1" in repr(SequenceBatchNorm(8))


def test_sequence_batch_norm_module_matches_batchnorm1d_and_loads_its_state(gen):
    B, T, d = 4, 6, 10
    bn, ours = torch.nn.BatchNorm1d(d), SequenceBatchNorm(d)
    assert ours.state_dict().keys() == bn.state_dict().keys()
    x = torch.randn(B, T, d, generator=gen) * 2 + 1
    for _ in range(3):
        expected = bn(x.transpose(1, 2)).transpose(1, 2)
        got = ours(x, torch.ones(B, T, dtype=torch.bool))
        assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(ours.running_mean, bn.running_mean, atol=1e-6)
    assert torch.allclose(ours.running_var, bn.running_var, atol=1e-6)
    assert int(ours.num_batches_tracked) == int(bn.num_batches_tracked) == 3
    bn.eval(), ours.eval()
    assert torch.allclose(ours(x), bn(x.transpose(1, 2)).transpose(1, 2), atol=1e-5)
    fresh = SequenceBatchNorm(d)
    fresh.load_state_dict(bn.state_dict())
    assert torch.equal(fresh.running_var, bn.running_var)


def test_sequence_batch_norm_padding_does_not_matter_but_batch_mates_do(gen):
    d = 8
    m = SequenceBatchNorm(d)
    a = torch.randn(1, 5, d, generator=gen)
    pad = torch.zeros(1, 3, d)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    y1 = m(torch.cat([a, pad], 1), mask)
    y2 = m(torch.cat([a, pad + 100.0], 1), mask)
    assert torch.equal(y1[:, :5], y2[:, :5])
    mate = torch.randn(1, 8, d, generator=gen) * 3 + 2
    y3 = m(torch.cat([torch.cat([a, pad], 1), mate]), torch.cat([mask, torch.ones(1, 8, dtype=torch.bool)]))
    assert (y3[0, :5] - y1[0, :5]).abs().max() > 0.1  # the documented failure mode


@pytest.mark.parametrize(
    "kind, cls",
    [("layernorm", LayerNorm), ("rmsnorm", RMSNorm), ("prmsnorm", RMSNorm), ("l2", L2Norm),
     ("scalenorm", ScaleNorm),
     ("batchnorm", SequenceBatchNorm), ("dyt", DyT), ("none", torch.nn.Identity)],
)
def test_build_norm_kinds(kind, cls):
    m = build_norm(kind, 64)
    assert type(m) is cls
    x = torch.randn(2, 3, 64)
    assert m(x).shape == x.shape
    assert kind in normlab.NORM_KINDS


def test_build_norm_options():
    assert build_norm("prmsnorm", 64).partial == 0.0625
    assert build_norm("prmsnorm", 64, partial=0.5).partial == 0.5
    assert build_norm("rmsnorm", 64, weightless=True).weight is None
    assert build_norm("layernorm", 64, weightless=True).weight is None
    assert build_norm("batchnorm", 64, weightless=True).weight is None
    assert build_norm("rmsnorm", 64, eps=1e-5, cast="gemma", offset=1.0).offset == 1.0
    assert isinstance(build_norm("none", 64, weightless=True), torch.nn.Identity)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: build_norm("groupnorm", 8), r"kind must be one of 'layernorm', 'rmsnorm', 'prmsnorm', "
                                             r"'l2', 'scalenorm', 'batchnorm', 'dyt', 'derf', 'none'; got "
                                             r"'groupnorm'"),
        (lambda: build_norm("rmsnorm", 8, partial=0.5), r"partial is an option of kind='prmsnorm'"),
        (lambda: build_norm("layernorm", 8, cast="gemma"),
         r"unknown option\(s\) cast for norm kind 'layernorm'; valid options: "),
        (lambda: build_norm("none", 8, eps=1e-5), r"unknown option\(s\) eps for norm kind 'none'"),
        (lambda: RMSNorm(0), r"dim must be a positive int"),
        (lambda: LayerNorm(8, eps=-1.0), r"eps must be a finite number >= 0"),
        (lambda: RMSNorm(8, cast="t5"), r"cast must be one of 'llama', 'gemma'; got 't5'"),
        (lambda: RMSNorm(8, partial=0), r"partial must be in \(0, 1\]"),
        (lambda: RMSNorm(8, backend="gpu"), r"backend must be one of"),
        (lambda: SequenceBatchNorm(8, momentum=1.5), r"momentum must be a number in \[0, 1\]"),
    ],
)
def test_module_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_module_forward_rejects_wrong_width():
    with pytest.raises(ValueError,
                       match=r"weight has shape \(16,\), expected \(12,\) to match the last dimension of x"):
        RMSNorm(16)(torch.randn(2, 12))


def _sphere_truth(x, scale, eps, g):
    """The float64 math of the Euclidean-norm kinds: scale * x / sqrt(||x||^2 + eps), and its gradients."""
    x = x.detach().double().requires_grad_()
    scale = scale.detach().double().requires_grad_()
    y = scale * x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)
    return (y, *torch.autograd.grad(y, (x, scale), g.double()))


@pytest.mark.parametrize("kind", ["l2", "scalenorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [48, 200])
def test_the_euclidean_norm_kinds_match_the_float64_math(gen, kind, dtype, d):
    """l2 (w * x / ||x||) and scalenorm (g * x / ||x||, g started at sqrt(d)): output and the
    gradients of x and of the scale, on the default backend, within the bound of the reference
    backend in the same dtype."""
    from normlab.testing import assert_close

    x = (torch.randn(6, 5, d, generator=gen, dtype=torch.float64) * 4).to(dtype)
    g = torch.randn(6, 5, d, generator=gen, dtype=torch.float64).to(dtype)
    trained = (torch.randn(d if kind == "l2" else 1, generator=gen, dtype=torch.float64) + 2).to(dtype)
    outs = {}
    for backend in (None, "reference"):
        m = build_norm(kind, d, eps=1e-5, backend=backend, dtype=dtype)
        with torch.no_grad():  # a trained scale, not the initial one
            p = m.weight if kind == "l2" else m.g
            p.copy_(trained)
        xi = x.clone().requires_grad_()
        y = m(xi)
        outs[backend] = (y, *torch.autograd.grad(y, (xi, p), g))
    scale = p if kind == "l2" else p.expand(d)
    truth = _sphere_truth(x, scale, 1e-5, g)
    truth = (truth[0], truth[1], truth[2] if kind == "l2" else truth[2].sum().reshape(1))
    # scalenorm's dscale is one sum of every element's term g * xhat / sqrt(d), which nearly cancel:
    # its rounding error grows as the root of the summed squared terms, not as the result, and one
    # draw of the reference's error is no bound for it (a coin toss, as for a single element)
    terms = g.double() * x.double() / x.double().norm(dim=-1, keepdim=True)
    magnitude = [None, None, None if kind == "l2" else terms.pow(2).sum().sqrt().reshape(1)]
    for name, f, lp, t, rule, mag in zip(("output", "dx", "dscale"), outs[None], outs["reference"], truth,
                                         ("element", "row", "tensor"), magnitude):
        assert f.dtype == dtype
        assert_close(f, t, lowp=lp, dtype=dtype, name=f"{kind} {name}", rule=rule, magnitude=mag)
    # the scale the kind keeps: rows leave with norm |g| (scalenorm) or 1 (l2 with w = 1)
    rows = build_norm(kind, d, dtype=torch.float64)(x.double()).norm(dim=-1)
    assert torch.allclose(rows, torch.full_like(rows, d**0.5 if kind == "scalenorm" else 1.0), rtol=1e-6)


def test_the_euclidean_norm_kinds_refuse_what_they_do_not_have():
    with pytest.raises(ValueError, match="weightless: a scalenorm has one scalar gain"):
        build_norm("scalenorm", 8, weightless=True)
    with pytest.raises(ValueError, match=r"unknown option\(s\) cast for norm kind 'l2'"):
        build_norm("l2", 8, cast="gemma")
    assert build_norm("l2", 8, weightless=True).weight is None
    from normlab.model import ModelConfig

    with pytest.raises(ValueError, match="norm_weightless: norm='scalenorm' has one scalar gain"):
        ModelConfig(norm="scalenorm", norm_weightless=True)


def _per_position_loop(x, mask, steps_seen, running_mean, running_var, momentum, eps, terms=None):
    """float64, one position and one sequence at a time: the per-position BatchNorm of the article.
    ``terms``, if given, receives (|x| + |mean|) / sqrt(var + eps) per element: the size of what the
    output is a difference of, which sets a float32 result's error where var is small."""
    B, T, d = x.shape
    out = torch.empty_like(x, dtype=torch.float64)
    for t in range(T):
        real = [x[b, t].double() for b in range(B) if mask[b, t]]
        if real:
            rows = torch.stack(real)
            mean, var = rows.mean(0), rows.var(0, unbiased=False)
            n = len(real)
            running_mean[t] = (1 - momentum) * running_mean[t] + momentum * mean
            if n > 1:  # one token has no unbiased variance: the running one stays
                running_var[t] = (1 - momentum) * running_var[t] + momentum * var * n / (n - 1)
            steps_seen[t] += n
        else:
            mean, var = torch.zeros(d, dtype=torch.float64), torch.ones(d, dtype=torch.float64)
        for b in range(B):
            out[b, t] = (x[b, t].double() - mean) / torch.sqrt(var + eps)
            if terms is not None:
                terms[b, t] = (x[b, t].double().abs() + mean.abs()) / torch.sqrt(var + eps)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_position_batchnorm_matches_the_float64_loop(gen, dtype):
    B, T, d = 5, 7, 6
    bn = SequenceBatchNorm(d, per_position=True, max_positions=10)
    rm, rv, seen = torch.zeros(10, d, dtype=torch.float64), torch.ones(10, d,
                                                                       dtype=torch.float64), torch.zeros(10)
    for _ in range(3):  # padded to different lengths; the last positions are real in one sequence, then none
        lengths = torch.randint(1, T + 1, (B,), generator=gen)
        lengths[0] = T - 2
        mask = torch.arange(T)[None, :] < lengths[:, None]
        x = (torch.randn(B, T, d, generator=gen) * 3 + 1).to(dtype)
        got = bn(x, mask)
        terms = torch.empty(B, T, d, dtype=torch.float64)
        want = _per_position_loop(x, mask, seen, rm, rv, 0.1, bn.eps, terms)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        # relative to the terms: a position with two close values has a small var, and the float32
        # rounding of x - mean, divided by it, reached 3e-5 on values of 0.9 (one seed in a hundred)
        err = (got.double() - want).abs()[mask]
        assert (err <= tol * (1 + terms[mask])).all(), err.max()
    assert torch.allclose(bn.running_mean.double(), rm,
                          atol=1e-5) and torch.allclose(bn.running_var.double(), rv, atol=1e-4)
    assert torch.equal(bn.seen, seen.long())
    # the input gradient in float64, against the loop's (autograd through the same float64 math)
    x = (torch.randn(B, T, d, generator=gen, dtype=torch.float64) * 3 + 1).requires_grad_()
    mask = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=gen)[:, None]
    up = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    fresh = SequenceBatchNorm(d, per_position=True, max_positions=10, affine=False, dtype=torch.float64)
    (got,) = torch.autograd.grad(fresh(x, mask), x, up * mask[..., None])  # padded outputs feed nothing back
    xl = x.detach().clone().requires_grad_()
    loop = _per_position_loop(xl, mask, torch.zeros(10), torch.zeros(10, d, dtype=torch.float64),
                              torch.ones(10, d, dtype=torch.float64), 0.1, fresh.eps)
    (want,) = torch.autograd.grad(loop, xl, up * mask[..., None])
    assert torch.allclose(got * mask[..., None], want, atol=1e-10)
    bn.eval()  # eval uses each position's running statistics
    x = torch.randn(2, 3, d, generator=gen)
    want = (x.double() - rm[:3]) / torch.sqrt(rv[:3] + bn.eps)
    assert torch.allclose(bn(x).double(), want, atol=1e-5)


def test_per_position_batchnorm_refuses_a_position_training_never_reached():
    bn = SequenceBatchNorm(4, per_position=True, max_positions=16)
    mask = torch.tensor([[True] * 5 + [False] * 3, [True] * 3 + [False] * 5])  # the longest: 5 positions
    bn(torch.randn(2, 8, 4), mask)
    bn.eval()
    assert bn(torch.randn(1, 5, 4)).isfinite().all()
    with pytest.raises(ValueError, match=r"position 5 has no running statistics: .*the longest training "
                                         r"sequence had 5 positions"):
        bn(torch.randn(1, 6, 4))
    # a padded position past it is not a token: nothing to normalize, nothing refused
    assert bn(torch.randn(1, 6, 4), torch.tensor([[True] * 5 + [False]])).shape == (1, 6, 4)
    with pytest.raises(ValueError, match=r"position 16 \(of 17\) is past the last position with statistics"):
        bn(torch.randn(1, 17, 4))
    with pytest.raises(ValueError, match=r"max_positions must be a positive int with per_position=True"):
        SequenceBatchNorm(4, per_position=True)
    with pytest.raises(ValueError, match=r"max_positions applies with per_position=True only"):
        SequenceBatchNorm(4, max_positions=8)
