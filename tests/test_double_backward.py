"""Double backward: a gradient taken with ``create_graph=True`` can be differentiated again, on
every backend, and its second-order result matches the float64 math.

A gradient penalty (loss + ||dL/dx||^2) and a Hessian-vector product both need it. The fused
kernels' backward is not differentiable, so under create_graph the glue takes the gradients from
the reference math; these tests fail if the first gradient comes back without a graph (the
penalty would be silently dropped) or with the wrong one.
"""

import pytest
import torch

from normlab import functional as F
from normlab import kernels
from normlab import reference as R

BACKENDS = ["cpu", "reference"] + (["triton"] if kernels.unavailable_reason("triton") is None else [])
D = 24

# name -> (which leaves, the op by normlab (backend) and by the float64 reference math)
OPS = {
    "rms_norm": (("x", "w"), lambda v, be: F.rms_norm(v["x"], v["w"], backend=be),
                 lambda v: R.rms_norm(v["x"], v["w"])),
    "rms_norm gemma 1+w": (("x", "w"), lambda v,
                           be: F.rms_norm(v["x"], v["w"], cast="gemma", offset=1.0, backend=be),
                           lambda v: R.rms_norm(v["x"], v["w"], cast="gemma", offset=1.0)),
    "rms_norm outside partial": (("x", "w"), lambda v,
                                 be: F.rms_norm(v["x"], v["w"], eps_mode="outside", partial=0.5, backend=be),
                                 lambda v: R.rms_norm(v["x"], v["w"], eps_mode="outside", partial=0.5)),
    "rms_norm weightless": (("x",), lambda v, be: F.rms_norm(v["x"], backend=be),
                            lambda v: R.rms_norm(v["x"])),
    "layer_norm": (("x", "w", "b"), lambda v, be: F.layer_norm(v["x"], v["w"], v["b"], backend=be),
                   lambda v: R.layer_norm(v["x"], v["w"], v["b"])),
    # Both outputs carry gradient: the normalized one and the sum (the next residual).
    "add_rms_norm": (("x", "r", "w"), lambda v, be: _both(F.add_rms_norm(v["x"], v["r"], v["w"], backend=be)),
                     lambda v: _both(R.add_rms_norm(v["x"], v["r"], v["w"]))),
    "add_layer_norm": (("x", "r", "w", "b"), lambda v,
                       be: _both(F.add_layer_norm(v["x"], v["r"], v["w"], v["b"], backend=be)),
                       lambda v: _both(R.add_layer_norm(v["x"], v["r"], v["w"], v["b"]))),
    "dyt": (("x", "a", "w", "b"), lambda v, be: F.dyt(v["x"], v["a"], v["w"], v["b"], backend=be),
            lambda v: R.dyt(v["x"], v["a"], v["w"], v["b"])),
    "derf": (("x", "a", "s", "w", "b"), lambda v,
             be: F.derf(v["x"], v["a"], v["s"], v["w"], v["b"], backend=be),
             lambda v: R.derf(v["x"], v["a"], v["s"], v["w"], v["b"])),
}


def _both(outputs):
    y, s = outputs
    return y.float() + 0.3 * s.float() ** 2


def _leaves(gen, names, dtype):
    shapes = {"x": (3, 5, D), "r": (3, 5, D), "w": (D,), "b": (D,), "a": (1,), "s": (1,)}
    out = {}
    for n in names:
        t = torch.randn(*shapes[n], generator=gen, dtype=torch.float64)
        out[n] = (t * 0.5 + 1.0 if n == "a" else t).to(dtype).requires_grad_()
    return out


def _penalized(fn, leaves, weights):
    """The gradients of a gradient penalty, d/dθ ||d loss / dx||^2, for every leaf θ."""
    loss = (fn(leaves).float() ** 2 * weights).sum()
    (gx,) = torch.autograd.grad(loss, leaves["x"], create_graph=True)
    assert gx.requires_grad, "the first gradient lost its graph"
    return torch.autograd.grad((gx.float() ** 2).sum(), list(leaves.values()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_gradient_penalty_matches_the_float64_math(gen, backend, dtype, op):
    names, ours, exact = OPS[op]
    leaves = _leaves(gen, names, dtype)
    weights = torch.rand(D, generator=gen)
    got = _penalized(lambda v: ours(v, backend), leaves, weights)
    want = _penalized(exact, {k: v.detach().double().requires_grad_() for k, v in leaves.items()},
                      weights.double())
    tol = 1e-4 if dtype == torch.float32 else 0.06  # relative, in norm over the whole gradient
    for name, g, w in zip(names, got, want):
        scale = w.norm()
        if name in ("a", "s"):  # one number summed over every element: it can cancel far below its terms
            scale = torch.maximum(scale, _scalar_terms(exact, leaves, weights))
        err = ((g.double() - w).norm() / scale.clamp_min(1e-30)).item()
        assert err < tol, f"{op} {backend} {dtype}: d/d{name} off by {err:.2e} relative"


def _scalar_terms(exact, leaves, weights):
    """The float64 gradient of the scalar leaf "a" as the sum of its absolute terms, one per
    element of x (a expanded to x's shape). Where the terms cancel (one seed in some hundreds),
    bf16 inputs leave even torch's own math 10% off the small sum, so the error is judged against
    the terms instead."""
    v = {k: t.detach().double() for k, t in leaves.items()}
    for k in ("a", "s"):
        if k in v:
            v[k] = v[k].expand(v["x"].shape).clone()
    grads = _penalized(exact, {k: t.requires_grad_() for k, t in v.items()}, weights.double())
    return sum(grads[list(v).index(k)].abs().sum() for k in ("a", "s") if k in v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hessian_vector_product_matches_torch(gen, backend):
    x = torch.randn(4, D, generator=gen, requires_grad=True)
    w = torch.randn(D, generator=gen, requires_grad=True)
    v = torch.randn(4, D, generator=gen)

    def hvp(f):
        (g,) = torch.autograd.grad(f(x, w).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad((g * v).sum(), x)[0]

    got = hvp(lambda x, w: F.rms_norm(x, w, backend=backend))
    want = hvp(lambda x, w: torch.nn.functional.rms_norm(x, (D,), w, eps=1e-6))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_plain_backward_still_takes_the_kernels(gen, monkeypatch):
    """Without create_graph the fused backward runs, not the reference's autograd graph."""
    calls = []
    real = R.rms_norm
    monkeypatch.setattr(R, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(4, D, generator=gen, requires_grad=True)
    F.rms_norm(x, backend="cpu").sum().backward()
    assert calls == [] and x.grad is not None
    (g,) = torch.autograd.grad(F.rms_norm(x, backend="cpu").pow(2).sum(), x, create_graph=True)
    assert calls == [1] and g.requires_grad


# torch.func transforms and forward-mode AD see through the ops to the reference math (the
# kernels read raw memory, which a transform's wrapper tensors do not have, and have no jvp);
# before, transforms raised torch's "must override the setup_context staticmethod" error (DyT's
# scalars were not checked for a transform until 2026-12-04) and a dual tensor raised "must
# implement the jvp". Each is checked against the same transform of the float64 reference, with
# respect to every input, the scalars included.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(OPS))
def test_torch_func_transforms_match_the_float64_math(gen, backend, op):
    import torch.autograd.forward_ad as fwAD

    names, ours, theirs = OPS[op]
    leaves = {k: v.detach() for k, v in _leaves(gen, names, torch.float32).items()}
    wide = {k: v.double() for k, v in leaves.items()}
    tangents = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in leaves.items()}

    def loss(fn):
        return lambda values: (fn(values).double() ** 2).sum()

    def per_row(fn, values):  # vmap over the leading dimension of x (and of the residual)
        keys = [k for k in ("x", "r") if k in values]
        batched = torch.func.vmap(lambda *ts: (fn({**values, **dict(zip(keys, ts))}).double() ** 2).sum())
        return batched(*(values[k] for k in keys))

    def dual_tangent(fn, values):  # forward-mode AD through dual tensors, outside torch.func
        with fwAD.dual_level():
            duals = {k: fwAD.make_dual(v, tangents[k].to(v.dtype)) for k, v in values.items()}
            return fwAD.unpack_dual(fn(duals)).tangent

    def transforms(fn, values):
        grads = torch.func.grad(loss(fn))(values)
        return {
            **{f"grad d{k}": g for k, g in grads.items()},
            "jacrev": torch.func.jacrev(lambda x: fn({**values, "x": x}))(values["x"]),
            "vmap": per_row(fn, values),
            "jvp": torch.func.jvp(fn, (values,),
                                  ({k: tangents[k].to(v.dtype) for k, v in values.items()},))[1],
            "dual tangent": dual_tangent(fn, values),
        }

    got = transforms(lambda v: ours(v, backend), leaves)
    want = transforms(theirs, wide)
    for how in want:
        assert got[how] is not None, f"{how}: no result (a tangent dropped)"
        scale = want[how].abs().max().clamp_min(1.0)
        err = ((got[how].double() - want[how]).abs().max() / scale).item()
        assert err < 1e-5, (how, err)
