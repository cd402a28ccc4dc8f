"""The fused backends' custom ops and autograd, one block per op.

A fused backend (``cpu``, ``triton``) provides launchers that allocate outputs and run its
kernels; :func:`normlab.kernels.dispatch.build` turns them, with the ops below, into the
backend's public functions, with the signatures of :mod:`normlab.reference`, behind two doors to
the same launchers:

- torch.library custom ops (``normlab::<backend>_<op>`` and ``..._backward``) with fake
  implementations and ``register_autograd``, so that ``torch.compile(fullgraph=True)`` traces
  models that use them;
- plain autograd.Functions for eager calls: a custom op's first call imports torch._dynamo (about
  a second) and every call pays the op dispatcher; eager users pay neither.

Each op below is a class read top to bottom: its schema, launcher call and fake implementation,
those of its backward op, what callers see of its outputs, what it saves for the backward, its
gradients from the kernels, and its gradients from the reference math. The kernels' backward is
not itself differentiable, so under ``create_graph=True`` (a gradient penalty, a Hessian-vector
product) the eager Functions take the gradients from the reference math on the same saved
tensors, which carry a graph, instead of silently dropping it.

The launchers a backend provides (``L``):

- ``rms_fwd_launch(x, weight, eps, inside, llama, offset, k, *, y=None, residual=None,
  residual_in_fp32=False, stats=True)`` -> (y, s or None, rstd float32)
- ``rms_bwd_launch(dy, x, weight, rstd, ds, eps, inside, llama, offset, k, *, grad_dtypes=None)``
  -> (dx, dw)
- ``ln_fwd_launch(x, weight, bias, eps, *, y=None, residual=None, residual_in_fp32=False,
  stats=True)`` -> (y, s or None, mean (the backend's ``mean_dtype``), rstd float32)
- ``ln_bwd_launch(dy, x, weight, mean, rstd, ds, *, grad_dtypes=None)`` -> (dx, dw, db)
- optional: ``dyt_fwd_launch(x, alpha, weight, bias)`` -> y and ``dyt_bwd_launch(dy, x, alpha,
  weight, bias)`` -> (dx, dalpha, dw, db); ``derf_fwd_launch(x, alpha, shift, weight, bias)`` and
  ``derf_bwd_launch(...)`` -> (dx, dalpha, dshift, dw, db). Without them the op runs the reference.

``stats=False``: nothing will read the per-row statistics (a forward that records no graph, or
one into ``out=``); a backend may then return None in their place and make no tensor for them.

dw and db are float32, or with ``grad_dtypes`` (the weight's and the bias's dtypes) already in
those: the cpu kernels round their sums as they store them, which saves conversions right after
a large kernel, when memory is cold. The eager Functions ask for that; the custom ops do not, so
their schemas and outputs stay as compiled graphs (and their on-disk caches) know them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from normlab import reference
from normlab.reference import sum_dtype


# ------------------------------------------------------------------------------- helpers


def grad_dtype(t: Tensor | None) -> torch.dtype:
    """The dtype of a weight's (bias's) gradient: its own, float32 where there is none."""
    return torch.float32 if t is None else t.dtype


def _like(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return x.new_empty(x.shape, dtype=dtype)


def _per_row(x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return x.new_empty(x.shape[:-1], dtype=dtype)


def _per_feature(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[-1:], dtype=torch.float32)


def _grad_like(g: Tensor | None, t: Tensor | None, needed: bool) -> Tensor | None:
    return None if t is None or not needed or g is None else g.to(t.dtype)


def _summed(ctx, dsum: Tensor | None, ds: Tensor | None) -> tuple:
    """The add variants' gradients for x and residual: what reached the sum, plus ds."""
    dsum = ds if dsum is None else dsum if ds is None else dsum + ds
    need = ctx.needs_input_grad
    return (dsum.to(ctx.dtypes[0]) if need[0] else None), (dsum.to(ctx.dtypes[1]) if need[1] else None)


def _one_feature(dx: Tensor, x: Tensor, ds: Tensor | None) -> Tensor:
    """LayerNorm's input gradient where rows have one feature: exactly ds (or 0). Such a row
    normalizes to 0 whatever x is, so nothing flows back to x; the kernels' dx formula would
    leave its rounding error instead (torch and the reference give 0)."""
    if x.shape[-1] != 1:
        return dx
    return torch.zeros_like(dx) if ds is None else ds.to(dx.dtype)


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


# Options travel as plain scalars, so that the ops stay traceable.
RMS_OPTIONS = "float eps, bool inside, bool llama, float offset, int k"


def _rms_math(ctx, x: Tensor, weight: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    eps, inside, llama, offset, k = ctx.options
    partial = None if k == x.shape[-1] else k / x.shape[-1]
    return reference.rms_norm(x, weight, eps, eps_mode="inside" if inside else "outside",
                              cast="llama" if llama else "gemma", offset=offset, partial=partial,
                              out_dtype=out_dtype)


# ----------------------------------------------------------------------------- rms_norm


class RMSNorm:
    """y = rms_norm(x, weight); saves rstd (float32, one per row) for the backward."""

    name = "rms_norm"
    schema = f"(Tensor x, Tensor? weight, {RMS_OPTIONS}) -> (Tensor, Tensor)"
    backward_name = "rms_norm_backward"
    backward_schema = (f"(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, Tensor? ds, {RMS_OPTIONS}) "
                       "-> (Tensor, Tensor)")

    @staticmethod
    def launch(L, x, weight, *options, stats=True):
        y, _, rstd = L.rms_fwd_launch(x, weight, *options, stats=stats)
        return y, rstd

    @staticmethod
    def fake(mean_dtype, x, *_):
        return _like(x), _per_row(x)

    @staticmethod
    def backward_launch(L, dy, x, weight, rstd, ds, *options, grad_dtypes=None):
        return L.rms_bwd_launch(dy, x, weight, rstd, ds, *options, grad_dtypes=grad_dtypes)

    @staticmethod
    def backward_fake(mean_dtype, dy, x, *_):
        return _like(x), _per_feature(x)

    @staticmethod
    def public(output):
        return output[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, *options = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.options = tuple(options)

    @staticmethod
    def gradients(ctx, grads, backward):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = backward(grads[0], x, weight, rstd, None, *ctx.options, grad_dtypes=(grad_dtype(weight),))
        need = ctx.needs_input_grad
        return _grad_like(dx, x, need[0]), _grad_like(dw, weight, need[1]), None, None, None, None, None

    @staticmethod
    def differentiable_gradients(ctx, grads):
        x, weight, _ = ctx.saved_tensors
        return (*_vjp(lambda x, w: _rms_math(ctx, x, w, x.dtype), (x, weight), grads[0]), None, None, None,
                None, None)


# ------------------------------------------------------------------------- add_rms_norm


class AddRMSNorm(RMSNorm):
    """(y, s) = (rms_norm(s, weight), s) with s = x + residual in ``sum_dtype``. Its backward is
    RMSNorm's on the saved s, where s's own gradient ds joins: the same backward op."""

    name = "add_rms_norm"
    schema = (f"(Tensor x, Tensor residual, Tensor? weight, {RMS_OPTIONS}, bool residual_in_fp32)"
              " -> (Tensor, Tensor, Tensor)")

    @staticmethod
    def launch(L, x, residual, weight, *options, stats=True):
        *options, residual_in_fp32 = options
        return L.rms_fwd_launch(x, weight, *options, residual=residual, residual_in_fp32=residual_in_fp32,
                                stats=stats)

    @staticmethod
    def fake(mean_dtype, x, residual, *options):
        return _like(x), _like(x, sum_dtype(x, residual, options[-1])), _per_row(x)

    @staticmethod
    def public(output):
        return output[0], output[1]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, residual, weight, *options, _ = inputs
        ctx.save_for_backward(output[1], weight, output[2])
        ctx.options = tuple(options)
        ctx.dtypes = (x.dtype, residual.dtype)

    @staticmethod
    def gradients(ctx, grads, backward):
        s, weight, rstd = ctx.saved_tensors
        dsum, dw = backward(grads[0], s, weight, rstd, grads[1], *ctx.options,
                            grad_dtypes=(grad_dtype(weight),))
        return (*_summed(ctx, dsum, None), _grad_like(dw, weight, ctx.needs_input_grad[2]),
                None, None, None, None, None, None)

    @staticmethod
    def differentiable_gradients(ctx, grads):
        s, weight, _ = ctx.saved_tensors
        dsum, dw = _vjp(lambda s, w: _rms_math(ctx, s, w, ctx.dtypes[0]), (s, weight), grads[0])
        return (*_summed(ctx, dsum, grads[1]), dw, None, None, None, None, None, None)


# ---------------------------------------------------------------------------- layer_norm


class LayerNorm:
    """y = layer_norm(x, weight, bias); saves the mean (``mean_dtype``) and rstd per row."""

    name = "layer_norm"
    schema = "(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)"
    backward_name = "layer_norm_backward"
    backward_schema = ("(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, Tensor? ds) "
                       "-> (Tensor, Tensor, Tensor)")

    @staticmethod
    def launch(L, x, weight, bias, eps, stats=True):
        y, _, mean, rstd = L.ln_fwd_launch(x, weight, bias, eps, stats=stats)
        return y, mean, rstd

    @staticmethod
    def fake(mean_dtype, x, *_):
        return _like(x), _per_row(x, mean_dtype), _per_row(x)

    @staticmethod
    def backward_launch(L, dy, x, weight, mean, rstd, ds, *, grad_dtypes=None):
        return L.ln_bwd_launch(dy, x, weight, mean, rstd, ds, grad_dtypes=grad_dtypes)

    @staticmethod
    def backward_fake(mean_dtype, dy, x, *_):
        return _like(x), _per_feature(x), _per_feature(x)

    @staticmethod
    def public(output):
        return output[0]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, eps = inputs
        ctx.save_for_backward(x, weight, bias, output[1], output[2])
        ctx.eps = eps

    @staticmethod
    def gradients(ctx, grads, backward):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = backward(grads[0], x, weight, mean, rstd, None,
                              grad_dtypes=(grad_dtype(weight), grad_dtype(bias)))
        dx = _one_feature(dx, x, None)
        need = ctx.needs_input_grad
        return _grad_like(dx, x, need[0]), _grad_like(dw, weight,
                                                      need[1]), _grad_like(db, bias, need[2]), None

    @staticmethod
    def differentiable_gradients(ctx, grads):
        x, weight, bias, _, _ = ctx.saved_tensors
        return (*_vjp(lambda x, w, b: reference.layer_norm(x, w, b, ctx.eps), (x, weight, bias), grads[0]),
                None)


# ------------------------------------------------------------------------ add_layer_norm


class AddLayerNorm(LayerNorm):
    """(y, s) = (layer_norm(s, weight, bias), s) with s = x + residual: LayerNorm's backward op, as
    AddRMSNorm has RMSNorm's."""

    name = "add_layer_norm"
    schema = ("(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, bool residual_in_fp32)"
              " -> (Tensor, Tensor, Tensor, Tensor)")

    @staticmethod
    def launch(L, x, residual, weight, bias, eps, residual_in_fp32, stats=True):
        return L.ln_fwd_launch(x, weight, bias, eps, residual=residual, residual_in_fp32=residual_in_fp32,
                               stats=stats)

    @staticmethod
    def fake(mean_dtype, x, residual, weight, bias, eps, residual_in_fp32):
        return _like(x), _like(x,
                               sum_dtype(x, residual, residual_in_fp32)), _per_row(x, mean_dtype), _per_row(x)

    @staticmethod
    def public(output):
        return output[0], output[1]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, residual, weight, bias, eps, _ = inputs
        ctx.save_for_backward(output[1], weight, bias, output[2], output[3])
        ctx.dtypes = (x.dtype, residual.dtype)
        ctx.eps = eps

    @staticmethod
    def gradients(ctx, grads, backward):
        s, weight, bias, mean, rstd = ctx.saved_tensors
        dsum, dw, db = backward(grads[0], s, weight, mean, rstd, grads[1],
                                grad_dtypes=(grad_dtype(weight), grad_dtype(bias)))
        dsum = _one_feature(dsum, s, grads[1])
        need = ctx.needs_input_grad
        return (*_summed(ctx, dsum, None), _grad_like(dw, weight, need[2]), _grad_like(db, bias, need[3]),
                None, None)

    @staticmethod
    def differentiable_gradients(ctx, grads):
        s, weight, bias, _, _ = ctx.saved_tensors
        dsum, dw, db = _vjp(lambda s, w, b: reference.layer_norm(s, w, b, ctx.eps, out_dtype=ctx.dtypes[0]),
                            (s, weight, bias), grads[0])
        return (*_summed(ctx, dsum, grads[1]), dw, db, None, None)


# ----------------------------------------------------------------------- dyt and derf


class DyT:
    """y = weight * tanh(alpha x) + bias. Saves its inputs: the backward recomputes tanh."""

    name = "dyt"
    schema = "(Tensor x, Tensor alpha, Tensor? weight, Tensor? bias) -> Tensor"
    backward_name = "dyt_backward"
    backward_schema = ("(Tensor dy, Tensor x, Tensor alpha, Tensor? weight, Tensor? bias) "
                       "-> (Tensor, Tensor, Tensor, Tensor)")
    formula = staticmethod(reference.dyt)

    @staticmethod
    def launch(L, *inputs, stats=True):  # DyT keeps no statistics
        return L.dyt_fwd_launch(*inputs)

    @staticmethod
    def fake(mean_dtype, x, *_):
        return _like(x)

    @staticmethod
    def backward_launch(L, *inputs, grad_dtypes=None):  # its gradients are float32
        return L.dyt_bwd_launch(*inputs)

    @staticmethod
    def backward_fake(mean_dtype, dy, x, alpha, *_):
        return _like(x), alpha.new_empty(alpha.shape, dtype=torch.float32), _per_feature(x), _per_feature(x)

    @staticmethod
    def public(output):
        return output

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def gradients(ctx, grads, backward):
        """Every input's gradient comes from the backward, in the inputs' order."""
        out = backward(grads[0], *ctx.saved_tensors, grad_dtypes=None)
        return tuple(_grad_like(g, t, need)
                     for g, t, need in zip(out, ctx.saved_tensors, ctx.needs_input_grad))

    @classmethod
    def differentiable_gradients(cls, ctx, grads):
        return tuple(_vjp(cls.formula, ctx.saved_tensors, grads[0]))


class Derf(DyT):
    """y = weight * erf(alpha x + shift) + bias, as DyT with the shift's gradient too."""

    name = "derf"
    backward_name = "derf_backward"
    schema = "(Tensor x, Tensor alpha, Tensor shift, Tensor? weight, Tensor? bias) -> Tensor"
    backward_schema = ("(Tensor dy, Tensor x, Tensor alpha, Tensor shift, Tensor? weight, Tensor? bias)"
                       " -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    formula = staticmethod(reference.derf)

    @staticmethod
    def launch(L, *inputs, stats=True):
        return L.derf_fwd_launch(*inputs)

    @staticmethod
    def backward_launch(L, *inputs, grad_dtypes=None):
        return L.derf_bwd_launch(*inputs)

    @staticmethod
    def backward_fake(mean_dtype, dy, x, alpha, shift, *_):
        per_scalar = alpha.new_empty(alpha.shape,
                                     dtype=torch.float32), shift.new_empty(shift.shape, dtype=torch.float32)
        return _like(x), *per_scalar, _per_feature(x), _per_feature(x)


OPS = (RMSNorm, AddRMSNorm, LayerNorm, AddLayerNorm, DyT, Derf)
