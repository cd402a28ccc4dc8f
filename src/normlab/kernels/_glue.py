"""The layer between a backend's launchers and its public functions, shared by every fused backend.

``build`` registers, for one backend, torch.library custom ops (``normlab::<prefix>_*``) with fake
implementations and ``register_autograd``, so that ``torch.compile(fullgraph=True)`` traces models
that use them, plus plain autograd.Functions for eager calls (a custom op's first call imports
torch._dynamo, about a second, and every call pays the dispatcher), and returns the backend's
public functions with the signatures of :mod:`normlab.reference`.

A backend's launchers (``L``) allocate outputs and run its kernels:

- ``rms_fwd_launch(x, weight, eps, inside, llama, offset, k, *, y=None, residual=None, residual_in_fp32=False)``
  -> (y, s or None, rstd float32)
- ``rms_bwd_launch(dy, x, weight, rstd, ds, eps, inside, llama, offset, k, *, grad_dtypes=None)``
  -> (dx, dw)
- ``ln_fwd_launch(x, weight, bias, eps, *, y=None, residual=None, residual_in_fp32=False)``
  -> (y, s or None, mean (``mean_dtype``), rstd float32)
- ``ln_bwd_launch(dy, x, weight, mean, rstd, ds, *, grad_dtypes=None)`` -> (dx, dw, db)
- ``dyt_fwd_launch(x, alpha, weight, bias)`` -> y, and ``dyt_bwd_launch(dy, x, alpha, weight, bias)``
  -> (dx, dalpha float32 in alpha's shape, dw float32, db float32); a backend without them runs
  DyT through the reference
- ``derf_fwd_launch(x, alpha, shift, weight, bias)`` -> y, and ``derf_bwd_launch(dy, x, alpha, shift,
  weight, bias)`` -> (dx, dalpha, dshift, dw, db), the same with Derf's shift; optional too

dw and db are float32, or with ``grad_dtypes`` (the weight's and the bias's dtypes) may come in
those already: the cpu kernels round their sums as they store them, which saves conversions
right after a large kernel, when Python's memory is cold. The eager Functions ask for that; the
custom ops do not, so their schemas and outputs stay as compiled graphs (and their on-disk
caches) know them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from normlab import reference


def _grad_dtype(t: Tensor | None) -> torch.dtype:
    """The dtype of a weight's (bias's) gradient: its own, float32 where there is none."""
    return torch.float32 if t is None else t.dtype


def _sum_dtype(x: Tensor, residual: Tensor, residual_in_fp32: bool) -> torch.dtype:
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return torch.promote_types(dtype, torch.float32) if residual_in_fp32 else dtype


# ------------------------------------------------------------------------------- the ops
# One row per custom op: its schema (options travel as plain scalars, so it stays traceable),
# the launcher call behind it (``L``: the backend's launchers), and its fake implementation,
# which gives tracing the outputs' shapes and dtypes. A forward op returns y, the residual sum
# for the add variants, and the statistics its backward needs.


@dataclass(frozen=True)
class Op:
    name: str
    schema: str
    launch: Callable  # (L, *inputs) -> outputs
    fake: Callable  # (mean_dtype, *inputs) -> empty outputs


def _like(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return x.new_empty(x.shape, dtype=dtype)


def _per_row(x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return x.new_empty(x.shape[:-1], dtype=dtype)


def _per_feature(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[-1:], dtype=torch.float32)


def _without_sum(outputs: tuple) -> tuple:
    """A forward launcher's outputs without the residual sum (None: there was no residual)."""
    return (outputs[0],) + tuple(outputs[2:])


_RMS_OPTS = "float eps, bool inside, bool llama, float offset, int k"

OPS = (
    Op("rms_norm", f"(Tensor x, Tensor? weight, {_RMS_OPTS}) -> (Tensor, Tensor)",
       lambda L, *inputs: _without_sum(L.rms_fwd_launch(*inputs)),
       lambda mean_dtype, x, *_: (_like(x), _per_row(x))),
    Op("add_rms_norm",
       f"(Tensor x, Tensor residual, Tensor? weight, {_RMS_OPTS}, bool residual_in_fp32) -> (Tensor, Tensor, Tensor)",
       lambda L, x, r, w, *opts: L.rms_fwd_launch(x, w, *opts[:-1], residual=r, residual_in_fp32=opts[-1]),
       lambda mean_dtype, x, r, *opts: (_like(x), _like(x, _sum_dtype(x, r, opts[-1])), _per_row(x))),
    Op("rms_norm_backward", f"(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, Tensor? ds, {_RMS_OPTS}) -> (Tensor, Tensor)",
       lambda L, *inputs: L.rms_bwd_launch(*inputs),
       lambda mean_dtype, dy, x, *_: (_like(x), _per_feature(x))),
    Op("layer_norm", "(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
       lambda L, *inputs: _without_sum(L.ln_fwd_launch(*inputs)),
       lambda mean_dtype, x, *_: (_like(x), _per_row(x, mean_dtype), _per_row(x))),
    Op("add_layer_norm",
       "(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, bool residual_in_fp32) -> (Tensor, Tensor, Tensor, Tensor)",
       lambda L, x, r, w, b, eps, fp32: L.ln_fwd_launch(x, w, b, eps, residual=r, residual_in_fp32=fp32),
       lambda mean_dtype, x, r, w, b, eps, fp32: (_like(x), _like(x, _sum_dtype(x, r, fp32)), _per_row(x, mean_dtype), _per_row(x))),
    Op("layer_norm_backward",
       "(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, Tensor? ds) -> (Tensor, Tensor, Tensor)",
       lambda L, *inputs: L.ln_bwd_launch(*inputs),
       lambda mean_dtype, dy, x, *_: (_like(x), _per_feature(x), _per_feature(x))),
    Op("dyt", "(Tensor x, Tensor alpha, Tensor? weight, Tensor? bias) -> Tensor",
       lambda L, *inputs: L.dyt_fwd_launch(*inputs),
       lambda mean_dtype, x, *_: _like(x)),
    Op("dyt_backward", "(Tensor dy, Tensor x, Tensor alpha, Tensor? weight, Tensor? bias) -> (Tensor, Tensor, Tensor, Tensor)",
       lambda L, *inputs: L.dyt_bwd_launch(*inputs),
       lambda mean_dtype, dy, x, alpha, *_: (_like(x), alpha.new_empty(alpha.shape, dtype=torch.float32), _per_feature(x),
                                             _per_feature(x))),
    Op("derf", "(Tensor x, Tensor alpha, Tensor shift, Tensor? weight, Tensor? bias) -> Tensor",
       lambda L, *inputs: L.derf_fwd_launch(*inputs),
       lambda mean_dtype, x, *_: _like(x)),
    Op("derf_backward",
       "(Tensor dy, Tensor x, Tensor alpha, Tensor shift, Tensor? weight, Tensor? bias) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
       lambda L, *inputs: L.derf_bwd_launch(*inputs),
       lambda mean_dtype, dy, x, alpha, shift, *_: (_like(x), alpha.new_empty(alpha.shape, dtype=torch.float32),
                                                    shift.new_empty(shift.shape, dtype=torch.float32), _per_feature(x), _per_feature(x))),
)


# ----------------------------------------------------------------------------- gradients
# What each forward saves, and its gradients. ``bwd`` is the backward custom op under
# torch.compile, or the backward launcher in eager mode; it takes (dy, x, weight, rstd, ds,
# *opts) for rms and (dy, x, weight, bias, mean, rstd, ds) for ln.


def _grad_like(g: Tensor | None, t: Tensor | None, needed: bool) -> Tensor | None:
    return None if t is None or not needed or g is None else g.to(t.dtype)


def _rms_setup(ctx, inputs, output):
    x, weight, *opts = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.opts = tuple(opts)


def _rms_grads(ctx, dy, bwd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = bwd(dy, x, weight, rstd, None, *ctx.opts)
    need = ctx.needs_input_grad
    return _grad_like(dx, x, need[0]), _grad_like(dw, weight, need[1]), None, None, None, None, None


def _add_rms_setup(ctx, inputs, output):
    x, residual, weight, *opts, _ = inputs
    ctx.save_for_backward(output[1], weight, output[2])  # the backward normalizes the sum s
    ctx.opts = tuple(opts)
    ctx.dtypes = (x.dtype, residual.dtype)


def _add_rms_grads(ctx, dy, ds, bwd):
    s, weight, rstd = ctx.saved_tensors
    dsum, dw = bwd(dy, s, weight, rstd, ds, *ctx.opts)
    need = ctx.needs_input_grad
    dx = dsum.to(ctx.dtypes[0]) if need[0] else None
    dres = dsum.to(ctx.dtypes[1]) if need[1] else None
    return dx, dres, _grad_like(dw, weight, need[2]), None, None, None, None, None, None


def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.eps = eps


def _ln_grads(ctx, dy, bwd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = bwd(dy, x, weight, bias, mean, rstd, None)
    need = ctx.needs_input_grad
    return _grad_like(dx, x, need[0]), _grad_like(dw, weight, need[1]), _grad_like(db, bias, need[2]), None


def _add_ln_setup(ctx, inputs, output):
    x, residual, weight, bias, eps, _ = inputs
    ctx.save_for_backward(output[1], weight, bias, output[2], output[3])
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.eps = eps


def _add_ln_grads(ctx, dy, ds, bwd):
    s, weight, bias, mean, rstd = ctx.saved_tensors
    dsum, dw, db = bwd(dy, s, weight, bias, mean, rstd, ds)
    need = ctx.needs_input_grad
    dx = dsum.to(ctx.dtypes[0]) if need[0] else None
    dres = dsum.to(ctx.dtypes[1]) if need[1] else None
    return dx, dres, _grad_like(dw, weight, need[2]), _grad_like(db, bias, need[3]), None, None


def _pointwise_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # x, alpha, (shift,) weight, bias: the backward recomputes f(z)


def _pointwise_grads(ctx, dy, bwd):
    """DyT's and Derf's: every input's gradient comes from the backward, in the inputs' order."""
    grads = bwd(dy, *ctx.saved_tensors)
    return tuple(_grad_like(g, t, need) for g, t, need in zip(grads, ctx.saved_tensors, ctx.needs_input_grad))


# ------------------------------------------------------------- differentiable gradients
# The kernels' backward is not itself differentiable. Under ``create_graph=True`` (a gradient
# penalty, a Hessian-vector product) the gradients come from the reference math on the same
# saved tensors instead, so that they carry a graph rather than silently dropping it.


def _vjp(fn: Callable, inputs: tuple, cotangent: Tensor) -> list:
    """cotangent's vector-Jacobian product with ``fn(*inputs)`` for each of ``inputs`` that needs
    a gradient (None for the others), with its own graph. torch.func's vjp rather than
    autograd.grad: the add variants' saved sum is this node's own output, and autograd.grad
    from it would run this node again, without end."""
    wanted = [i for i, t in enumerate(inputs) if t is not None and t.requires_grad]

    def partial(*args):
        full = list(inputs)
        for i, a in zip(wanted, args):
            full[i] = a
        return fn(*full)

    grads = iter(torch.func.vjp(partial, *(inputs[i] for i in wanted))[1](cotangent) if wanted else ())
    return [next(grads) if i in wanted else None for i in range(len(inputs))]


def _rms_math(ctx, x: Tensor, weight: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    eps, inside, llama, offset, k = ctx.opts
    partial = None if k == x.shape[-1] else k / x.shape[-1]
    return reference.rms_norm(x, weight, eps, eps_mode="inside" if inside else "outside", cast="llama" if llama else "gemma",
                              offset=offset, partial=partial, out_dtype=out_dtype)


def _summed(ctx, dsum: Tensor | None, ds: Tensor) -> tuple:
    """The add variants' gradients for x and residual: what reached the sum, plus ds."""
    dsum = ds if dsum is None else dsum + ds
    need = ctx.needs_input_grad
    return (dsum.to(ctx.dtypes[0]) if need[0] else None), (dsum.to(ctx.dtypes[1]) if need[1] else None)


def _rms_graph(ctx, dy):
    x, weight, _ = ctx.saved_tensors
    return (*_vjp(lambda x, w: _rms_math(ctx, x, w, x.dtype), (x, weight), dy), None, None, None, None, None)


def _add_rms_graph(ctx, dy, ds):
    s, weight, _ = ctx.saved_tensors
    dsum, dw = _vjp(lambda s, w: _rms_math(ctx, s, w, ctx.dtypes[0]), (s, weight), dy)
    return (*_summed(ctx, dsum, ds), dw, None, None, None, None, None, None)


def _ln_graph(ctx, dy):
    x, weight, bias, _, _ = ctx.saved_tensors
    return (*_vjp(lambda x, w, b: reference.layer_norm(x, w, b, ctx.eps), (x, weight, bias), dy), None)


def _add_ln_graph(ctx, dy, ds):
    s, weight, bias, _, _ = ctx.saved_tensors
    dsum, dw, db = _vjp(lambda s, w, b: reference.layer_norm(s, w, b, ctx.eps, out_dtype=ctx.dtypes[0]), (s, weight, bias), dy)
    return (*_summed(ctx, dsum, ds), dw, db, None, None)


GRAPHED = {"rms_norm": _rms_graph, "add_rms_norm": _add_rms_graph, "layer_norm": _ln_graph, "add_layer_norm": _add_ln_graph,
           "dyt": lambda ctx, dy: tuple(_vjp(reference.dyt, ctx.saved_tensors, dy)),
           "derf": lambda ctx, dy: tuple(_vjp(reference.derf, ctx.saved_tensors, dy))}

# forward op -> (setup, gradients, how many outputs users see (0: the op returns one tensor),
# which backward)
AUTOGRAD = {
    "rms_norm": (_rms_setup, _rms_grads, 1, "rms"),
    "add_rms_norm": (_add_rms_setup, _add_rms_grads, 2, "rms"),
    "layer_norm": (_ln_setup, _ln_grads, 1, "ln"),
    "add_layer_norm": (_add_ln_setup, _add_ln_grads, 2, "ln"),
    "dyt": (_pointwise_setup, _pointwise_grads, 0, "dyt"),
    "derf": (_pointwise_setup, _pointwise_grads, 0, "derf"),
}


def _function(prefix: str, name: str, forward: Callable, setup: Callable, grads: Callable, visible: int, bwd: Callable) -> type:
    """The eager door to the same launchers: a plain autograd.Function. A custom op's first call
    imports torch._dynamo (about a second) and every call pays the op dispatcher; eager users
    pay neither."""

    def fwd(ctx, *inputs):
        output = forward(*inputs)
        setup(ctx, inputs, output)
        return output if visible == 0 else output[0] if visible == 1 else tuple(output[:visible])

    def backward(ctx, *grads_out):
        if torch.is_grad_enabled():  # create_graph=True: gradients that can be differentiated again
            return GRAPHED[name](ctx, *grads_out)
        return grads(ctx, *grads_out, bwd)

    return type(f"{prefix}_{name}", (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(backward)})


# ---------------------------------------------------------------------------- a backend


def _under_torch_func(tensors: tuple) -> bool:
    """Whether a torch.func transform (vmap, grad, jacrev, ...) wraps an input. The kernels read
    raw memory, which a transform's wrapper tensors do not expose, so the reference math runs
    there instead: every transform then works, with the reference's numerics."""
    return any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def build(prefix: str, device_types, L, fused_dtypes: tuple, mean_dtype: torch.dtype) -> SimpleNamespace:
    """The public functions of a backend whose launchers are the attributes of ``L``, behind its
    custom ops (``normlab::<prefix>_<op>``, for torch.compile) and eager autograd.Functions."""
    ops, launch = {}, {}
    for op in OPS:
        launch[op.name] = lambda *inputs, _op=op: _op.launch(L, *inputs)
        ops[op.name] = torch.library.custom_op(f"normlab::{prefix}_{op.name}", launch[op.name], mutates_args=(),
                                               device_types=device_types, schema=op.schema)
        ops[op.name].register_fake(lambda *inputs, _op=op: _op.fake(mean_dtype, *inputs))

    def ln_bwd_op(dy, x, weight, bias, mean, rstd, ds):
        return ops["layer_norm_backward"](dy, x, weight, mean, rstd, ds)

    # The eager backward asks for the weight (and bias) gradients in their own dtypes: the cpu
    # kernels round as they store, which saves conversions right after a large kernel.
    def rms_bwd_eager(dy, x, weight, rstd, ds, *opts):
        return L.rms_bwd_launch(dy, x, weight, rstd, ds, *opts, grad_dtypes=(_grad_dtype(weight),))

    def ln_bwd_eager(dy, x, weight, bias, mean, rstd, ds):
        return L.ln_bwd_launch(dy, x, weight, mean, rstd, ds, grad_dtypes=(_grad_dtype(weight), _grad_dtype(bias)))

    traced_bwd = {"rms": ops["rms_norm_backward"], "ln": ln_bwd_op, "dyt": ops["dyt_backward"], "derf": ops["derf_backward"]}
    eager_bwd = {"rms": rms_bwd_eager, "ln": ln_bwd_eager, "dyt": lambda *inputs: L.dyt_bwd_launch(*inputs),
                 "derf": lambda *inputs: L.derf_bwd_launch(*inputs)}
    eager = {}
    for name, (setup, grads, visible, kind) in AUTOGRAD.items():
        ops[name].register_autograd(lambda ctx, *g, _grads=grads, _n=visible, _bwd=traced_bwd[kind]: _grads(ctx, *g[:max(_n, 1)], _bwd),
                                    setup_context=setup)
        eager[name] = _function(prefix, name, launch[name], setup, grads, visible, eager_bwd[kind])

    def call(name: str, *inputs):
        """The op's visible outputs: through its custom op while torch.compile traces, else eagerly."""
        if torch.compiler.is_compiling():
            output = ops[name](*inputs)
            visible = AUTOGRAD[name][2]
            return output if visible == 0 else output[0] if visible == 1 else tuple(output[:2])
        return eager[name].apply(*inputs)

    def fused(*tensors: Tensor | None) -> bool:
        if not all(t is None or t.dtype in fused_dtypes for t in tensors):
            return False
        return torch.compiler.is_compiling() or not _under_torch_func(tensors)

    # ------------------------------------------------------------------ the backend's functions

    def layer_norm(x, weight=None, bias=None, eps=1e-5):
        if not fused(x, weight, bias):
            return reference.layer_norm(x, weight, bias, eps)
        return call("layer_norm", x, weight, bias, eps)

    def rms_norm(x, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0, partial=None):
        if not fused(x, weight):
            return reference.rms_norm(x, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial)
        k = reference.partial_size(x.shape[-1], partial)
        return call("rms_norm", x, weight, eps, eps_mode == "inside", cast == "llama", offset, k)

    def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, residual_in_fp32=False):
        if not fused(x, residual, weight, bias):
            return reference.add_layer_norm(x, residual, weight, bias, eps, residual_in_fp32=residual_in_fp32)
        return call("add_layer_norm", x, residual, weight, bias, eps, residual_in_fp32)

    def add_rms_norm(
        x, residual, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0, partial=None,
        residual_in_fp32=False,
    ):
        if not fused(x, residual, weight):
            return reference.add_rms_norm(
                x, residual, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial,
                residual_in_fp32=residual_in_fp32,
            )
        k = reference.partial_size(x.shape[-1], partial)
        return call("add_rms_norm", x, residual, weight, eps, eps_mode == "inside", cast == "llama", offset, k, residual_in_fp32)

    # ``out=`` variants: eager, no autograd, the kernel writes straight into ``out``.

    def rms_norm_out(x, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0, partial=None, out):
        if not (fused(x, weight) and out.is_contiguous()):
            return out.copy_(reference.rms_norm(x, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial))
        k = reference.partial_size(x.shape[-1], partial)
        L.rms_fwd_launch(x, weight, eps, eps_mode == "inside", cast == "llama", offset, k, y=out)
        return out

    def layer_norm_out(x, weight=None, bias=None, eps=1e-5, *, out):
        if not (fused(x, weight, bias) and out.is_contiguous()):
            return out.copy_(reference.layer_norm(x, weight, bias, eps))
        L.ln_fwd_launch(x, weight, bias, eps, y=out)
        return out

    has_dyt = hasattr(L, "dyt_fwd_launch")

    def dyt(x, alpha, weight=None, bias=None):
        if not (has_dyt and fused(x, weight, bias)):
            return reference.dyt(x, alpha, weight, bias)
        return call("dyt", x, alpha, weight, bias)

    has_derf = hasattr(L, "derf_fwd_launch")

    def derf(x, alpha, shift, weight=None, bias=None):
        if not (has_derf and fused(x, weight, bias)):
            return reference.derf(x, alpha, shift, weight, bias)
        return call("derf", x, alpha, shift, weight, bias)

    return SimpleNamespace(layer_norm=layer_norm, rms_norm=rms_norm, add_layer_norm=add_layer_norm, add_rms_norm=add_rms_norm,
                           rms_norm_out=rms_norm_out, layer_norm_out=layer_norm_out, dyt=dyt, derf=derf)
