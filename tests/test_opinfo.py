"""torch's own samples for its norms (OpInfo), run through normlab.torch_compat on every backend.

Each sample input of the OpInfos of ``nn.functional.layer_norm`` and ``nn.functional.rms_norm``,
in fp32, fp64, bf16 and fp16, contiguous and not: the output and the gradients of input, weight
and bias (for one random cotangent) must lie as close to the float64 truth as twice torch's own
error, plus the dtype's tolerance (torch's float64 result is the truth, so for fp64 samples the
tolerance alone). The error inputs torch refuses, normlab refuses too.
"""

import pytest
import torch

from torch.testing._internal.common_methods_invocations import op_db  # needs expecttest (test extras)

import normlab.torch_compat as NC
from normlab import kernels
from normlab.testing import tolerance

OPS = {op.name: op for op in op_db if op.name in ("nn.functional.layer_norm", "nn.functional.rms_norm",
                                                   "native_layer_norm")}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
BACKENDS = [b for b in ("reference", "cpu", "triton") if kernels.unavailable_reason(b) is None]


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in memory where the last dimension has stride 2."""
    if t.dim() == 0 or t.numel() == 0:
        return t
    wide = torch.empty(*t.shape, 2, dtype=t.dtype)
    out = wide[..., 0]
    with torch.no_grad():
        out.copy_(t)
    return out.requires_grad_(t.requires_grad)


def _results(fn, x, args, kwargs, cotangent):
    """The output, then the gradients of the inputs that require them, of torch's call form
    fn(x, normalized_shape, weight[, bias], eps=...)."""
    leaves = [t for t in (x, *args) if isinstance(t, torch.Tensor) and t.requires_grad]
    y = fn(x, *args, **kwargs)
    grads = torch.autograd.grad(y, leaves, cotangent, allow_unused=True) if leaves and y.numel() else []
    return [y] + [g for g in grads if g is not None]


def _truth_args(name, sample, dtype):
    """The sample in float64, with rms_norm's default eps made explicit (torch's for the sample's dtype)."""
    def up(t):
        return t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    kwargs = dict(sample.kwargs)
    if name == "nn.functional.rms_norm" and kwargs.get("eps") is None and len(sample.args) < 3:
        kwargs["eps"] = NC.default_rms_eps(dtype)
    return up(sample.input), [up(a) for a in sample.args], kwargs


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["nn.functional.layer_norm", "nn.functional.rms_norm"])
def test_torch_samples_match_within_twice_torchs_error(name, dtype, layout):
    op = OPS[name]
    ours_fn = NC.layer_norm if "layer" in name else NC.rms_norm
    torch_fn = op.op
    gen = torch.Generator().manual_seed(0)
    samples = list(op.sample_inputs("cpu", dtype, requires_grad=True))
    assert samples
    checked = 0
    for i, sample in enumerate(samples):
        x = sample.input if layout == "contiguous" else _noncontiguous(sample.input)
        xt, args_t, kwargs_t = _truth_args(name, sample, dtype)
        shape_out = torch_fn(sample.input, *sample.args, **sample.kwargs).shape
        cotangent = torch.randn(shape_out, generator=gen, dtype=torch.float64)
        truth = _results(torch_fn, xt, args_t, kwargs_t, cotangent)
        theirs = _results(torch_fn, x, sample.args, sample.kwargs, cotangent.to(dtype))
        atol, rtol = tolerance(dtype)
        for backend in BACKENDS:
            ours = _results(lambda *a, **k: ours_fn(*a, backend=backend, **k), x, sample.args, sample.kwargs,
                            cotangent.to(dtype))
            assert len(ours) == len(truth) == len(theirs), (i, backend)
            for k, (o, th, t) in enumerate(zip(ours, theirs, truth)):
                what = f"sample {i} {tuple(sample.input.shape)} {sample.args[0]} {backend}: " + (
                    "output" if k == 0 else f"gradient {k}")
                assert o.shape == t.shape and o.dtype == th.dtype, what
                if t.numel() == 0:
                    continue
                err = (o.double() - t).abs().max().item()
                torch_err = (th.double() - t).abs().max().item()
                bound = 2 * torch_err + atol + rtol * t.abs().max().item()
                assert err <= bound, (f"{what}: error {err:.3g} over {bound:.3g} "
                                      f"(torch's own: {torch_err:.3g})")
                checked += 1
    assert checked >= len(samples)


@pytest.mark.parametrize("name", ["native_layer_norm", "nn.functional.rms_norm"])
def test_what_torch_refuses_normlab_refuses(name):
    errors = list(OPS[name].error_inputs("cpu"))
    assert errors
    fn = NC.rms_norm if "rms" in name else NC.layer_norm
    for error in errors:
        s = error.sample_input
        with pytest.raises(error.error_type):  # torch's refusal
            OPS[name].op(s.input, *s.args, **s.kwargs)
        for backend in BACKENDS:
            with pytest.raises((ValueError, TypeError, RuntimeError)):
                fn(s.input, *s.args, **s.kwargs, backend=backend)
