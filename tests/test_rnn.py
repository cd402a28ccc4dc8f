"""The normalized GRU of the speed preset: its recurrence matches a plain loop over Ba et al.'s
equations, and its norm kind is checked."""

import pytest
import torch

from normlab import reference
from normlab.rnn import GRULM, NormGRU


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norm_gru_follows_its_equations(gen, norm):
    torch.manual_seed(gen.initial_seed() % 2**31)
    cell = NormGRU(8, norm)
    x = torch.randn(2, 5, 8, generator=gen)
    n = (lambda t: reference.layer_norm(t, None, None, eps=1e-5)) if norm == "layernorm" else (
        lambda t: reference.rms_norm(t, None, eps=1e-6))  # the modules' default eps
    h = torch.zeros(2, 8)
    for t in range(5):
        r, z = torch.sigmoid(n(cell.wx(x[:, t])) + n(cell.wh(h))).chunk(2, dim=-1)
        c = torch.tanh(n(cell.cx(x[:, t])) + r * n(cell.ch(h)))
        h = (1 - z) * h + z * c
    assert torch.allclose(cell(x)[:, -1], h, atol=1e-5)


def test_gru_lm_trains_a_step_and_rejects_other_norms():
    model = GRULM(16, 8, "rmsnorm")
    idx = torch.randint(0, 16, (2, 6))
    _, loss = model(idx, idx)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="norm must be one of layernorm, rmsnorm; got 'batchnorm'"):
        NormGRU(8, "batchnorm")
