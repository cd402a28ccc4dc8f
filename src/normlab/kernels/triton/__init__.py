"""The ``triton`` backend: fused Triton kernels for CUDA tensors, behind torch.library custom ops.

Read in this order: ``kernels.py`` (the Triton kernels: one forward and one backward for every
norm, DyT's two), ``launch.py`` (from tensors to a launch: outputs, row views, the kernel's
specialization). This file registers the custom ops (``normlab::triton_*``, through
:func:`normlab.kernels.dispatch.build`, as the cpu backend does) and exposes the public functions with
the signatures of :mod:`normlab.reference`. CPU tensors run too under ``TRITON_INTERPRET=1`` (the
tests), slowly.

dtypes: float32, bfloat16 and float16 are fused; float64 runs the reference. Weights of any float
dtype are read as fp32 (``offset + w``; rounded to the output dtype in the llama order).
"""

from __future__ import annotations

import torch

from normlab.kernels import dispatch
from normlab.kernels.triton import launch
from normlab.kernels.triton.launch import FUSED_DTYPES

_api = dispatch.build("triton", ("cuda", "cpu"), launch, FUSED_DTYPES, torch.float64)
layer_norm, rms_norm = _api.layer_norm, _api.rms_norm
add_layer_norm, add_rms_norm = _api.add_layer_norm, _api.add_rms_norm
rms_norm_out, layer_norm_out = _api.rms_norm_out, _api.layer_norm_out
dyt, derf = _api.dyt, _api.derf

__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "rms_norm_out", "layer_norm_out",
           "dyt", "derf",
           "FUSED_DTYPES"]
