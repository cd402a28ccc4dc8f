"""What a run needs from the machine. Memory: estimated from the config before anything is built,
so that a config that cannot fit (n_layers = 10^6, d_model = 2^20, batch_size = 10^9) is refused
with the numbers instead of running until it is killed or dies in the allocator. CPU: a run whose
steps slow down many times against its own best is sharing the cores, and says so on stderr.

The estimate counts float32 parameters, their gradients and AdamW's two moments (16 bytes a
parameter), the position tables, the activations autograd keeps for one micro-batch (per token
and layer: about ten d-wide tensors and four of the MLP's width; attention runs in
``scaled_dot_product_attention``, whose fused kernels keep no seq x seq matrix),
the logits with their softmax and gradient, and the fixed validation batches. It is a lower bound
of the right order, not a prediction: a config is refused only when it exceeds all the memory
the device has.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

from normlab.model import ModelConfig

GiB = 2**30


class TooLarge(MemoryError, ValueError):
    """A config that cannot fit the device: a MemoryError, and bad input (a ValueError) that the
    CLI reports in one line."""


def parameters(cfg: ModelConfig) -> int:
    """The model's parameter count, from its config alone (norm weights included roughly)."""
    d, hd = cfg.d_model, cfg.head_dim
    attention = d * (cfg.n_heads + 2 * cfg.kv_heads) * hd + cfg.n_heads * hd * d
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.ff_dim
    norms = 4 * d
    embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    positions = cfg.max_seq_len * d if cfg.positions == "learned" else 0
    return cfg.n_layers * (attention + mlp + norms) + embed + positions + d


def estimate(cfg: ModelConfig, batch: int, seq: int, *, training: bool = True,
             eval_batches: int = 0) -> dict[str, int]:
    """Bytes by part for a model of ``cfg`` taking micro-batches of ``batch`` sequences of ``seq``
    tokens (training: with gradients and optimizer state)."""
    tokens = batch * seq
    per_token_layer = 10 * cfg.d_model + 4 * cfg.ff_dim
    parts = {
        "parameters": parameters(cfg) * (16 if training else 4),
        "position tables": 2 * cfg.max_seq_len * max(cfg.head_dim, cfg.d_model) * 4,
        "activations": tokens * cfg.n_layers * per_token_layer * 4 * (1 if training else 0)
        + tokens * 4 * cfg.d_model * 4,
        "logits": tokens * cfg.vocab_size * 4 * (3 if training else 1),
        "validation batches": eval_batches * batch * (seq + 1) * 8 * 2,
    }
    return parts


def device_memory(device: torch.device) -> int:
    """All the memory ``device`` has: the GPU's, or the machine's RAM (or the cgroup's limit, if lower)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def check_fits(cfg: ModelConfig, batch: int, seq: int, device: torch.device, *, training: bool = True,
               eval_batches: int = 0, what: str = "this run") -> None:
    """Raise TooLarge (a MemoryError), with the estimate and the device's memory, when ``cfg`` cannot fit."""
    parts = estimate(cfg, batch, seq, training=training, eval_batches=eval_batches)
    need, have = sum(parts.values()), device_memory(device)
    if need <= have:
        return
    detail = ", ".join(f"{name} {size / GiB:,.1f}" for name, size in parts.items() if size >= GiB / 10)
    raise TooLarge(
        f"{what} needs at least {need / GiB:,.1f} GiB ({detail}; d_model {cfg.d_model}, n_layers "
        f"{cfg.n_layers}, vocab {cfg.vocab_size}, {batch} sequences of {seq} tokens), more than the "
        f"{have / GiB:,.1f} GiB this {'GPU' if device.type == 'cuda' else 'machine'} has; make the model, "
        "batch_size, seq_len or eval_batches smaller"
    )


CONTENTION_WINDOW, CONTENTION_FACTOR = 10, 5.0


def slowdown(step_ms: list[float], window: int = CONTENTION_WINDOW) -> float | None:
    """How many times slower the last ``window`` steps ran (median) than this run's fastest window
    so far, once there are two windows; None before."""
    if len(step_ms) < 2 * window:
        return None
    medians = [statistics.median(step_ms[i:i + window]) for i in range(0, len(step_ms) - window + 1, window)]
    return statistics.median(step_ms[-window:]) / min(medians)


_told_contended = False  # once a process: a lab trains many runs in one
_torch_threads = torch.get_num_threads  # (a test stands in for it)


def warn_if_contended(step_ms: list[float]) -> bool:
    """Say (on stderr, once a process) when steps have become CONTENTION_FACTOR times slower than
    the run's best: on a CPU other processes load, torch's threads then wait on each other."""
    global _told_contended
    factor, threads = slowdown(step_ms), _torch_threads()
    if factor is None or factor < CONTENTION_FACTOR or threads < 2:  # one thread: fewer cannot help
        return False
    if not _told_contended:
        _told_contended = True
        print(f"normlab: warning: training steps now take {factor:.0f}x as long as this run's fastest ones: "
              "other processes "
              f"are probably loading the CPU, and torch's {threads} threads wait on each other. Fewer "
              "threads run faster then (OMP_NUM_THREADS=1, or the number of idle cores)", file=sys.stderr,
              flush=True)
    return True
