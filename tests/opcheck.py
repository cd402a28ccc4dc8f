"""The check every fused backend's norm ops are held to (the cpu and the Triton tests import it).

``check`` runs an op's outputs and every gradient on a backend against the float64 reference,
within the bound of normlab.testing: a fused result may be at most twice as far from the float64
truth as the reference computed in the same low-precision dtype, plus about one rounding step.
The add variants' truth normalizes the sum rounded to its dtype (the residual stream the model
carries), and the bounds of results that are differences of larger terms widen to those terms.
"""

import torch

from normlab import functional as F
from normlab import reference
from normlab.testing import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def op_leaves(gen, op, shape, dtype, *, weight=True, bias=True, res_dtype=None, mean=0.0, scale=1.0):
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


def call_op(op, leaves, opts, backend):
    fn = getattr(F, op)
    args = [leaves["x"]]
    if op.startswith("add"):
        args.append(leaves["residual"])
    args.append(leaves.get("weight"))
    if "layer" in op:
        args.append(leaves.get("bias"))
    out = fn(*args, backend=backend, **opts)
    return out if isinstance(out, tuple) else (out,)


def run_op(op, leaves, opts, backend, grads, convert=None):
    leaves = {k: (convert(v) if convert else v.clone()).requires_grad_() for k, v in leaves.items()}
    outs = call_op(op, leaves, opts, backend)
    names = list(leaves)
    gs = torch.autograd.grad(outs, [leaves[n] for n in names], [g.to(o.dtype) for g, o in zip(grads, outs)])
    return outs, dict(zip(names, gs))


def check(gen, op, shape, dtype, opts=None, backend="cpu", leaves=None, **leaf_kw):
    """Outputs and all gradients of ``op`` on ``backend`` against the float64 reference (the
    triton tests use it too). ``leaves`` replaces the random inputs."""
    opts = opts or {}
    leaves = leaves or op_leaves(gen, op, shape, dtype, **leaf_kw)
    with torch.no_grad():
        outs = call_op(op, leaves, opts, "reference")
    # Output gradients in the outputs' dtypes, so the float64 truth sees the very same values.
    grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
    fast, fast_g = run_op(op, leaves, opts, backend, grads)
    lowp, lowp_g = run_op(op, leaves, opts, "reference", grads)
    if op.startswith("add"):
        truth, truth_g = _add_truth(op, leaves, opts, grads, lowp[1])
    else:
        params, opts64 = _truth_params(op, leaves, opts)
        truth, truth_g = run_op(op, {**leaves, **params}, opts64, "reference", grads,
                                convert=lambda t: t.double())
    out_mag = _output_terms(op, leaves, lowp)
    for i, (f, t, lp) in enumerate(zip(fast, truth, lowp)):
        assert f.dtype == lp.dtype and f.shape == lp.shape
        assert_close(f, t, lowp=lp, dtype=lp.dtype, name=f"{op} output {i}", magnitude=out_mag if i == 0
                     else None)
    mag = _grad_terms(op, leaves, opts, grads[0])
    for name in fast_g:
        if name in ("weight", "bias"):
            assert_close(fast_g[name], truth_g[name], lowp=lowp_g[name],
                         dtype=_weight_grad_dtype(op, leaves, opts, name), name=f"{op} d{name}",
                         rule="tensor", magnitude=_param_grad_terms(op, leaves, opts, grads[0], name))
        else:
            assert_close(fast_g[name], truth_g[name], lowp=lowp_g[name], dtype=leaves[name].dtype,
                         name=f"{op} d{name}",
                         rule="row", magnitude=mag)
    return fast, fast_g


FAR_SCALE_OPTIONS = ({"eps": 0.0}, {"eps": 0.0, "eps_mode": "outside"})


def check_far_from_unit_scale(gen, dtype, opts, scale, backend):
    """RMSNorm on rows of size ``scale`` (1e-15, 1e15), where rstd^3, a factor of the backward's
    coefficient, leaves float32's range (1e45, 1e-45) though the coefficient and every gradient
    stay inside it."""
    check(gen, "rms_norm", (4, 300), dtype, opts, backend=backend, scale=scale)
    check(gen, "add_rms_norm", (4, 300), dtype, opts, backend=backend, scale=scale)
    check_rms_dx_alone(gen, (4, 300), dtype, opts, backend, scale)


def check_rms_dx_alone(gen, shape, dtype, opts, backend, scale):
    """rms_norm's input gradient on rows of size ``scale`` against the float64 truth alone,
    without the allowance check() grants for the low-precision reference's own error (torch's
    float32 autograd forms rstd^3, which for rows near 1e15 underflows and takes the coefficient
    with it). Both sides times ``scale``, so the tolerance's absolute part means what it does at 1."""
    leaves = op_leaves(gen, "rms_norm", shape, dtype, scale=scale)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    _, fast = run_op("rms_norm", leaves, opts, backend, [dy])
    _, truth = run_op("rms_norm", leaves, opts, "reference", [dy], convert=lambda t: t.double())
    assert_close(fast["x"].double() * scale, truth["x"] * scale, dtype=dtype, rule="row",
                 name=f"rms_norm dx at {scale:g}")


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


def _truth_params(op, leaves, opts):
    """The weight the float64 truth multiplies by, and its options. The llama order adds the
    offset in float32 and rounds (w + offset) to the output's dtype (x's): that rounding is part
    of the op's definition (as is a float32 weight's on 16-bit x), so the truth takes the rounded
    weight with no offset. Unrounded, it sat up to half a bf16 step from the op where the output
    gradient is float32 (a bf16 x with a float32 residual), beyond a correct kernel's bound. The
    gradient of w is that of w + offset."""
    offset = opts.get("offset", 0.0)
    if not _llama(op, leaves, opts):
        return {}, opts
    weight = (leaves["weight"].float() + offset).to(leaves["x"].dtype)
    return {"weight": weight}, {**opts, "offset": 0.0}


def _llama(op, leaves, opts):
    """Whether ``op`` is an RMSNorm with a weight in the llama order."""
    return "rms" in op and "weight" in leaves and opts.get("cast", "llama") == "llama"


def _weight_grad_dtype(op, leaves, opts, name):
    """The dtype whose tolerance a parameter's gradient gets: its own, or, for RMSNorm's llama
    order, x's where x is the less precise, as that order rounds each xhat to x's dtype before
    the weight sees it (see _param_grad_terms)."""
    dtype = leaves[name].dtype
    if _llama(op, leaves, opts):
        return max(dtype, leaves["x"].dtype, key=lambda t: torch.finfo(t).eps)
    return dtype


def _add_truth(op, leaves, opts, grads, s_lowp):
    """The float64 truth of a fused add + norm. The sum is part of the op's definition: it is
    rounded to its dtype (it is the residual stream the model carries on), so the truth
    normalizes that rounded sum in float64; the gradient reaching x and residual is the norm's
    gradient plus the sum's own."""
    norm = op[len("add_"):]
    s64 = s_lowp.detach().double().requires_grad_()
    rounded, opts = _truth_params(op, leaves, opts)
    params = {k: rounded.get(k, leaves[k]).double().requires_grad_()
              for k in ("weight", "bias") if k in leaves}
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


RMS_OPTIONS = [
    {"eps_mode": "outside"},
    {"cast": "gemma"},
    {"cast": "gemma", "offset": 1.0},
    {"cast": "llama", "offset": 1.0},
    {"partial": 0.0625},
    {"partial": 0.3, "eps_mode": "outside", "cast": "gemma"},
]


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
