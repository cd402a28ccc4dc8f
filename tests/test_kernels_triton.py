"""The Triton backend against the float64 reference, outputs and every gradient, with the bound
of normlab.testing (the same checker as the cpu backend's).

Without a GPU the kernels run under Triton's interpreter on CPU tensors (conftest.py sets
TRITON_INTERPRET=1), so shapes stay small; tests marked ``gpu`` run real sizes on CUDA and are
skipped without one.
"""

import pytest
import torch

from normlab import functional as F
from normlab import kernels
from normlab.testing import assert_close
from opcheck import (DTYPES, FAR_SCALE_OPTIONS, OPS, RMS_OPTIONS, call_op, check,
                     check_deterministic_weight_grads,
                     check_far_from_unit_scale, op_leaves)

pytest.importorskip("triton", reason="the triton backend needs triton (pip install normlab[gpu])")
from normlab.kernels.triton import launch as T  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tcheck(gen, op, shape, dtype, opts=None, **kw):
    return check(gen, op, shape, dtype, opts, backend="triton", **kw)


def test_triton_backend_runs_here():
    assert kernels.unavailable_reason("triton") is None
    assert kernels.resolve("triton", torch.device(DEVICE)) == "triton"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [1, 3, 123, 3000])
@pytest.mark.parametrize("op", OPS)
def test_every_op_dtype_and_size(gen, op, dtype, d):
    tcheck(gen, op, (3, d), dtype)


@pytest.mark.parametrize("op", OPS)
def test_rows_wider_than_a_block_loop(gen, op, monkeypatch):
    monkeypatch.setattr(T, "MAX_BLOCK", 16)  # 100 columns: 7 steps, the last one partial
    for dtype in (torch.float32, torch.bfloat16):
        tcheck(gen, op, (4, 100), dtype)


@pytest.mark.parametrize("op", OPS)
def test_many_short_rows_in_tiles(gen, op):
    # q/k norms over head_dim: (batch, heads, tokens, 16) gives 16 rows per program and more row
    # tiles than programs, the last one partial
    tcheck(gen, op, (2, 4, 37, 16), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("opts", RMS_OPTIONS, ids=str)
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_rms_options(gen, op, opts, dtype):
    tcheck(gen, op, (5, 96), dtype, opts)


@pytest.mark.parametrize("op", OPS)
def test_without_weight_or_bias_and_leading_dims(gen, op):
    tcheck(gen, op, (2, 3, 40), torch.bfloat16, weight=False, bias=False)
    tcheck(gen, op, (0, 40), torch.float32)
    if "layer" in op:
        tcheck(gen, op, (5, 40), torch.float16, weight=True, bias=False)


@pytest.mark.parametrize("op", ["add_rms_norm", "add_layer_norm"])
def test_residual_in_fp32_and_mixed_residual_dtype(gen, op):
    fast, _ = tcheck(gen, op, (4, 64), torch.bfloat16, {"residual_in_fp32": True})
    assert fast[0].dtype == torch.bfloat16 and fast[1].dtype == torch.float32
    fast, _ = tcheck(gen, op, (4, 64), torch.float16, res_dtype=torch.float32)
    assert fast[1].dtype == torch.float32


@pytest.mark.parametrize("max_block", [4096, 128], ids=["one block", "looped"])
def test_large_mean_rows(gen, monkeypatch, max_block):
    # the float64 mean keeps x - mean exact enough for the input gradient (an fp32 mean of 1e4
    # is off by 5e-4, which the backward multiplies by rstd)
    monkeypatch.setattr(T, "MAX_BLOCK", max_block)
    for dtype in DTYPES:
        tcheck(gen, "layer_norm", (4, 500), dtype, mean=1e4 if dtype != torch.float16 else 1e3)
        tcheck(gen, "add_layer_norm", (4, 500), dtype, mean=1e4 if dtype != torch.float16 else 1e3)


@pytest.mark.parametrize("scale", [1e-15, 1e15])
@pytest.mark.parametrize("opts", FAR_SCALE_OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_rows_far_from_unit_scale(gen, dtype, opts, scale):
    # rstd^3 alone leaves float32: it was once formed first
    check_far_from_unit_scale(gen, dtype, opts, scale, "triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_of_zeros_give_zeros(dtype):
    x = torch.zeros(3, 50, dtype=dtype, device=DEVICE, requires_grad=True)
    w = torch.randn(50).to(dtype).to(DEVICE)
    for fn in (lambda: F.rms_norm(x, w, backend="triton"),
               lambda: F.rms_norm(x, w, eps_mode="outside", backend="triton"),
               lambda: F.layer_norm(x, w, None, backend="triton"),
               lambda: F.add_rms_norm(x, x, w, backend="triton")[0]):
        y = fn()
        assert torch.equal(y, torch.zeros_like(y))
        (g,) = torch.autograd.grad(y.float().sum(), x)
        assert not torch.isnan(g).any()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_non_finite_rows_stay_in_their_row(gen, op, dtype, bad):
    leaves = op_leaves(gen, op, (6, 37), dtype)
    leaves["x"][3, 5] = bad
    outs = call_op(op, leaves, {}, "triton")
    good = [0, 1, 2, 4, 5]
    alone = call_op(op, {k: (v[good] if v.dim() == 2 else v) for k, v in leaves.items()}, {}, "triton")
    for o, r in zip(outs, alone):
        assert torch.isfinite(o[good]).all() and not torch.isfinite(o[3]).all()
        assert torch.equal(o[good], r)


def test_non_contiguous_inputs(gen):
    base = torch.randn(6, 2, 80, generator=gen)
    for x in (base[:, 0], base.transpose(0, 1), base[..., ::2]):
        assert not x.is_contiguous()
        w = torch.randn(x.shape[-1], generator=gen)
        assert_close(F.rms_norm(x, w, backend="triton"), F.rms_norm(x.double(), w.double()),
                     lowp=F.rms_norm(x, w, backend="reference"), dtype=torch.float32)
        y, s = F.add_layer_norm(x, x.flip(-1), w, w, backend="triton")
        assert torch.equal(s, x + x.flip(-1))


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_weight_gradients_are_bitwise_deterministic(gen, op):
    check_deterministic_weight_grads(gen, op, (37, 129), backend="triton")


def test_matches_the_cpu_backend_bitwise_in_the_forward(gen):
    # two independent implementations of the same definition: fp32 statistics, one rounding
    # (two in the llama order); their outputs agree to the last bit almost everywhere
    x = torch.randn(16, 256, generator=gen).bfloat16()
    w = torch.randn(256, generator=gen).bfloat16()
    a, b = F.rms_norm(x, w, backend="triton"), F.rms_norm(x, w, backend="cpu")
    assert (a != b).float().mean() < 0.01


def test_out_writes_into_the_given_tensor(gen):
    x = torch.randn(8, 64, generator=gen).bfloat16()
    w = torch.randn(64, generator=gen).bfloat16()
    out = torch.empty_like(x)
    assert F.rms_norm(x, w, backend="triton", out=out) is out
    assert torch.equal(out, F.rms_norm(x, w, backend="triton"))


# ------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("d", [512, 4096, 65536, 262144])
@pytest.mark.parametrize("op", OPS)
def test_real_sizes_on_gpu(gen, op, d):
    for dtype in DTYPES:
        leaves = op_leaves(gen, op, (max(1, (1 << 22) // d), d), dtype)
        fast = call_op(op, {k: v.cuda() for k, v in leaves.items()}, {}, "triton")
        ref = call_op(op, {k: v.cuda() for k, v in leaves.items()}, {}, "reference")
        truth = call_op(op, {k: v.cuda().double() for k, v in leaves.items()}, {}, "reference")
        assert_close(fast[0].cpu(), truth[0].cpu(), lowp=ref[0].cpu(), dtype=dtype)


@pytest.mark.gpu
def test_compiled_module_on_gpu(gen):
    import normlab

    block = torch.nn.Sequential(normlab.RMSNorm(256), torch.nn.Linear(256, 256),
                                normlab.LayerNorm(256)).cuda()
    x = torch.randn(4, 32, 256, device="cuda", requires_grad=True)
    eager = block(x)
    compiled = torch.compile(block, fullgraph=True)(x)
    assert torch.allclose(eager, compiled, atol=1e-5)
    compiled.sum().backward()


def test_gpu_check_script_runs_its_checks_here():
    # benchmarks/gpu_check.py is run in a short GPU window: its checking code is exercised here
    # first, on small CPU tensors under the interpreter, so that window is not spent on its bugs
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    gen = torch.Generator().manual_seed(0)
    for op in gpu_check.OPS:
        for dtype in gpu_check.DTYPES.values():
            result = gpu_check.check_case(op, dtype, 4, 96, gen, dev="cpu")
            assert set(result["grad_rel_err"]) >= {"x", "weight"}
