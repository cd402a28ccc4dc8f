"""A fused backend's public functions, built from its launchers and the ops of ops.py.

:func:`build` registers each op and its backward as torch.library custom ops (what
torch.compile traces) and as eager autograd.Functions, and returns functions with the signatures
of :mod:`normlab.reference` that pick, per call, the reference math (dtypes the kernels do not
take, torch.func transforms, forward-mode tangents), the custom op (while compiling), the bare
launcher (no graph to record) or the autograd.Function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch.autograd import forward_ad

from normlab import reference
from normlab.kernels.ops import OPS


def _eager_function(prefix: str, op, L) -> type:
    """The eager door to the op's launchers: a plain autograd.Function, whose backward asks for
    the weight's (bias's) gradient in its own dtype."""
    backward_launch = functools.partial(op.backward_launch, L)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = op.launch(L, *inputs)
            op.setup_context(ctx, inputs, output)
            return op.public(output)

        @staticmethod
        def backward(ctx, *grads):
            if torch.is_grad_enabled():  # create_graph=True: gradients that can be differentiated again
                return op.differentiable_gradients(ctx, grads)
            return op.gradients(ctx, grads, backward_launch)

    Eager.__name__ = Eager.__qualname__ = f"{prefix}_{op.name}"
    return Eager


def _custom_op(prefix: str, device_types, name: str, schema: str, launch: Callable, fake: Callable):
    custom = torch.library.custom_op(f"normlab::{prefix}_{name}", launch, mutates_args=(),
                                     device_types=device_types,
                                     schema=schema)
    custom.register_fake(fake)
    return custom


def _custom_ops(prefix: str, device_types, L, mean_dtype: torch.dtype) -> dict:
    """Each op and its backward as torch.library custom ops, the op's autograd through the latter.
    The backward ops' gradients stay float32 (their schema has no grad_dtypes)."""
    backward_ops, forward_ops = {}, {}
    for op in OPS:
        if op.backward_name not in backward_ops:
            backward_ops[op.backward_name] = _custom_op(prefix, device_types, op.backward_name,
                                                        op.backward_schema,
                                                        functools.partial(op.backward_launch, L),
                                                        functools.partial(op.backward_fake, mean_dtype))
        forward_ops[op.name] = _custom_op(prefix, device_types, op.name, op.schema,
                                          functools.partial(op.launch, L),
                                          functools.partial(op.fake, mean_dtype))

        def traced_backward(*inputs, grad_dtypes=None, _backward_op=backward_ops[op.backward_name]):
            return _backward_op(*inputs)

        forward_ops[op.name].register_autograd(
            lambda ctx, *grads, _op=op, _backward=traced_backward: _op.gradients(ctx, grads, _backward),
            setup_context=op.setup_context)
    return forward_ops


def _under_torch_func(tensors: tuple) -> bool:
    """Whether a torch.func transform (vmap, grad, jacrev, ...) wraps an input. The kernels read
    raw memory, which a transform's wrapper tensors do not expose, so the reference math runs
    there instead: every transform then works, with the reference's numerics. (Outside every
    transform, one call answers for all the tensors.)"""
    if not torch._C._are_functorch_transforms_active():
        return False
    for t in tensors:
        if t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t):
            return True
    return False


def _has_tangent(tensors: tuple) -> bool:
    """Whether forward-mode AD carries a tangent on an input (a dual tensor). The kernels have no
    jvp, so the reference math runs there, as under torch.func: the tangent is then exact, never
    dropped."""
    if forward_ad._current_level < 0:  # no dual level open: the common case costs one compare
        return False
    for t in tensors:
        if t is not None and forward_ad.unpack_dual(t).tangent is not None:
            return True
    return False


def _records_nothing(tensors: tuple) -> bool:
    """Whether autograd has nothing to record for a call on ``tensors`` (every tensor input): none
    requires grad, or grad mode is off. There the autograd.Function is skipped, a fifth of a small
    call's time. (Inputs with a forward-mode tangent never get here: they take the reference math.)"""
    if torch.is_grad_enabled():
        for t in tensors:
            if t is not None and t.requires_grad:
                return False
    return True


def build(prefix: str, device_types, L, fused_dtypes: tuple, mean_dtype: torch.dtype) -> SimpleNamespace:
    """The public functions of a backend whose launchers are the attributes of ``L``."""
    traced = _custom_ops(prefix, device_types, L, mean_dtype)
    eager = {op.name: _eager_function(prefix, op, L) for op in OPS}
    launch = {op.name: op.launch for op in OPS}
    public = {op.name: op.public for op in OPS}
    is_compiling = torch.compiler.is_compiling

    # A small call's time is mostly this Python, more so inside a model (docs/cpu-kernels.md, "Fixed
    # costs of a call"): the path below asks each question once and makes no generator.

    def fused(tensors: tuple, compiling: bool, scalars: tuple = ()) -> bool:
        """Whether the kernels take the call: the dtypes of ``tensors`` (x and the per-feature
        parameters), and (outside torch.compile, which traces no functorch wrapper) no torch.func
        transform and no forward-mode tangent on them or on ``scalars`` (DyT's and Derf's)."""
        for t in tensors:
            if t is not None and t.dtype not in fused_dtypes:
                return False
        if compiling:
            return True
        both = tensors + scalars if scalars else tensors
        return not (_under_torch_func(both) or _has_tangent(both))

    def call(name: str, tensors: tuple, inputs: tuple, reference_math: Callable, scalars: tuple = ()):
        """The op's outputs callers see: the reference math where the kernels cannot run; through
        its custom op while torch.compile traces; straight from the launcher (no statistics kept)
        when there is no graph to record; else through its autograd.Function."""
        compiling = is_compiling()
        if not fused(tensors, compiling, scalars):
            return reference_math()
        if compiling:
            return public[name](traced[name](*inputs))
        if _records_nothing(tensors + scalars if scalars else tensors):
            return public[name](launch[name](L, *inputs, stats=False))
        return eager[name].apply(*inputs)

    def layer_norm(x, weight=None, bias=None, eps=1e-5):
        return call("layer_norm", (x, weight, bias), (x, weight, bias, eps),
                    lambda: reference.layer_norm(x, weight, bias, eps))

    def rms_norm(x, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0, partial=None):
        k = x.shape[-1] if partial is None else reference.partial_size(x.shape[-1], partial)
        return call("rms_norm", (x, weight),
                    (x, weight, eps, eps_mode == "inside", cast == "llama", offset, k),
                    lambda: reference.rms_norm(x, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset,
                                               partial=partial))

    def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, residual_in_fp32=False):
        return call("add_layer_norm", (x, residual, weight, bias),
                    (x, residual, weight, bias, eps, residual_in_fp32),
                    lambda: reference.add_layer_norm(x, residual, weight, bias, eps,
                                                     residual_in_fp32=residual_in_fp32))

    def add_rms_norm(x, residual, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0,
                     partial=None,
                     residual_in_fp32=False):
        k = reference.partial_size(x.shape[-1], partial)
        return call("add_rms_norm", (x, residual, weight),
                    (x, residual, weight, eps, eps_mode == "inside", cast == "llama", offset, k,
                     residual_in_fp32),
                    lambda: reference.add_rms_norm(x, residual, weight, eps, eps_mode=eps_mode, cast=cast,
                                                   offset=offset,
                                                   partial=partial, residual_in_fp32=residual_in_fp32))

    # ``out=`` variants: eager, no autograd, the kernel writes straight into ``out``.

    def rms_norm_out(x, weight=None, eps=1e-6, *, eps_mode="inside", cast="llama", offset=0.0, partial=None,
                     out):
        if not (fused((x, weight), torch.compiler.is_compiling()) and out.is_contiguous()):
            return out.copy_(reference.rms_norm(x, weight, eps, eps_mode=eps_mode, cast=cast, offset=offset,
                                                partial=partial))
        k = reference.partial_size(x.shape[-1], partial)
        L.rms_fwd_launch(x, weight, eps, eps_mode == "inside", cast == "llama", offset, k, y=out, stats=False)
        return out

    def layer_norm_out(x, weight=None, bias=None, eps=1e-5, *, out):
        if not (fused((x, weight, bias), torch.compiler.is_compiling()) and out.is_contiguous()):
            return out.copy_(reference.layer_norm(x, weight, bias, eps))
        L.ln_fwd_launch(x, weight, bias, eps, y=out, stats=False)
        return out

    has_dyt, has_derf = hasattr(L, "dyt_fwd_launch"), hasattr(L, "derf_fwd_launch")

    def dyt(x, alpha, weight=None, bias=None):
        if not has_dyt:
            return reference.dyt(x, alpha, weight, bias)
        return call("dyt", (x, weight, bias), (x, alpha, weight, bias),
                    lambda: reference.dyt(x, alpha, weight, bias),
                    (alpha,))

    def derf(x, alpha, shift, weight=None, bias=None):
        if not has_derf:
            return reference.derf(x, alpha, shift, weight, bias)
        return call("derf", (x, weight, bias), (x, alpha, shift, weight, bias),
                    lambda: reference.derf(x, alpha, shift, weight, bias), (alpha, shift))

    return SimpleNamespace(layer_norm=layer_norm, rms_norm=rms_norm, add_layer_norm=add_layer_norm,
                           add_rms_norm=add_rms_norm, rms_norm_out=rms_norm_out,
                           layer_norm_out=layer_norm_out,
                           dyt=dyt, derf=derf)
