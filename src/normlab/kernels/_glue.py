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

dw and db are float32, or with ``grad_dtypes`` (the weight's and the bias's dtypes) may come in
those already: the cpu kernels round their sums as they store them, which saves conversions
right after a large kernel, when Python's memory is cold. The eager Functions ask for that; the
custom ops do not, so their schemas and outputs stay as compiled graphs (and their on-disk
caches) know them.
"""

from __future__ import annotations

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


def build(prefix: str, device_types: str, L, fused_dtypes: tuple, mean_dtype: torch.dtype) -> SimpleNamespace:
    """The public functions of a backend whose launchers are the attributes of ``L``."""
    # ------------------------------------------------------------------------------ custom ops
    # Options travel as plain scalars (float, bool, int) so the schema stays simple and traceable.



    @torch.library.custom_op(f"normlab::{prefix}_rms_norm", mutates_args=(), device_types=device_types)
    def _rms_norm_op(
        x: Tensor, weight: Tensor | None, eps: float, inside: bool, llama: bool, offset: float, k: int
    ) -> tuple[Tensor, Tensor]:
        y, _, rstd = L.rms_fwd_launch(x, weight, eps, inside, llama, offset, k)
        return y, rstd


    @_rms_norm_op.register_fake
    def _(x, weight, eps, inside, llama, offset, k):
        return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


    @torch.library.custom_op(f"normlab::{prefix}_add_rms_norm", mutates_args=(), device_types=device_types)
    def _add_rms_norm_op(
        x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, inside: bool, llama: bool, offset: float,
        k: int, residual_in_fp32: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        y, s, rstd = L.rms_fwd_launch(x, weight, eps, inside, llama, offset, k, residual=residual, residual_in_fp32=residual_in_fp32)
        return y, s, rstd


    @_add_rms_norm_op.register_fake
    def _(x, residual, weight, eps, inside, llama, offset, k, residual_in_fp32):
        s = x.new_empty(x.shape, dtype=_sum_dtype(x, residual, residual_in_fp32))
        return x.new_empty(x.shape), s, x.new_empty(x.shape[:-1], dtype=torch.float32)


    @torch.library.custom_op(f"normlab::{prefix}_rms_norm_backward", mutates_args=(), device_types=device_types)
    def _rms_norm_bwd_op(
        dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, ds: Tensor | None, eps: float, inside: bool,
        llama: bool, offset: float, k: int,
    ) -> tuple[Tensor, Tensor]:
        return L.rms_bwd_launch(dy, x, weight, rstd, ds, eps, inside, llama, offset, k)


    @_rms_norm_bwd_op.register_fake
    def _(dy, x, weight, rstd, ds, eps, inside, llama, offset, k):
        return x.new_empty(x.shape), x.new_empty(x.shape[-1:], dtype=torch.float32)


    @torch.library.custom_op(f"normlab::{prefix}_layer_norm", mutates_args=(), device_types=device_types)
    def _layer_norm_op(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        y, _, mean, rstd = L.ln_fwd_launch(x, weight, bias, eps)
        return y, mean, rstd


    @_layer_norm_op.register_fake
    def _(x, weight, bias, eps):
        rows = x.shape[:-1]
        return x.new_empty(x.shape), x.new_empty(rows, dtype=mean_dtype), x.new_empty(rows, dtype=torch.float32)


    @torch.library.custom_op(f"normlab::{prefix}_add_layer_norm", mutates_args=(), device_types=device_types)
    def _add_layer_norm_op(
        x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, residual_in_fp32: bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        y, s, mean, rstd = L.ln_fwd_launch(x, weight, bias, eps, residual=residual, residual_in_fp32=residual_in_fp32)
        return y, s, mean, rstd


    @_add_layer_norm_op.register_fake
    def _(x, residual, weight, bias, eps, residual_in_fp32):
        rows = x.shape[:-1]
        s = x.new_empty(x.shape, dtype=_sum_dtype(x, residual, residual_in_fp32))
        return x.new_empty(x.shape), s, x.new_empty(rows, dtype=mean_dtype), x.new_empty(rows, dtype=torch.float32)


    @torch.library.custom_op(f"normlab::{prefix}_layer_norm_backward", mutates_args=(), device_types=device_types)
    def _layer_norm_bwd_op(
        dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor, ds: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        return L.ln_bwd_launch(dy, x, weight, mean, rstd, ds)


    @_layer_norm_bwd_op.register_fake
    def _(dy, x, weight, mean, rstd, ds):
        d = x.shape[-1:]
        return x.new_empty(x.shape), x.new_empty(d, dtype=torch.float32), x.new_empty(d, dtype=torch.float32)


    # -------------------------------------------------------------------------------- autograd
    # Two doors to the same launchers. Under torch.compile the custom ops above are traced (their
    # fake implementations give shapes, register_autograd gives the backward). In eager mode a plain
    # autograd.Function calls the launchers directly: a custom op's first call imports
    # torch._dynamo (about a second, measured) and every call pays the op dispatcher, neither of
    # which eager users should pay. The gradient code (``_*_grads``) is shared; ``bwd`` is the
    # backward custom op or the backward launcher.


    def _grad_like(g: Tensor | None, t: Tensor | None, needed: bool) -> Tensor | None:
        if t is None or not needed or g is None:
            return None
        return g.to(t.dtype)


    def _rms_setup(ctx, inputs, output):
        x, weight, eps, inside, llama, offset, k = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.opts = (eps, inside, llama, offset, k)


    def _rms_grads(ctx, dy, bwd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = bwd(dy, x, weight, rstd, None, *ctx.opts)
        need = ctx.needs_input_grad
        return _grad_like(dx, x, need[0]), _grad_like(dw, weight, need[1]), None, None, None, None, None


    def _add_rms_setup(ctx, inputs, output):
        x, residual, weight, eps, inside, llama, offset, k, _ = inputs
        ctx.save_for_backward(output[1], weight, output[2])
        ctx.opts = (eps, inside, llama, offset, k)
        ctx.dtypes = (x.dtype, residual.dtype)


    def _add_rms_grads(ctx, dy, ds, bwd):
        s, weight, rstd = ctx.saved_tensors
        dsum, dw = bwd(dy, s, weight, rstd, ds, *ctx.opts)
        need = ctx.needs_input_grad
        dx = dsum.to(ctx.dtypes[0]) if need[0] else None
        dres = dsum.to(ctx.dtypes[1]) if need[1] else None
        return dx, dres, _grad_like(dw, weight, need[2]), None, None, None, None, None, None


    def _ln_setup(ctx, inputs, output):
        x, weight, bias, _ = inputs
        ctx.save_for_backward(x, weight, bias, output[1], output[2])


    def _ln_grads(ctx, dy, bwd):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = bwd(dy, x, weight, bias, mean, rstd, None)
        need = ctx.needs_input_grad
        return _grad_like(dx, x, need[0]), _grad_like(dw, weight, need[1]), _grad_like(db, bias, need[2]), None


    def _add_ln_setup(ctx, inputs, output):
        x, residual, weight, bias, _, _ = inputs
        ctx.save_for_backward(output[1], weight, bias, output[2], output[3])
        ctx.dtypes = (x.dtype, residual.dtype)


    def _add_ln_grads(ctx, dy, ds, bwd):
        s, weight, bias, mean, rstd = ctx.saved_tensors
        dsum, dw, db = bwd(dy, s, weight, bias, mean, rstd, ds)
        need = ctx.needs_input_grad
        dx = dsum.to(ctx.dtypes[0]) if need[0] else None
        dres = dsum.to(ctx.dtypes[1]) if need[1] else None
        return dx, dres, _grad_like(dw, weight, need[2]), _grad_like(db, bias, need[3]), None, None


    # The backward callables the gradient code takes: (dy, x, weight, rstd, ds, *opts) for rms,
    # (dy, x, weight, bias, mean, rstd, ds) for ln; the eager ones ask for the parameters' dtypes.

    def _ln_bwd_op(dy, x, weight, bias, mean, rstd, ds):
        return _layer_norm_bwd_op(dy, x, weight, mean, rstd, ds)


    def _rms_bwd_eager(dy, x, weight, rstd, ds, *opts):
        return L.rms_bwd_launch(dy, x, weight, rstd, ds, *opts, grad_dtypes=(_grad_dtype(weight),))


    def _ln_bwd_eager(dy, x, weight, bias, mean, rstd, ds):
        return L.ln_bwd_launch(dy, x, weight, mean, rstd, ds, grad_dtypes=(_grad_dtype(weight), _grad_dtype(bias)))


    _rms_norm_op.register_autograd(lambda ctx, dy, _: _rms_grads(ctx, dy, _rms_norm_bwd_op), setup_context=_rms_setup)
    _add_rms_norm_op.register_autograd(
        lambda ctx, dy, ds, _: _add_rms_grads(ctx, dy, ds, _rms_norm_bwd_op), setup_context=_add_rms_setup
    )
    _layer_norm_op.register_autograd(lambda ctx, dy, _m, _r: _ln_grads(ctx, dy, _ln_bwd_op), setup_context=_ln_setup)
    _add_layer_norm_op.register_autograd(
        lambda ctx, dy, ds, _m, _r: _add_ln_grads(ctx, dy, ds, _ln_bwd_op), setup_context=_add_ln_setup
    )


    class _RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            y, _, rstd = L.rms_fwd_launch(*inputs)
            _rms_setup(ctx, inputs, (y, rstd))
            return y

        @staticmethod
        def backward(ctx, dy):
            return _rms_grads(ctx, dy, _rms_bwd_eager)


    class _AddRMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, residual, weight, eps, inside, llama, offset, k, residual_in_fp32):
            y, s, rstd = L.rms_fwd_launch(x, weight, eps, inside, llama, offset, k, residual=residual, residual_in_fp32=residual_in_fp32)
            _add_rms_setup(ctx, (x, residual, weight, eps, inside, llama, offset, k, residual_in_fp32), (y, s, rstd))
            return y, s

        @staticmethod
        def backward(ctx, dy, ds):
            return _add_rms_grads(ctx, dy, ds, _rms_bwd_eager)


    class _LayerNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, eps):
            y, _, mean, rstd = L.ln_fwd_launch(x, weight, bias, eps)
            _ln_setup(ctx, (x, weight, bias, eps), (y, mean, rstd))
            return y

        @staticmethod
        def backward(ctx, dy):
            return _ln_grads(ctx, dy, _ln_bwd_eager)


    class _AddLayerNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, residual, weight, bias, eps, residual_in_fp32):
            y, s, mean, rstd = L.ln_fwd_launch(x, weight, bias, eps, residual=residual, residual_in_fp32=residual_in_fp32)
            _add_ln_setup(ctx, (x, residual, weight, bias, eps, residual_in_fp32), (y, s, mean, rstd))
            return y, s

        @staticmethod
        def backward(ctx, dy, ds):
            return _add_ln_grads(ctx, dy, ds, _ln_bwd_eager)


    # ------------------------------------------------------------------- the backend's functions


    def _fused(*tensors: Tensor | None) -> bool:
        return all(t is None or t.dtype in fused_dtypes for t in tensors)


    def layer_norm(x, weight=None, bias=None, eps=1e-5):
        if not _fused(x, weight, bias):
            return reference.layer_norm(x, weight, bias, eps)
        if torch.compiler.is_compiling():
            return _layer_norm_op(x, weight, bias, eps)[0]
        return _LayerNorm.apply(x, weight, bias, eps)


    def rms_norm(x, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0, partial=None):
        if not _fused(x, weight):
            return reference.rms_norm(x, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial)
        args = (x, weight, eps, eps_mode == "inside", cast == "llama", offset, reference.partial_size(x.shape[-1], partial))
        if torch.compiler.is_compiling():
            return _rms_norm_op(*args)[0]
        return _RMSNorm.apply(*args)


    def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, residual_in_fp32=False):
        if not _fused(x, residual, weight, bias):
            return reference.add_layer_norm(x, residual, weight, bias, eps, residual_in_fp32=residual_in_fp32)
        if torch.compiler.is_compiling():
            y, s, _, _ = _add_layer_norm_op(x, residual, weight, bias, eps, residual_in_fp32)
            return y, s
        return _AddLayerNorm.apply(x, residual, weight, bias, eps, residual_in_fp32)


    def add_rms_norm(
        x, residual, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0, partial=None,
        residual_in_fp32=False,
    ):
        if not _fused(x, residual, weight):
            return reference.add_rms_norm(
                x, residual, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial,
                residual_in_fp32=residual_in_fp32,
            )
        args = (x, residual, weight, eps, eps_mode == "inside", cast == "llama", offset, reference.partial_size(x.shape[-1], partial), residual_in_fp32)
        if torch.compiler.is_compiling():
            y, s, _ = _add_rms_norm_op(*args)
            return y, s
        return _AddRMSNorm.apply(*args)


    # ``out=`` variants: eager, no autograd, the kernel writes straight into ``out``.


    def rms_norm_out(x, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0, partial=None, out):
        if not (_fused(x, weight) and out.is_contiguous()):
            return out.copy_(reference.rms_norm(x, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset, partial=partial))
        k = reference.partial_size(x.shape[-1], partial)
        L.rms_fwd_launch(x, weight, eps, eps_mode == "inside", cast == "llama", offset, k, y=out)
        return out


    def layer_norm_out(x, weight=None, bias=None, eps=1e-5, *, out):
        if not (_fused(x, weight, bias) and out.is_contiguous()):
            return out.copy_(reference.layer_norm(x, weight, bias, eps))
        L.ln_fwd_launch(x, weight, bias, eps, y=out)
        return out

    return SimpleNamespace(layer_norm=layer_norm, rms_norm=rms_norm, add_layer_norm=add_layer_norm, add_rms_norm=add_rms_norm,
                           rms_norm_out=rms_norm_out, layer_norm_out=layer_norm_out)
