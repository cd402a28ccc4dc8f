"""A short tour of normlab: the norms, the cast orders, and why text models left BatchNorm (seconds once the
kernels are compiled; the first run compiles them, and says so)."""

import torch

import normlab
from normlab import reference

torch.manual_seed(0)
x = torch.randn(4, 8, 512)  # (B, T, d) activations

# 1. The functional API and the modules: same math, statistics in fp32.
w = torch.ones(512)
y = normlab.rms_norm(x, w, eps=1e-6)
print(f"rms_norm: per-token RMS after the norm = {y.pow(2).mean(-1).sqrt().mean():.4f} (1 by construction)")
ln = normlab.LayerNorm(512)
print(f"LayerNorm: mean {ln(x).mean():+.2e}, std {ln(x).std(unbiased=False):.4f}")
print(f"pRMSNorm (p=6.25%): RMS estimated from the first {reference.partial_size(512, 0.0625)} of 512 "
      "features")

# 2. Cast order is a named parameter: Llama and Gemma round differently in bf16.
xb, wb = x.bfloat16() * 3, (1 + 0.1 * torch.randn(512)).bfloat16()
llama = normlab.rms_norm(xb, wb, cast="llama")
gemma = normlab.rms_norm(xb, wb, cast="gemma")
truth = reference.rms_norm(xb.double(), wb.double())
print(
    f"bf16 cast orders: {(llama != gemma).float().mean():.1%} of outputs differ; max error vs float64: llama "
    f"{(llama.double() - truth).abs().max():.2e}, gemma {(gemma.double() - truth).abs().max():.2e}"
)

# 3. BatchNorm over a padded text batch: a sequence's output depends on its batch-mates.
bn, rms = normlab.SequenceBatchNorm(512), normlab.RMSNorm(512)
seq = x[:1, :5]
alone = bn(seq)
mates = torch.cat([seq, torch.randn(3, 5, 512) * 4 + 2])
together = bn(mates)[:1]
print(
    f"SequenceBatchNorm: the same sentence changes by up to {(together - alone).abs().max():.3f} with other "
    f"batch-mates; RMSNorm: {(rms(mates)[:1] - rms(seq)).abs().max():.1f}"
)
print(f"backends available here: {', '.join(normlab.available_backends())}")
