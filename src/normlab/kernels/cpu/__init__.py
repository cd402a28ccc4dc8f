"""The ``cpu`` backend: fused numba kernels behind torch.library custom ops.

Read in this order: ``rmsnorm.py``, ``layernorm.py`` (its backward in ``layernorm_bwd.py``) and
``pointwise.py`` (DyT and Derf): each op's formula, forward and backward kernels, top to bottom
(``tanh_erf.py``: DyT's tanh and Derf's erf as vector IR); ``rows.py`` (what every kernel does
per row and chunk), ``simd.py`` and
``codecs.py`` (the vector code and the bf16/fp16 conversions), ``launch.py`` (from tensors to a
kernel call) and ``memory.py`` (output buffers, streaming). ``cache.py`` keys numba's on-disk
cache by the hash of all the kernel sources. docs/cpu-kernels.md says what each technique buys,
measured.

This file registers the custom ops (``normlab::cpu_*``, through :func:`normlab.kernels.dispatch.build`),
which carry fake implementations and ``register_autograd`` so that ``torch.compile(fullgraph=True)`` traces
models that use them, and exposes the public functions with the signatures of
:mod:`normlab.reference` (inputs validated by functional.py).

dtypes: float32, bfloat16 and float16 are fused; float64 (and any mix that involves it) runs the
reference, where the extra precision is the point. The same inputs and thread count give
bitwise-identical outputs and gradients.
"""

from __future__ import annotations

import os

import torch

from normlab.kernels import dispatch

from . import launch
from .cache import sources_hash
from .layernorm import add_ln_fwd, ln_fwd
from .layernorm_bwd import ln_bwd
from .memory import env_setting
from .pointwise import pointwise_bwd, pointwise_fwd
from .rmsnorm import add_rms_fwd, rms_bwd, rms_fwd

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_api = dispatch.build("cpu", "cpu", launch, FUSED_DTYPES, torch.float64)
layer_norm, rms_norm = _api.layer_norm, _api.rms_norm
add_layer_norm, add_rms_norm = _api.add_layer_norm, _api.add_rms_norm
rms_norm_out, layer_norm_out = _api.rms_norm_out, _api.layer_norm_out
dyt, derf = _api.dyt, _api.derf

KERNELS = (rms_fwd, add_rms_fwd, ln_fwd, add_ln_fwd, rms_bwd, ln_bwd, pointwise_fwd, pointwise_bwd)


def cache_status() -> dict[str, object]:
    """Where numba's on-disk cache lives and whether every kernel has an entry there."""
    entries = {}
    cache_dir = None
    for kernel in KERNELS:
        cache = getattr(kernel, "_cache", None)  # numba internals: guarded, info only
        index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
        cache_dir = getattr(cache, "_cache_path", cache_dir)
        entries[kernel.__name__] = bool(index and os.path.exists(index))
    held = sum(entries.values())
    state = ("warm" if held == len(entries) else
             f"partly warm ({held} of {len(entries)} kernels cached; the others compile on their first call)"
             if held else
             "cold (the first call of each kernel compiles it, then caches it)")
    return {"dir": cache_dir, "sources": sources_hash(), "kernels": entries, "warm": held == len(entries),
            "state": state}


def cached_signatures() -> int:
    """How many compiled kernel signatures numba's cache holds for these sources."""
    folder = cache_status()["dir"]
    if not folder or not os.path.isdir(folder):
        return 0
    names = tuple(f"{k.__module__.rsplit('.', 1)[-1]}.{k.__name__}-" for k in KERNELS)
    return sum(1 for f in os.listdir(folder) if f.endswith(".nbc") and f.startswith(names))


def compiled_and_loaded() -> tuple[int, int]:
    """Kernel signatures this process has compiled, and loaded from numba's cache, so far."""
    stats = [k.stats for k in KERNELS]
    return sum(sum(s.cache_misses.values()) for s in stats), sum(sum(s.cache_hits.values()) for s in stats)


__all__ = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "rms_norm_out", "layer_norm_out",
           "cache_status", "cached_signatures", "compiled_and_loaded", "env_setting", "FUSED_DTYPES",
           "KERNELS"]
