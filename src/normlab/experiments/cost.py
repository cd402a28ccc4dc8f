"""What a training run costs before it runs: parameters, tokens, FLOPs and an estimated GPU time,
for `normlab compare --plan` (so that a cluster job can be budgeted before it is submitted).

FLOPs per training token are Kaplan et al. 2020's (Table 1): 6 N for the non-embedding
parameters' matrix multiplies (forward 2 N, backward 4 N) plus 6 L T d for attention's scores and
weighted sums over a context of T tokens (forward 2 L T d). Evaluation and the LM head's
embedding-sized multiply are left out, as in that count.

The time assumes an H100/H200-class GPU's dense bf16 peak of 989 TFLOP/s (NVIDIA's H100 SXM
datasheet, without sparsity) at a model-FLOPs utilization of 35%: what well-tuned PyTorch
training of ~100M-parameter models reaches (small models reach less; the estimate is a budget,
not a measurement).
"""

from __future__ import annotations

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16
MFU = 0.35


def training_flops(parameters: int, n_layers: int, d_model: int, seq_len: int, tokens: int) -> float:
    """6 N D + 6 L T d D (see the module's text)."""
    return 6.0 * parameters * tokens + 6.0 * n_layers * seq_len * d_model * tokens


def gpu_seconds(flops: float, mfu: float = MFU, peak: float = PEAK_FLOPS) -> float:
    return flops / (mfu * peak)


def run_cost(parameters: int, n_layers: int, d_model: int, seq_len: int, steps: int, batch_size: int,
             grad_accum: int = 1) -> dict:
    tokens = steps * batch_size * grad_accum * seq_len
    flops = training_flops(parameters, n_layers, d_model, seq_len, tokens)
    return {"parameters": parameters, "tokens": tokens, "flops": flops, "gpu_s": gpu_seconds(flops)}
