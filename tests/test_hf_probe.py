"""Finding a norm's flavor by probing (normlab.hf.patching.identify): hand-written norms of each
flavor normlab has are found as that flavor, whatever their class is called, and norms no flavor
reproduces (over channels, stats in bf16, an extra parameter, another call form) are refused."""

import pytest
import torch
from torch import nn

from normlab import hf


class HandRMSNorm(nn.Module):
    """An RMSNorm written as a model family might: fp32 statistics, then a cast order and offset."""

    def __init__(self, d, cast="llama", offset=0.0, outside=False, weight=True):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d) if offset else torch.ones(d)) if weight else None
        self.epsilon, self.cast, self.offset, self.outside = 1e-6, cast, offset, outside

    def forward(self, x):
        xf = x.float()
        ms = xf.pow(2).mean(-1, keepdim=True)
        xhat = xf / (ms.sqrt() + self.epsilon) if self.outside else xf * torch.rsqrt(ms + self.epsilon)
        if self.weight is None:
            return xhat.to(x.dtype)
        if self.cast == "llama":
            return (self.offset + self.weight) * xhat.to(x.dtype)
        return (xhat * (self.offset + self.weight.float())).to(x.dtype)


class ChannelsFirstLayerNorm(nn.Module):
    """ConvNeXt's channels-first LayerNorm: over dimension 1, not the last."""

    def __init__(self, d):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d)), 1e-6

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        return self.weight[:, None] * ((x - u) / torch.sqrt(s + self.eps)) + self.bias[:, None]


class Bf16StatsRMSNorm(HandRMSNorm):
    """Statistics in the input's dtype: agrees in fp32, not in bf16."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.epsilon))


class ScaledRMSNorm(HandRMSNorm):
    def __init__(self, d):
        super().__init__(d)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return super().forward(x) * self.scale


class GatedRMSNorm(HandRMSNorm):
    """Mamba-style: an optional gate the probe never passes."""

    def forward(self, x, gate=None):
        y = super().forward(x)
        return y if gate is None else y * torch.sigmoid(gate)


@pytest.mark.parametrize("cast", ["llama", "gemma"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("outside", [False, True])
def test_each_rms_flavor_is_found(cast, offset, outside):
    norm = HandRMSNorm(24, cast, offset, outside)
    spec, why = hf.identify(norm, 24, 1e-6)
    assert why == ""
    assert spec == {"op": "rms", "cast": cast, "offset": offset, "eps_mode": "outside" if outside
                    else "inside", "eps": 1e-6}


def test_weightless_and_layer_norms_are_found():
    assert hf.identify(HandRMSNorm(16, weight=False), 16, 1e-6)[0]["op"] == "rms"
    ln = nn.LayerNorm(16, eps=1e-12)
    assert hf.identify(ln, 16, 1e-12) == ({"op": "ln", "eps": 1e-12}, "")


@pytest.mark.parametrize("norm, reason", [
    (ChannelsFirstLayerNorm(16), "no normlab flavor agrees"),
    (Bf16StatsRMSNorm(16), "agrees with normlab in fp32 but not in bf16"),
    (ScaledRMSNorm(16), "parameters other than weight and bias (scale)"),
    (nn.GroupNorm(4, 16), "normalizes over the batch or channel groups"),
    (nn.BatchNorm1d(16), "normalizes over the batch or channel groups"),
])
def test_norms_no_flavor_reproduces_are_left_alone(norm, reason):
    model = nn.Sequential(nn.Linear(16, 16), norm)
    report = hf.patch(model)
    assert report.patched == [] and len(report.skipped) == 1 and reason in report.skipped[0][2]
    assert "forward" not in norm.__dict__


def test_a_patched_norm_gives_other_calls_to_its_original():
    norm = GatedRMSNorm(32)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    x, gate = torch.randn(5, 32), torch.randn(5, 32)
    expected, expected_gated = norm(x), norm(x, gate)
    report = hf.patch(norm)
    assert [c for _, c, _ in report.patched] == ["GatedRMSNorm"]
    assert torch.allclose(norm(x), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(norm(x, gate), expected_gated)  # the gate: the original forward, bit for bit


def test_a_weightless_norm_of_any_width_is_patched_for_every_width():
    # no weight, no normalized_shape: Gemma 4's with_scale=False
    norm = HandRMSNorm(8, cast="gemma", weight=False)
    report = hf.patch(norm)
    # no weight: the orders agree
    assert [m for _, _, m in report.patched] == ["rms_norm cast=llama offset=0 eps=1e-06"]
    for d in (5, 200):
        x = torch.randn(3, d, dtype=torch.float64)
        want = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        assert torch.allclose(norm(x.float()).double(), want, rtol=1e-5, atol=1e-6)


def test_a_weight_the_forward_ignores_is_not_applied():
    # Falcon-Mamba's weightless norm keeps a weight buffer it never reads
    class DummyWeightRMSNorm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.eps = 1e-6
            self.weight = nn.Buffer(torch.ones(d), persistent=False)

        def forward(self, x):
            return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    report = hf.patch(nn.Sequential(DummyWeightRMSNorm(16)))
    assert report.patched == [] and "no normlab flavor agrees" in report.skipped[0][2]
