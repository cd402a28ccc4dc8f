"""Patching transformers models (normlab.hf.patching): unpatch restores the original and the
state_dict keys stay, the report is complete, the fused residual add gives the same results, and
a norm normlab does not know, or whose numerics do not match, is left alone and reported."""

import pytest
import torch
from torch import nn

from normlab import hf


def norm_modules(model):
    return [n for n, m in model.named_modules() if "norm" in type(m).__name__.lower()]


@pytest.mark.parametrize("arch", ["gemma2", "qwen3", "gpt2"])
def test_unpatch_restores_the_original_and_keys_stay(arch):
    model = hf.tiny_model(arch)
    ids = torch.randint(0, 256, (2, 16))
    kwargs = {"decoder_input_ids": ids} if arch == "t5" else {}
    with torch.no_grad():
        before = model(ids, **kwargs).logits
    keys = list(model.state_dict())
    report = hf.patch(model)
    assert list(model.state_dict()) == keys
    assert all("forward" in dict(model.named_modules())[n].__dict__ for n, _, _ in report.patched)
    assert hf.unpatch(model) == len(report.patched)
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids, **kwargs).logits, before)


def test_patch_reports_qwen3_head_norms_and_gemma_offset():
    report = hf.patch(hf.tiny_model("qwen3"))
    modes = {n: m for n, _, m in report.patched}
    assert (
        "model.layers.0.self_attn.q_norm" in modes
        and "cast=llama" in modes["model.layers.0.self_attn.q_norm"]
    )
    report = hf.patch(hf.tiny_model("gemma3"))
    assert all("cast=gemma offset=1" in m for _, _, m in report.patched)
    report = hf.patch(hf.tiny_model("bert"))
    assert all(m == "layer_norm eps=1e-12" for _, _, m in report.patched)


def test_fused_residual_gives_the_same_results():
    for dtype in ("fp32", "bf16"):
        r = hf.check_model(hf.tiny_model("llama"), dtype=dtype, fuse_residual=True, repeat=1)
        assert r["fused"] == 2 and r["ok"], r
    assert hf.check_model(hf.tiny_model("gemma"), fuse_residual=True, repeat=1)["fused"] == 2


class OutsideRMSNorm(nn.Module):
    """An RMSNorm with epsilon added outside the square root, as a research model may hold."""

    def __init__(self, d, eps=0.5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        rms = xf.pow(2).mean(-1, keepdim=True).sqrt()
        return self.weight * (xf / (rms + self.variance_epsilon)).to(x.dtype)


@pytest.mark.parametrize("norm, fused", [(nn.LayerNorm, 0), (nn.RMSNorm, 2), (OutsideRMSNorm, 2)])
def test_fused_residual_keeps_the_post_attention_norms_own_numerics(norm, fused):
    # A Llama layer whose post_attention_layernorm was swapped: a LayerNorm is not fused (the fused
    # op is an RMSNorm); torch's RMSNorm (eps None) and epsilon outside the root fuse with them.
    model = hf.tiny_model("llama")
    for layer in model.model.layers:
        layer.post_attention_layernorm = norm(64)
        with torch.no_grad():
            layer.post_attention_layernorm.weight.normal_(1, 0.3)
    for dtype in ("fp32", "bf16"):
        r = hf.check_model(model, dtype=dtype, fuse_residual=True, repeat=1, generate=False)
        assert r["fused"] == fused and r["ok"], r


class OddNorm(nn.Module):
    """A norm normlab does not know."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x / x.abs().amax(-1, keepdim=True) * self.weight


def test_unknown_norm_is_left_alone_and_reported():
    model = nn.Sequential(nn.Linear(8, 8), OddNorm(8), nn.LayerNorm(8))
    report = hf.patch(model)
    assert report.skipped == [("1", "OddNorm", f"no epsilon attribute ({', '.join(hf.patching.EPS_ATTRS)})")]
    assert [n for n, _, _ in report.patched] == ["2"]
    assert "forward" not in model[1].__dict__
    assert "skipped  1 (OddNorm): no epsilon attribute" in str(report)


def wrong_flavor(monkeypatch, cls_name, **change):
    """Make the probe report ``change`` for ``cls_name``'s flavor, as a wrong probe would."""
    identify = hf.patching.identify

    def wrong(module, d, eps):
        spec, why = identify(module, d, eps)
        return ({**spec, **change} if type(module).__name__ == cls_name else spec), why

    monkeypatch.setattr(hf.patching, "identify", wrong)


def test_wrong_numerics_are_caught_before_patching(monkeypatch):
    # a Gemma cast order for Llama's norm: the module's own check sees the rounding differ in bf16
    wrong_flavor(monkeypatch, "LlamaRMSNorm", cast="gemma")
    model = hf.tiny_model("llama").to(torch.bfloat16)
    report = hf.patch(model)
    assert report.patched == [] and len(report.skipped) == 5
    assert all("differ" in reason for _, _, reason in report.skipped)
    # and an offset it does not apply is caught in fp32 too
    wrong_flavor(monkeypatch, "GemmaRMSNorm", offset=0.0)
    report = hf.patch(hf.tiny_model("gemma"))
    assert report.patched == [] and all("numerics differ" in r for _, _, r in report.skipped)


def test_mixed_dtypes_fall_back_to_the_original():
    norm = hf.tiny_model("llama").model.norm  # fp32 weight
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    expected = norm(x)  # HF promotes: fp32 weight * bf16 xhat -> fp32
    hf.patch(norm)
    assert torch.equal(norm(x), expected) and norm(x).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_plain_torch_norms(dtype, eps):
    model = nn.Sequential(nn.RMSNorm(48, eps=eps), nn.Linear(48, 48), nn.LayerNorm(48)).to(dtype)
    with torch.no_grad():
        model[0].weight.normal_(1, 0.2)
        model[2].weight.normal_(1, 0.2)
        model[2].bias.normal_(0, 0.2)
    x = torch.randn(16, 48, dtype=dtype) * 3
    expected = model(x)
    report = hf.patch(model)
    assert [n for n, _, _ in report.patched] == ["0", "2"]
    got = model(x)
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    assert ((got.float() - expected.float()).abs() <= tol * (expected.float().abs() + 1)).all()


class BareRMSNorm(nn.Module):
    """A weightless norm with no weight attribute at all, as NanoChat's, Llama 4's QK norm and
    HRM's are in transformers 5."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_with_no_weight_attribute_is_patched_and_runs(dtype):
    model = nn.Sequential(nn.Linear(40, 40), BareRMSNorm()).to(dtype)
    report = hf.patch(model)
    assert [n for n, _, _ in report.patched] == ["1"]
    x = (torch.randn(6, 40, dtype=torch.float64) * 3).requires_grad_()
    h64 = x @ model[0].weight.double().T + model[0].bias.double()
    y64 = h64 * torch.rsqrt(h64.square().mean(-1, keepdim=True) + 1e-6)
    g = torch.randn_like(y64)
    (dx64,) = torch.autograd.grad(y64, x, g)
    xd = x.detach().to(dtype).requires_grad_()
    y = model(xd)
    (dx,) = torch.autograd.grad(y, xd, g.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 0.05
    assert (y.double() - y64).abs().max() <= tol * y64.abs().max()
    assert (dx.double() - dx64).abs().max() <= tol * dx64.abs().max()


@pytest.mark.parametrize("arch", ["gemma2", "gpt2"])
def test_a_patched_norm_gives_the_bits_of_normlabs_function_and_follows_use_backend(arch):
    # A patched forward on CPU goes straight to the backend (the probe validated its options
    # through normlab.functional once): its outputs and gradients must be functional's, bit for
    # bit, with the backend use_backend picks; an input off the CPU still meets functional's checks.
    import normlab
    from normlab.hf.patching import _apply

    model = hf.tiny_model(arch).to(torch.bfloat16)
    hf.patch(model)
    norms = [m for m in model.modules() if hasattr(m, "_normlab_spec")]
    assert norms
    gen = torch.Generator().manual_seed(0)
    for norm in norms:
        w, b = norm.weight, getattr(norm, "bias", None)
        x = (torch.randn(3, 5, w.shape[0], generator=gen) * 4 + 1).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(norm(x), _apply(norm._normlab_spec, x, w, b))
            with normlab.use_backend("reference"):
                assert torch.equal(norm(x), _apply(norm._normlab_spec, x, w, b, "reference"))
        x.requires_grad_()
        y = norm(x)
        (gx,) = torch.autograd.grad(y.float().square().sum(), x)
        x2 = x.detach().clone().requires_grad_()
        (gx2,) = torch.autograd.grad(_apply(norm._normlab_spec, x2, w, b).float().square().sum(), x2)
        assert torch.equal(gx, gx2)
        with pytest.raises(ValueError, match="weight is on cpu but x is on meta"):
            norm(torch.empty(2, w.shape[0], dtype=torch.bfloat16, device="meta"))
