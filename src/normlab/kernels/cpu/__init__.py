"""The ``cpu`` backend: fused numba kernels behind torch.library custom ops.

Read in this order: ``rmsnorm.py`` and ``layernorm.py`` (each op's formula, forward and
backward kernels, top to bottom), ``rows.py`` (what every kernel does per row and chunk),
``simd.py`` and ``codecs.py`` (the vector code and the bf16/fp16 conversions), ``launch.py``
(from tensors to a kernel call) and ``memory.py`` (output buffers, streaming). ``cache.py``
keys numba's on-disk cache by the hash of all the kernel sources. docs/cpu-kernels.md says what
each technique buys, measured.

This file registers the custom ops (``normlab::cpu_*``, through ``_glue.build``), which carry
fake implementations and ``register_autograd`` so that ``torch.compile(fullgraph=True)`` traces
models that use them, and exposes the public functions with the signatures of
:mod:`normlab.reference` (inputs validated by functional.py).

dtypes: float32, bfloat16 and float16 are fused; float64 (and any mix that involves it) runs the
reference, where the extra precision is the point. The same inputs and thread count give
bitwise-identical outputs and gradients.
"""

from __future__ import annotations

import os

import torch

from normlab.kernels import _glue

from . import launch
from .cache import sources_hash
from .layernorm import add_ln_fwd, ln_bwd, ln_fwd
from .memory import env_setting
from .rmsnorm import add_rms_fwd, rms_bwd, rms_fwd

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_api = _glue.build("cpu", "cpu", launch, FUSED_DTYPES, torch.float64)
layer_norm, rms_norm = _api.layer_norm, _api.rms_norm
add_layer_norm, add_rms_norm = _api.add_layer_norm, _api.add_rms_norm
rms_norm_out, layer_norm_out = _api.rms_norm_out, _api.layer_norm_out

KERNELS = (rms_fwd, add_rms_fwd, ln_fwd, add_ln_fwd, rms_bwd, ln_bwd)


def cache_status() -> dict[str, object]:
    """Where numba's on-disk cache lives and whether every kernel has an entry there."""
    entries = {}
    cache_dir = None
    for kernel in KERNELS:
        cache = getattr(kernel, "_cache", None)  # numba internals: guarded, info only
        index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
        cache_dir = getattr(cache, "_cache_path", cache_dir)
        entries[kernel.__name__] = bool(index and os.path.exists(index))
    return {"dir": cache_dir, "sources": sources_hash(), "kernels": entries, "warm": all(entries.values())}


__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "rms_norm_out", "layer_norm_out",
           "cache_status", "env_setting", "FUSED_DTYPES", "KERNELS"]
