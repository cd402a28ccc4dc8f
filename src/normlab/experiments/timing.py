"""Timing for the lab's speed claims: training steps in balanced random orders, over fresh
processes, and single norm calls as a model makes them. Cached per machine and thread count
(``TIMING_JOBS``), since a time means nothing on another machine."""

from __future__ import annotations

import os
import statistics
import time

import torch

from normlab import functional as F
from normlab.model import Decoder

TIMING_JOBS = ("step_time", "gru_step_time", "kernels", "norm_calls")  # cached per machine and thread count


def bench_machine() -> str:
    from normlab.env import cpu_name

    return f"{cpu_name()} x{os.cpu_count()}"


def _build(spec) -> torch.nn.Module:
    """A model from its spec: a ModelConfig (the decoder) or {"gru": {...}} (rnn.GRULM's arguments)."""
    if isinstance(spec, dict) and "gru" in spec:
        from normlab.rnn import GRULM

        return GRULM(**spec["gru"])
    return Decoder(spec)


def balanced_orders(labels: list, rounds: int, seed: int) -> list[list]:
    """The order of ``labels`` in each timing round: a random Latin square (every label in every
    position equally often: rotations of one random permutation, the rotations shuffled), with
    ``rounds`` rounded up to a multiple of the number of labels, so that no label always runs
    first, or after the same neighbour, on a machine that drifts or warms."""
    import random

    gen = random.Random(seed)
    base = list(labels)
    gen.shuffle(base)
    k = len(base)
    shifts = [r % k for r in range(-(-rounds // k) * k)]
    gen.shuffle(shifts)
    return [base[s:] + base[:s] for s in shifts]


def time_steps(configs: dict, batch: tuple, rounds: int, steps_per_round: int = 2,
               order_seed: int = 0) -> dict:
    """Median training-step time (forward, backward, AdamW) of each model spec (see _build) in this
    process, measured in rounds of every model in a balanced random order (:func:`balanced_orders`)
    so that a drifting machine does not favour one. Returns {label: {"ms": median over rounds,
    "rounds": [...]}}."""
    x, y = batch
    setups = {}
    for label, cfg in configs.items():
        torch.manual_seed(0)
        model = _build(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        setups[label] = (model, opt)

    def step(model, opt):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for model, opt in setups.values():  # warm-up: compilation, first calls, optimizer state
        for _ in range(2):
            step(model, opt)
    times = {label: [] for label in setups}
    for order in balanced_orders(list(setups), rounds, order_seed):
        for label in order:
            model, opt = setups[label]
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                step(model, opt)
            times[label].append((time.perf_counter() - t0) / steps_per_round * 1e3)
    return {label: {"ms": statistics.median(ts), "rounds": ts} for label, ts in times.items()}


def time_steps_in_processes(configs: dict, batch: tuple, rounds: int, processes: int) -> dict:
    """:func:`time_steps` in ``processes`` fresh processes, one after another: the spread between
    processes (where the allocator, the page layout and the machine's state differ) is the noise
    a step-time claim has to beat, which the rounds of one process understate. Returns {label:
    {"ms": median of the per-process medians, "samples": one median per process (paired across
    labels by process), "rounds": every round}}."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    per_process = []
    for i in range(processes):  # each process its own balanced order
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            per_process.append(pool.submit(time_steps, configs, batch, rounds, 2, i).result())
    return {label: {"ms": statistics.median(p[label]["ms"] for p in per_process),
                    "samples": [p[label]["ms"] for p in per_process],
                    "rounds": [t for p in per_process for t in p[label]["rounds"]]} for label in configs}


def time_norm_calls(d: int, rows: int, rounds: int = 20) -> dict:
    """Forward + backward time (ms) of one layer_norm and one rms_norm call on a (rows, d) float32
    tensor, as a model makes them (default backend, weights, through autograd): what the norms
    cost inside a training step."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=gen, requires_grad=True)
    w, b = torch.ones(d, requires_grad=True), torch.zeros(d, requires_grad=True)
    dy = torch.randn(rows, d, generator=gen)
    calls = {"layernorm": lambda: F.layer_norm(x, w, b), "rmsnorm": lambda: F.rms_norm(x, w)}
    out = {}
    for name, call in calls.items():
        for _ in range(3):  # compile and warm
            call().backward(dy)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            call().backward(dy)
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(times)
    return out


def step_seconds(cfg, batch_size: int, seq_len: int, bf16: bool = False, steps: int = 3) -> dict:
    """Seconds of one training micro-step (forward, backward, AdamW) and of one evaluation forward
    of a decoder built from ``cfg``, on random tokens in this process at torch's thread count: the
    median of ``steps`` after an untimed one, or of fewer where they pass 2 s (a plan is a budget)."""
    torch.manual_seed(0)
    model = Decoder(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

    def train_step() -> None:
        with autocast:
            _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def eval_step() -> None:
        with torch.no_grad(), autocast:
            model(x, x)

    out = {}
    for name, call in (("train", train_step), ("eval", eval_step)):
        call()  # compiles and first calls: once per process, not per step
        times = []
        while len(times) < steps and sum(times) < 2.0:
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def run_seconds_here(argvs: list[list[str]], progress=None) -> list[float | None]:
    """The estimated wall time of each `normlab train` command line in ``argvs`` on this machine,
    trained one at a time at torch's thread count: its steps (times its micro-batches) at the
    measured step time plus its evaluations (the first, every ``eval_every`` and the last, of
    ``eval_batches`` forwards each). Each distinct model and batch shape is timed once
    (:func:`step_seconds`); a resumed run (``--resume``) and one whose model does not fit this
    machine's memory are None. ``progress(done, total)`` is called as shapes are timed. What runs
    after training (a preset's measurements) is not counted."""
    import dataclasses

    from normlab import data as D
    from normlab.footprint import TooLarge, check_fits
    from normlab.model_config import ModelConfig
    from normlab.train_config import resolve

    parsed, vocabs = [], {}
    for argv in argvs:
        if "--resume" in argv:
            parsed.append(None)
            continue
        tcfg, model_fields = resolve(None, dict(a.split("=", 1) for a in argv if "=" in a))
        corpus = (tcfg.data, tcfg.tokenizer, tcfg.bpe_vocab, tcfg.val_fraction)
        if corpus not in vocabs:
            vocabs[corpus] = D.prepare(*corpus).tokenizer.vocab_size
        cfg = ModelConfig.preset(tcfg.preset, **{**model_fields, "vocab_size": vocabs[corpus]})
        parsed.append((tcfg, cfg, (tuple(sorted(dataclasses.asdict(cfg).items())), tcfg.batch_size,
                                   tcfg.seq_len or cfg.max_seq_len, tcfg.dtype == "bf16")))
    shapes = list(dict.fromkeys(p[2] for p in parsed if p))
    timed = {}
    for i, key in enumerate(shapes):
        cfg = next(p[1] for p in parsed if p and p[2] == key)
        try:
            check_fits(cfg, key[1], key[2], torch.device("cpu"))
            timed[key] = step_seconds(cfg, key[1], key[2], bf16=key[3])
        except TooLarge:  # a plan for a bigger machine: its other runs are still priced
            timed[key] = None
        if progress:
            progress(i + 1, len(shapes))
    out = []
    for p in parsed:
        if p is None or timed[p[2]] is None:
            out.append(None)
            continue
        tcfg, _, key = p
        evals = 2 + (tcfg.steps - 1) // tcfg.eval_every if tcfg.eval_every else 2
        out.append(tcfg.steps * tcfg.grad_accum * timed[key]["train"]
                   + evals * tcfg.eval_batches * timed[key]["eval"])
    return out
