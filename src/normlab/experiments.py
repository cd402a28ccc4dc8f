"""``normlab compare``: presets that test published claims about norms on this machine.

Each preset trains or measures what its claims need and returns a section of results.json: the
settings, a table, the series its plots draw, and the claims with verdicts computed from the
numbers by their rules (normlab.claims). Presets:

    norms      RMSNorm matches LayerNorm and is faster; pRMSNorm matches; no norm trains worse
    warmup     learning-rate sweeps: Post-LN needs warmup, Pre-LN does not; qk-norm bounds the logits
    gradients  at init Post-LN's gradient grows toward the output, Pre-LN's is flat; depth scaling
               (Xiong et al.'s model and this decoder side by side)
    depth      DeepNorm keeps a deep Post-LN model trainable where Pre-LN trains
    batchnorm  BatchNorm's output depends on batch-mates and padding; small padded batches hurt it
    precision  fp32 statistics are needed in fp16/bf16
    speed      kernel GB/s per backend, a normalized GRU's step, and training-step time with
               normlab's and torch's norms

Every claim carries the conditions of its source's experiment that this run matches and those it
does not; verdicts come from 95% t intervals over seeds (normlab.claims).

``demo`` runs norms, gradients, batchnorm (without its batch-size trend) and precision at quick
size; ``all`` runs every preset.
Sizes: ``full`` (the default: minutes to hours on a CPU, meant for a GPU or a patient machine),
``quick`` (2 CPU cores: every preset together in about 15 minutes) and ``tiny`` (seconds: the tests).

Everything lives in the output directory: ``runs/<label>-<hash>/`` holds one training run (the
hash covers its whole config, so a run is reused by any preset, or any later command, that asks
for the same config), ``jobs/<preset>/`` the measurements that are not training runs, and
results.json the sections finished so far. Rerunning the same command skips what is finished and
resumes an interrupted training run from its checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as TF

from normlab import claims as C
from normlab import data as D
from normlab import reference
from normlab import functional as F
from normlab.model import Decoder, ModelConfig
from normlab.train import TrainConfig, load_run, split_overrides, train

ZHANG19 = "Zhang & Sennrich (2019), Root Mean Square Layer Normalization, NeurIPS"
XIONG20 = "Xiong et al. (2020), On Layer Normalization in the Transformer Architecture, ICML"
WANG22 = "Wang et al. (2022), DeepNet: Scaling Transformers to 1,000 Layers"
SHEN20 = "Shen et al. (2020), PowerNorm: Rethinking Batch Normalization in Transformers, ICML"
MICIK18 = "Micikevicius et al. (2018), Mixed Precision Training, ICLR"
WORTSMAN23 = ("Wortsman et al. (2023), Small-scale proxies for large-scale Transformer training instabilities; "
              "Dehghani et al. (2023), Scaling Vision Transformers to 22 Billion Parameters")
NORMLAB = "normlab's aim (DESIGN.md): fused kernels faster than the framework's own norms"

NORMS = ("layernorm", "rmsnorm", "prmsnorm", "batchnorm", "none")
SIZES = ("full", "quick", "tiny")
PLACEMENTS = ("post", "pre", "sandwich", "deepnorm")


class Interrupted(Exception):
    """A training run was stopped by Ctrl-C/SIGTERM; its checkpoint is saved."""


@dataclass
class Settings:
    out: str = "runs/compare"
    size: str = "full"  # full, quick or tiny
    seeds: int | None = None  # None: the preset's default number of seeds
    data: str | None = None  # None: the default corpus
    steps: int | None = None  # None: the preset's default
    overrides: dict = field(default_factory=dict)  # key=value training and model fields for every run
    quiet: bool = False  # no per-run progress bars
    brief: bool = False  # the demo: leave out a preset's slowest measurement (its notes say which and how to run it)
    lrs: tuple[float, ...] | None = None  # the warmup preset's learning-rate sweep; None: the size's default


class Lab:
    """Runs and caches the training runs and measurements of presets in one output directory."""

    def __init__(self, settings: Settings, console=None) -> None:
        self.s = settings
        self.out = Path(settings.out)
        self.console = console
        self.train_over, self.model_over = split_overrides(settings.overrides)
        if settings.steps is not None:
            self.train_over["steps"] = settings.steps
        if settings.data is not None:
            self.train_over["data"] = settings.data
        if settings.seeds is not None and settings.seeds < 1:
            raise ValueError(f"--seeds must be at least 1, got {settings.seeds}")
        if settings.size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}; got {settings.size!r}")
        self.size = settings.size
        self.quick = settings.size != "full"
        self.preset = ""
        self.cost = 0.0  # seconds the current preset's runs and measurements took to compute (cached ones included)
        self.stale: list[str] = []  # cached entries of the current preset that no longer matched their data or code
        self._dataset = None

    # -- sizes and seeds
    def pick(self, quick, full, tiny=None):
        """The value for this size (tiny falls back to quick)."""
        if self.size == "tiny" and tiny is not None:
            return tiny
        return quick if self.quick else full

    def seeds(self, quick: int, full: int) -> list[int]:
        return list(range(self.s.seeds or self.pick(quick, full, tiny=1)))

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)

    def _keys(self, config) -> tuple[str, str]:
        """(the cache key, the key of the config alone): the cache key also covers the token data
        and the sources that decide a result, so a changed corpus or model reruns the work."""
        config_key = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:10]
        key = hashlib.sha256(f"{config_key}|{self.data_hash}|{sources_hash()}".encode()).hexdigest()[:10]
        return key, config_key

    def _note_stale(self, folder: Path, pattern: str, config_key: str, what: str) -> None:
        """Say so when a cached entry of the same config no longer matches its data or code."""
        for old in folder.glob(pattern) if folder.exists() else ():
            meta = old / "cache.json" if old.is_dir() else old
            try:
                if json.loads(meta.read_text()).get("config_key") == config_key:
                    self.stale.append(what)
                    self.say(f"  [yellow]{what}: the cached result in {old.name} no longer matches its data or code; "
                             "computing it again[/yellow]")
                    return
            except (OSError, ValueError):
                continue

    @functools.cached_property
    def data_hash(self) -> str:
        """sha256 of the token data the runs trained on (train and validation splits)."""
        h = hashlib.sha256(np.ascontiguousarray(self.dataset.train).tobytes())
        h.update(np.ascontiguousarray(self.dataset.val).tobytes())
        return h.hexdigest()[:16]

    @property
    def dataset(self) -> D.Dataset:
        if self._dataset is None:
            t = TrainConfig(**{k: v for k, v in self.train_over.items() if k in ("data", "tokenizer", "bpe_vocab", "val_fraction")})
            self._dataset = D.prepare(t.data, t.tokenizer, t.bpe_vocab, t.val_fraction)
        return self._dataset

    def model_config(self, model: dict) -> ModelConfig:
        """A measurement's model: the preset's fields < the user's overrides (vocabulary from the data)."""
        fields = {**model, **self.model_over, "vocab_size": self.dataset.tokenizer.vocab_size}
        return ModelConfig.preset(fields.pop("preset", "small"), **fields)

    # -- training runs
    def run(self, label: str, train_fields: dict, model_fields: dict, varied: dict) -> dict:
        """Train (or reuse, or resume) one run: the preset's base fields < the user's overrides <
        the ``varied`` fields the preset compares. Returns the run's summary and curves."""
        t_varied = {k: v for k, v in varied.items() if k in _TRAIN_FIELDS}
        m_varied = {k: v for k, v in varied.items() if k not in _TRAIN_FIELDS}
        tf = {**train_fields, **self.train_over, **t_varied}
        mf = {**model_fields, **self.model_over, **m_varied}
        # stop_at only pauses a run: the same run resumed without it is the same run
        config = [{k: v for k, v in tf.items() if k != "stop_at"}, mf]
        key, config_key = self._keys(config)
        folder = self.out / "runs" / f"{label}-{key}"
        summary_path = folder / "summary.json"
        if not folder.exists():
            self._note_stale(self.out / "runs", f"{label}-*", config_key, f"run {label}")
        resume = False
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
            if summary.get("status") in ("completed", "diverged"):
                self.cost += summary.get("wall_s") or 0.0
                return _run_result(folder, summary)
            resume = (folder / "checkpoint.pt").exists()
        elif (folder / "checkpoint.pt").exists() and (folder / "config.json").exists():
            resume = True  # killed without a summary: its last checkpoint stands
        if not resume and folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cache.json").write_text(json.dumps({"config_key": config_key, "key": key}))
        self.say(f"  [bold]{self.preset}[/bold] {label}" + (" (resuming)" if resume else ""))
        tcfg = TrainConfig(**{**tf, "out": str(folder), "quiet": self.s.quiet, "overwrite": not resume})
        tcfg.validate()
        summary = train(tcfg, mf, resume=resume, console=self.console)
        if summary["status"] in ("interrupted", "stopped"):
            raise Interrupted(f"{label} stopped at step {summary['step']}; its checkpoint is in {folder}")
        self.cost += summary.get("wall_s") or 0.0
        return _run_result(folder, summary)

    # -- measurements that are not training runs
    def job(self, name: str, params: dict, fn: Callable[[], dict]) -> dict:
        """``fn()``'s result, cached as JSON under jobs/<preset>/ by ``name`` and ``params`` (and,
        for timings, the machine and thread count)."""
        if name in TIMING_JOBS:
            params = {**params, "machine": [bench_machine(), torch.get_num_threads()]}
        key, config_key = self._keys(params)
        path = self.out / "jobs" / self.preset / f"{name}-{key}.json"
        if not path.exists():
            self._note_stale(path.parent, f"{name}-*.json", config_key, f"{self.preset} {name}")
        if path.exists():
            saved = json.loads(path.read_text())
            if "result" not in saved:  # written before results carried their cost
                return saved
            self.cost += saved["seconds"]
            return saved["result"]
        self.say(f"  [bold]{self.preset}[/bold] {name}")
        t0 = time.perf_counter()
        result = _clean(fn())
        seconds = time.perf_counter() - t0
        self.cost += seconds
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"seconds": round(seconds, 2), "result": result, "config_key": config_key}))
        os.replace(tmp, path)
        return result


_TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}
# The sources whose change changes a result; the lab's own files (presets, claims, report) do not.
RESULT_SOURCES = ("model.py", "train.py", "data.py", "nn.py", "functional.py", "reference.py", "rnn.py", "kernels")


@functools.lru_cache(maxsize=1)
def sources_hash() -> str:
    """sha256 of the normlab sources that decide a training run's or a measurement's result."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for name in RESULT_SOURCES:
        for f in sorted((root / name).rglob("*.py")) if (root / name).is_dir() else [root / name]:
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


TIMING_JOBS = ("step_time", "gru_step_time", "kernels", "norm_calls")  # cached per machine and thread count


def bench_machine() -> str:
    from normlab.env import cpu_name

    return f"{cpu_name()} x{os.cpu_count()}"


def _run_result(folder: Path, summary: dict) -> dict:
    """A run's summary plus its curves from metrics.jsonl (validation loss against step and
    against training time, and the training loss, thinned to at most 200 points)."""
    val_steps, val_loss, val_time, steps, losses, step_ms = [], [], [], [], [], []
    elapsed = 0.0
    with open(folder / "metrics.jsonl") as f:
        for line in f:
            r = json.loads(line)
            if "val_loss" in r:
                val_steps.append(r["step"])
                val_loss.append(r["val_loss"])
                val_time.append(round(elapsed, 3))
            elif "step_ms" in r:
                elapsed += r["step_ms"] / 1e3
                steps.append(r["step"])
                losses.append(r["loss"])
                step_ms.append(r["step_ms"])
    stride = max(1, len(steps) // 200)
    diverged = summary["status"] == "diverged"
    return {
        "run": folder.name, "status": summary["status"], "steps": summary["step"],
        "val_loss": None if diverged else summary.get("val_loss"), "init_val_loss": summary.get("init_val_loss"),
        "train_loss": summary.get("loss"), "wall_s": summary.get("wall_s"),
        "step_ms": statistics.median(step_ms[len(step_ms) // 5:]) if step_ms else None,  # past the first fifth
        "tokens_per_s": summary.get("tokens_per_s"),
        "val_curve": {"step": val_steps, "loss": val_loss, "time_s": val_time},
        "train_curve": {"step": steps[::stride], "loss": losses[::stride]},
    }


def stats(values) -> dict:
    """mean, std (None with fewer than two values), min and max of the finite values."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else None,
            "min": min(v), "max": max(v), "n": len(v)}


def _build(spec) -> torch.nn.Module:
    """A model from its spec: a ModelConfig (the decoder) or {"gru": {...}} (rnn.GRULM's arguments)."""
    if isinstance(spec, dict) and "gru" in spec:
        from normlab.rnn import GRULM

        return GRULM(**spec["gru"])
    return Decoder(spec)


def time_steps(configs: dict, batch: tuple, rounds: int, steps_per_round: int = 2) -> dict:
    """Median training-step time (forward, backward, AdamW) of each model spec (see _build) in this
    process, measured round-robin (each round runs every model in a rotated order) so that a
    drifting machine does not favour one. Returns {label: {"ms": median over rounds, "rounds": [...]}}."""
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
    labels = list(setups)
    for r in range(rounds):
        order = labels[r % len(labels):] + labels[: r % len(labels)]
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
    for _ in range(processes):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            per_process.append(pool.submit(time_steps, configs, batch, rounds).result())
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


def _round(x, digits=4):
    return None if x is None else float(f"{x:.{digits}g}")


# ======================================================================================= norms


def lm_sizes(lab: Lab) -> tuple[dict, dict]:
    """Training and model fields of the language-model comparisons (norms, batchnorm)."""
    train_fields = dict(preset="small", tokenizer="char", ckpt_every=0, diverge_factor=3.0, weight_decay=0.1)
    if lab.size == "tiny":
        train_fields.update(steps=6, batch_size=4, seq_len=16, lr=2e-3, min_lr=2e-4, warmup=2, eval_every=3, eval_batches=2)
        model = dict(d_model=16, n_layers=2, n_heads=2, max_seq_len=16)
    elif lab.quick:
        train_fields.update(steps=200, batch_size=16, seq_len=64, lr=2e-3, min_lr=2e-4, warmup=20, eval_every=25, eval_batches=8)
        model = dict(d_model=96, n_layers=4, n_heads=4, max_seq_len=64)
    else:
        train_fields.update(steps=1000, batch_size=16, seq_len=256, lr=1e-3, min_lr=1e-4, warmup=100, eval_every=50, eval_batches=20)
        model = dict(d_model=256, n_layers=4, n_heads=4, max_seq_len=256)
    return train_fields, model


def train_norms(lab: Lab, norms, seeds) -> dict[str, list[dict]]:
    train_fields, model = lm_sizes(lab)
    return {norm: [lab.run(f"{norm}-s{seed}", train_fields, {**model, "placement": "pre"}, {"norm": norm, "seed": seed})
                   for seed in seeds] for norm in norms}


# Quality comparisons pair runs by seed: a seed fixes the data order and the initial weights of
# every layer but the norm, so the pairs share most of their noise (the paired t interval is
# Student's t on the per-seed differences, n - 1 degrees of freedom).

NORMS_CONDITIONS = [
    "matches: LayerNorm, RMSNorm and pRMSNorm (p = 6.25%) swapped into the same model and training, nothing else changed",
    "differs: a 4-layer Pre-LN decoder on Shakespeare characters, a few hundred steps (the paper: machine translation, "
    "reading comprehension, image-caption retrieval and classification models)",
]

# Thresholds used by more than one claim, with where they come from.
COMPARABLE = C.ours("the paper reports 'comparable performance' without a number; 2% of the loss is the lab's bound, "
                    "below the 3% BatchNorm costs at quick size")
WORSE = C.ours("2% of the loss: as large as the comparable-quality bound, so 'worse' and 'comparable' cannot both hold")
ZHANG_SPEED = C.source("'reduces the running time by 7%~64% on different models' (abstract)")
DIVERGED = C.ours("a count: one diverged seed is a failure to train")


# Seeds of the quality comparisons at quick size: the fewest for which both equivalence claims
# (RMSNorm vs LayerNorm, pRMSNorm vs RMSNorm) were decidable in a measured demo (3 and 4 left
# pRMSNorm's interval across the 2% margin; docs/results/compare-demo-xeon-2core/README.md).
LM_SEEDS = 5


def preset_norms(lab: Lab) -> dict:
    seeds = lab.seeds(LM_SEEDS, LM_SEEDS)
    runs = train_norms(lab, NORMS, seeds)
    train_fields, model = lm_sizes(lab)
    tf = {**train_fields, **lab.train_over}
    batch = D.Batches(lab.dataset.train, tf["batch_size"], tf["seq_len"], seed=99).next()
    processes = lab.pick(4, 5, tiny=2)
    timing = lab.job("step_time", {"model": model, "over": lab.model_over, "batch": [tf["batch_size"], tf["seq_len"]],
                                   "processes": processes},
                     lambda: time_steps_in_processes({n: lab.model_config({**model, "norm": n}) for n in NORMS}, batch,
                                                     rounds=lab.pick(4, 6, tiny=2), processes=processes))
    calls = lab.job("norm_calls", {"d": model["d_model"], "rows": tf["batch_size"] * tf["seq_len"]},
                    lambda: time_norm_calls(model["d_model"], tf["batch_size"] * tf["seq_len"]))
    n_calls = 2 * lab.model_over.get("n_layers", model["n_layers"]) + 1  # pre: two a block, one final
    ln_ms = timing["layernorm"]["ms"]
    share = n_calls * calls["layernorm"] / ln_ms
    kernel_gain = 1 - calls["rmsnorm"] / calls["layernorm"]
    budget = {"norm_calls_per_step": n_calls, "layernorm_call_ms": _round(calls["layernorm"]),
              "rmsnorm_call_ms": _round(calls["rmsnorm"]), "norm_share_of_step": _round(share, 3),
              "kernel_gain": _round(kernel_gain, 3), "expected_step_gain": _round(share * kernel_gain, 3)}
    rows, measured = [], {}
    for norm in NORMS:
        rs = runs[norm]
        val = stats([r["val_loss"] for r in rs])
        diverged = sum(r["status"] == "diverged" for r in rs)
        rows.append({
            "norm": norm, "val_loss": _round(val["mean"]), "val_std": _round(val["std"], 2),
            "val_min": _round(val["min"]), "val_max": _round(val["max"]), "seeds": len(rs), "diverged": diverged,
            "run_step_ms": _round(statistics.median([r["step_ms"] for r in rs if r["step_ms"]]), 3),
            "tokens_per_s": _round(statistics.median([r["tokens_per_s"] for r in rs if r["tokens_per_s"]]), 4),
            "step_ms": _round(timing[norm]["ms"], 4), "step_vs_layernorm": _round(timing[norm]["ms"] / ln_ms, 3),
        })
        measured[f"{norm}_val"] = [r["val_loss"] for r in rs]
        measured[f"{norm}_diverged"] = diverged
        measured[f"{norm}_step_ms"] = timing[norm]["samples"]
    claims = [
        C.claim("norms.rms_quality", "RMSNorm reaches the same quality as LayerNorm", ZHANG19,
                _pick(measured, "rmsnorm_val", "layernorm_val"),
                C.within("rmsnorm_val", "layernorm_val", 0.02, origin=COMPARABLE, paired=True), NORMS_CONDITIONS),
        C.claim("norms.rms_speed", "RMSNorm makes a training step at least 7% faster than LayerNorm does (the paper: 7% to "
                "64% less running time)", ZHANG19, _pick(measured, "rmsnorm_step_ms", "layernorm_step_ms"),
                C.below("rmsnorm_step_ms", "layernorm_step_ms", 0.07, origin=ZHANG_SPEED, paired=True, over="processes"),
                ["differs: a Transformer, where the norms are a small share of a step (the paper's large gains: RNNs with "
                 "normalized gates; the speed preset times one)",
                 f"expected here: the norms take {share:.1%} of a LayerNorm step ({n_calls} calls of "
                 f"{calls['layernorm']:.3g} ms, forward + backward) and RMSNorm's call is {kernel_gain:.1%} faster, so "
                 f"the step can be at most about {share * kernel_gain:.1%} faster: {'below' if share * kernel_gain < 0.07 else 'above'} "
                 "the paper's 7%"]),
        C.claim("norms.prms_quality", "partial RMSNorm (p = 6.25%, the paper's setting) reaches the same quality as RMSNorm",
                ZHANG19, _pick(measured, "prmsnorm_val", "rmsnorm_val"),
                C.within("prmsnorm_val", "rmsnorm_val", 0.02, origin=COMPARABLE, paired=True), NORMS_CONDITIONS),
        C.claim("norms.none_worse", "a model without normalization trains worse", ZHANG19,
                _pick(measured, "none_val", "layernorm_val", "none_diverged"),
                C.any_of(C.at_least("none_diverged", 1, point="a count of diverged seeds", origin=DIVERGED),
                         C.above("none_val", "layernorm_val", 0.02, origin=WORSE, paired=True)),
                NORMS_CONDITIONS[1:] + ["differs: the paper argues for normalization's benefit; a model without any norm is "
                                        "the lab's baseline, not one of the paper's runs"]),
    ]
    return {
        "title": "RMSNorm vs LayerNorm vs pRMSNorm vs BatchNorm vs no norm",
        "question": "Does RMSNorm match LayerNorm's quality while running faster, and does a model need a norm at all?",
        "settings": {"train": {**train_fields, **lab.train_over}, "model": {**model, **lab.model_over, "placement": "pre"},
                     "seeds": seeds, "timing_processes": processes, "step_budget": budget},
        "columns": ["norm", "val_loss", "val_std", "val_min", "val_max", "seeds", "diverged", "run_step_ms", "tokens_per_s",
                    "step_ms", "step_vs_layernorm"],
        "rows": rows, "claims": claims,
        "series": {"runs": {norm: [{"seed": s, **_curves(r)} for s, r in zip(seeds, rs)] for norm, rs in runs.items()},
                   "step_ms": {norm: timing[norm]["samples"] for norm in NORMS}},
        "notes": ["val_loss: validation loss at the end of training (mean over seeds; std, min, max over seeds). "
                  f"step_ms: training-step time measured round-robin across the norms in each of {processes} fresh "
                  "processes (median of the per-process medians; the step-time claim pairs the norms by process). "
                  "run_step_ms: the median within each training run, more exposed to machine noise. Every clock "
                  "starts after the kernels are compiled and called once."],
    }


def _pick(measured: dict, *keys) -> dict:
    """The measured values a claim uses."""
    return {k: measured.get(k) for k in keys}


def _curves(run: dict) -> dict:
    return {"status": run["status"], "val_curve": run["val_curve"], "train_curve": run["train_curve"]}


# ====================================================================================== warmup


def deep_sizes(lab: Lab, depth_quick: int, depth_full: int) -> tuple[dict, dict]:
    train_fields = dict(preset="small", tokenizer="char", ckpt_every=0, schedule="cosine", diverge_factor=3.0)
    if lab.size == "tiny":
        train_fields.update(steps=6, batch_size=4, seq_len=16, eval_every=3, eval_batches=2)
        model = dict(d_model=16, n_layers=3, n_heads=2, max_seq_len=16, init="xavier")
    elif lab.quick:
        train_fields.update(steps=200, batch_size=8, seq_len=64, eval_every=50, eval_batches=4)
        model = dict(d_model=64, n_layers=depth_quick, n_heads=4, max_seq_len=64, init="xavier")
    else:
        train_fields.update(steps=1000, batch_size=16, seq_len=128, eval_every=100, eval_batches=10)
        model = dict(d_model=128, n_layers=depth_full, n_heads=4, max_seq_len=128, init="xavier")
    return train_fields, model


TRAINS = C.ours("10% below the character-frequency (unigram) loss: the model learned more than letter counts")


def trains(key: str) -> dict:
    """The precondition of a claim about training: the loss ends 10% below the unigram loss."""
    return C.at_most(key, "unigram_loss", -0.1, origin=TRAINS)


# The settings of the stability sweep: (placement, warmup on, qk-norm).
SWEEP = {"post|warm": ("post", True, False), "post|nowarm": ("post", False, False), "pre|warm": ("pre", True, False),
         "pre|nowarm": ("pre", False, False), "pre|warm|qknorm": ("pre", True, True)}
STABILITY_CONDITIONS = [
    "matches (Xiong et al.): Post-LN and Pre-LN Transformers with LayerNorm, a ReLU FFN, learned positions and xavier "
    "init; Adam beta2 = 0.98; no gradient clipping (clipping hides the instability measured); warmup against none",
    "matches (Wortsman et al.): a learning-rate sweep over more than 1.5 orders of magnitude; LR sensitivity = mean over "
    "the sweep of min(loss, loss at init) minus the best loss",
    "differs: a decoder-only character LM, 6 layers of width 64, a few hundred steps (Xiong et al.: translation and "
    "BERT for ~100k steps; Wortsman et al.: decoders of 10M to 1B+ parameters)",
    "differs: cosine decay after the warmup (Xiong et al.: inverse square root)",
]


def parse_lrs(text: str | None) -> tuple[float, ...] | None:
    """--lrs "1e-4,1e-3,1e-2": at least two distinct positive learning rates, sorted."""
    if text is None:
        return None
    try:
        lrs = tuple(sorted({float(v) for v in text.split(",") if v.strip()}))
    except ValueError as err:
        raise ValueError(f"--lrs must be comma-separated numbers, e.g. 1e-4,1e-3,1e-2; got {text!r}") from err
    if len(lrs) < 2 or lrs[0] <= 0 or not all(math.isfinite(v) for v in lrs):
        raise ValueError(f"--lrs needs at least two distinct positive learning rates; got {text!r}")
    return lrs


def stability_sizes(lab: Lab) -> tuple[dict, dict, tuple]:
    """Training and model fields of the learning-rate sweep, and the learning rates."""
    train_fields = dict(preset="small", tokenizer="char", ckpt_every=0, schedule="cosine", diverge_factor=3.0,
                        beta2=0.98, grad_clip=0.0)
    model = {**XIONG_MODEL, "n_heads": 4}
    if lab.size == "tiny":
        train_fields.update(steps=6, batch_size=4, seq_len=16, eval_every=3, eval_batches=2, warmup=2)
        return train_fields, {**model, "d_model": 16, "n_heads": 2, "n_layers": 2, "max_seq_len": 16}, (1e-3, 5e-2)
    if lab.quick:
        train_fields.update(steps=200, batch_size=8, seq_len=64, eval_every=50, eval_batches=4, warmup=50)
        return train_fields, {**model, "d_model": 64, "n_layers": 6, "max_seq_len": 64}, (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
    train_fields.update(steps=2000, batch_size=16, seq_len=128, eval_every=200, eval_batches=10, warmup=400)
    lrs = tuple(float(f"{10 ** (e / 3):.3g}") for e in range(-12, -2))  # 1e-4 to 4.6e-2, 3 points a decade
    return train_fields, {**model, "d_model": 256, "n_layers": 6, "max_seq_len": 128}, lrs


@torch.no_grad()
def max_attention_logit(run_folder: Path, val_tokens, batch_size: int, seq_len: int) -> float:
    """The largest attention logit over layers of a trained run, on one fixed validation batch."""
    model, _ = load_run(run_folder)
    x, _ = D.Batches(val_tokens, batch_size, seq_len, seed=777).next()
    model.record_attention_logits()
    model(x)
    return max(model.attention_logits())


def lr_sensitivity(losses: list, init: float | None) -> float | None:
    """Wortsman et al. (2023): the mean over the sweep of min(loss, loss at init) minus the best
    loss; a diverged run (None) counts as the loss at init. None without a loss at init."""
    if init is None:
        return None
    capped = [init if v is None or not math.isfinite(v) else min(v, init) for v in losses]
    return statistics.fmean(capped) - min(capped)


def preset_warmup(lab: Lab) -> dict:
    train_fields, model, lrs = stability_sizes(lab)
    lrs = lab.s.lrs or lrs
    warm = train_fields.pop("warmup")
    seeds = lab.seeds(3, 3)
    tf = {**train_fields, **lab.train_over}
    runs = {}  # (setting, lr) -> one result per seed
    for key, (placement, warmup, qk) in SWEEP.items():
        for lr in lrs:
            runs[key, lr] = [lab.run(f"{key.replace('|', '-')}-lr{lr:g}-s{seed}", train_fields, model,
                                     {"placement": placement, "lr": lr, "min_lr": lr / 10, "warmup": warm if warmup else 0,
                                      "qk_norm": qk, "seed": seed}) for seed in seeds]
    logits = {}  # the largest attention logit of every pre|warm run, with and without qk-norm
    for key in ("pre|warm", "pre|warm|qknorm"):
        for lr in lrs:
            logits[key, lr] = [lab.job(f"logit-{r['run']}", {"run": r["run"], "B": tf["batch_size"], "T": tf["seq_len"]},
                                       lambda r=r: max_attention_logit(lab.out / "runs" / r["run"], lab.dataset.val,
                                                                       tf["batch_size"], tf["seq_len"]))
                               for r in runs[key, lr]]
    rows, measured, curves = [], {}, {}
    for key in SWEEP:
        sens, best = [], []
        for i in range(len(seeds)):
            losses = [runs[key, lr][i]["val_loss"] for lr in lrs]
            init = runs[key, lrs[0]][i]["init_val_loss"]
            sens.append(lr_sensitivity(losses, init))
            done = [j for j in range(len(lrs)) if losses[j] is not None]
            best.append(math.log10(lrs[min(done, key=lambda j: losses[j])]) if done else None)  # None: all diverged
        measured[f"{key.replace('|', '_')}_sensitivity"] = sens
        measured[f"{key.replace('|', '_')}_best_log10_lr"] = best
        curves[key] = {"lr": list(lrs), "loss": [[r["val_loss"] for r in runs[key, lr]] for lr in lrs],
                       "init": stats([r["init_val_loss"] for r in runs[key, lrs[0]]])["mean"]}
        mean_best = stats(best)["mean"]  # one value per setting, shown on each of its rows
        per_setting = {"sensitivity": _round(stats(sens)["mean"], 3),
                       "best_lr": _round(10**mean_best, 3) if mean_best is not None else None}
        for lr in lrs:
            val = stats([r["val_loss"] for r in runs[key, lr]])
            rows.append({"setting": key, "lr": lr, "diverged": sum(r["status"] == "diverged" for r in runs[key, lr]),
                         "val_loss": _round(val["mean"]), "val_std": _round(val["std"], 2),
                         "max_logit": _round(statistics.fmean(logits[key, lr]), 4) if (key, lr) in logits else None,
                         **per_setting})
    measured["post_minus_pre_best_log10_lr"] = [None if a is None or b is None else a - b for a, b in
                                                zip(measured["post_warm_best_log10_lr"], measured["pre_warm_best_log10_lr"])]
    top = lrs[-1]
    measured["pre_warm_max_logit_top_lr"] = logits["pre|warm", top]
    measured["pre_warm_qknorm_max_logit_top_lr"] = logits["pre|warm|qknorm", top]
    no_more = C.ours("10%: 'no more sensitive' allows a tenth of warmup's own sensitivity, no more")
    claims = [
        C.claim("warmup.post_sensitive", "without warmup, Post-LN is more sensitive to the learning rate than with it",
                XIONG20, _pick(measured, "post_nowarm_sensitivity", "post_warm_sensitivity"),
                C.above("post_nowarm_sensitivity", "post_warm_sensitivity", paired=True), STABILITY_CONDITIONS),
        C.claim("warmup.pre_not", "Pre-LN without warmup is no more sensitive to the learning rate than with it",
                XIONG20, _pick(measured, "pre_nowarm_sensitivity", "pre_warm_sensitivity"),
                C.at_most("pre_nowarm_sensitivity", "pre_warm_sensitivity", 0.1, origin=no_more, paired=True),
                STABILITY_CONDITIONS),
        C.claim("warmup.post_lower_lr", "Post-LN's best learning rate is lower than Pre-LN's (both with warmup)", XIONG20,
                _pick(measured, "post_minus_pre_best_log10_lr"),
                C.below("post_minus_pre_best_log10_lr", 0, origin=C.ours("0: any lower learning rate on the grid")),
                STABILITY_CONDITIONS + ["measured: log10 of the best learning rate on the grid, Post-LN minus Pre-LN, per seed"]),
        C.claim("warmup.qk_norm_logits", f"qk-norm keeps the attention logits bounded: at the highest learning rate ({top:g}) "
                "the largest logit is at least 2x lower with it", WORTSMAN23,
                _pick(measured, "pre_warm_qknorm_max_logit_top_lr", "pre_warm_max_logit_top_lr"),
                C.below("pre_warm_qknorm_max_logit_top_lr", "pre_warm_max_logit_top_lr", 0.5, paired=True,
                        origin=C.ours("the papers show logits growing without a number to quote; 2x is the lab's margin")),
                STABILITY_CONDITIONS + ["differs: qk-norm is RMSNorm over head_dim (Wortsman et al.: LayerNorm)"]),
        C.claim("warmup.qk_norm_sensitivity", "qk-norm lowers the learning-rate sensitivity (Pre-LN with warmup)", WORTSMAN23,
                _pick(measured, "pre_warm_qknorm_sensitivity", "pre_warm_sensitivity"),
                C.below("pre_warm_qknorm_sensitivity", "pre_warm_sensitivity", paired=True),
                STABILITY_CONDITIONS + ["differs: qk-norm is RMSNorm over head_dim (Wortsman et al.: LayerNorm)"]),
    ]
    return {
        "title": f"Stability: learning-rate sweeps with and without warmup ({model['n_layers']} layers, Xiong et al.'s model)",
        "question": "Does Post-LN need warmup where Pre-LN does not, and does qk-norm keep high learning rates stable?",
        "settings": {"train": tf, "model": {**model, **lab.model_over}, "lrs": list(lrs), "warmup_steps": warm,
                     "seeds": seeds, "beta2": tf["beta2"], "grad_clip": tf["grad_clip"], "sweep": {k: list(v) for k, v in SWEEP.items()}},
        "columns": ["setting", "lr", "diverged", "val_loss", "val_std", "max_logit", "sensitivity", "best_lr"],
        "rows": rows, "claims": claims, "series": {"curves": curves, "logits": {f"{k}|{lr:g}": v for (k, lr), v in logits.items()}},
        "notes": [f"Each point: {len(seeds)} seeds; Adam beta2 = {tf['beta2']}, gradient clipping off ({tf['grad_clip']}). "
                  "'diverged': the loss left 3x its first value or became non-finite; it counts as the loss at init in "
                  "the sensitivity. sensitivity and best_lr: per setting, mean over seeds (best_lr: geometric mean). "
                  "max_logit: the largest q.k / sqrt(head_dim) over layers on a fixed validation batch, after training."],
    }


def unigram_loss(tokens) -> float:
    """Cross-entropy (nats) of the token frequencies: the loss of a model that learned nothing else."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# =================================================================================== gradients


def layer_grad_norms(cfg: ModelConfig, batches: list, seed: int) -> list[float]:
    """Per layer, the gradient norm of the MLP output weight at initialization, averaged over batches."""
    torch.manual_seed(seed)
    model = Decoder(cfg)
    total = np.zeros(cfg.n_layers)
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        total += np.array([g["mlp_out"] for g in model.grad_norms()])
    return (total / len(batches)).tolist()


def log_slope(norms: list[float]) -> float:
    """Least-squares slope of log(norm) against the layer index."""
    idx = np.arange(len(norms))
    return float(np.polyfit(idx, np.log(np.asarray(norms)), 1)[0])


# The model of Xiong et al. (2020): the original Transformer's pieces in this decoder.
XIONG_MODEL = dict(norm="layernorm", mlp="relu", positions="learned", tie_embeddings=False, embed_scale=True, init="xavier")
# This decoder (LLaMA-style), with the same xavier init so that only the architecture differs.
LLAMA_MODEL = dict(norm="rmsnorm", mlp="swiglu", positions="rope", tie_embeddings=True, embed_scale=False, init="xavier")
# Xiong's model with one factor taken from this decoder: which one changes the picture?
GRAD_SETTINGS = {"xiong": XIONG_MODEL, "llama": LLAMA_MODEL, "xiong+rmsnorm": {**XIONG_MODEL, "norm": "rmsnorm"},
                 "xiong+swiglu": {**XIONG_MODEL, "mlp": "swiglu"},
                 "xiong+rope+tied": {**XIONG_MODEL, "positions": "rope", "tie_embeddings": True, "embed_scale": False}}
XIONG_CONDITIONS = [
    "matches: LayerNorm, a ReLU FFN (d_ff = 4d), learned positions, untied token embeddings ~ N(0, 1/d) scaled by "
    "sqrt(d), xavier init, a final LayerNorm only in Pre-LN",
    "matches: the gradient norm of each layer's FFN W2 at initialization, averaged over fixed batches",
    "differs: a decoder-only character-level LM on Shakespeare (Fig. 3: a 6-6 encoder-decoder for translation)",
    "differs: no biases in the linear layers; width d = 64 at quick size (the paper: 512)",
]
LLAMA_CONDITIONS = [
    "differs (this decoder, LLaMA-style): RMSNorm, a SwiGLU FFN, rotary positions, tied unscaled embeddings",
    "matches: xavier init, a final norm only in Pre-LN, the gradient norm of each layer's FFN W2 at initialization",
]


def preset_gradients(lab: Lab) -> dict:
    depths = lab.pick((6, 12, 24), (6, 12, 24), tiny=(2, 3))
    fig3_depth = depths[0]  # Fig. 3 is drawn for 6 layers
    seeds = lab.seeds(5, 5)
    n_batches = lab.pick(4, 16, tiny=2)
    width = lab.pick(dict(d_model=64, n_heads=4, max_seq_len=64), dict(d_model=256, n_heads=4, max_seq_len=128),
                     tiny=dict(d_model=16, n_heads=2, max_seq_len=16))
    B, T = lab.pick((8, 64), (16, 128), tiny=(4, 16))
    gen = D.Batches(lab.dataset.train, B, T, seed=2020)
    batches = [gen.next() for _ in range(n_batches)]
    cells = [(name, p, depth) for name in GRAD_SETTINGS for p in ("post", "pre") for depth in depths]

    def measure():
        return {f"{name}|{p}|{depth}": [layer_grad_norms(lab.model_config({**width, **GRAD_SETTINGS[name], "n_layers": depth,
                                                                          "placement": p}), batches, seed) for seed in seeds]
                for name, p, depth in cells}

    per_seed = lab.job("grad_norms_settings", {"cells": cells, "seeds": seeds, "batches": [n_batches, B, T],
                                               "model": width, "over": lab.model_over}, measure)
    rows, measured = [], {}
    for name, p, depth in cells:
        runs = per_seed[f"{name}|{p}|{depth}"]
        g = np.mean(runs, axis=0)
        growths = [math.exp(log_slope(r) * (depth - 1)) for r in runs]
        rows.append({"setting": name, "placement": p, "layers": depth, "first": _round(g[0]), "last": _round(g[-1]),
                     "fitted_last_over_first": _round(statistics.fmean(growths), 3)})
        if depth == fig3_depth:
            measured[f"{name}_{p}_growth"] = growths
    for name in GRAD_SETTINGS:  # the last layer's W2 gradient against depth, one log-log slope per seed
        for p in ("post", "pre"):
            measured[f"{name}_{p}_last_slope"] = [
                float(np.polyfit(np.log(depths), np.log([per_seed[f"{name}|{p}|{d}"][i][-1] for d in depths]), 1)[0])
                for i in range(len(seeds))]
    for row in rows:
        row["last_vs_depth_slope"] = _round(statistics.fmean(measured[f"{row['setting']}_{row['placement']}_last_slope"]), 3)
    band = C.ours("Fig. 3 gives no ratio; 1.5x from first to last layer (and 0.5-1.5 for 'flat') is the lab's bound")
    slope_band = C.ours("+-0.25: halfway between the theorem's two rates, 0 (Post-LN) and -1/2 (Pre-LN)")
    claims = []
    for name, where, conditions in (("xiong", "Xiong et al.'s model", XIONG_CONDITIONS),
                                    ("llama", "this decoder (LLaMA-style)", LLAMA_CONDITIONS)):
        tag = "" if name == "xiong" else ".llama"
        claims += [
            C.claim(f"gradients.post_grows{tag}", f"at initialization, Post-LN's gradient norm grows toward the last layers "
                    f"({where}, {fig3_depth} layers: fitted last/first ratio of W2's gradient norm >= 1.5)", XIONG20 + ", Fig. 3",
                    _pick(measured, f"{name}_post_growth"), C.above(f"{name}_post_growth", 1.0, 0.5, origin=band), conditions),
            C.claim(f"gradients.pre_flat{tag}", f"at initialization, Pre-LN's gradient norm is flat across layers ({where}, "
                    f"{fig3_depth} layers: fitted last/first ratio within 0.5-1.5)", XIONG20 + ", Fig. 3",
                    _pick(measured, f"{name}_pre_growth"), C.within(f"{name}_pre_growth", 1.0, 0.5, origin=band), conditions),
            C.claim(f"gradients.post_last_constant{tag}", f"the last layer's W2 gradient of Post-LN stays about constant as "
                    f"depth grows ({where}, L = {', '.join(map(str, depths))}: log-log slope within 0 +- 0.25)",
                    XIONG20 + ", Theorem 1", _pick(measured, f"{name}_post_last_slope"),
                    C.within(f"{name}_post_last_slope", 0, 0.25, origin=slope_band, absolute=True), conditions),
            C.claim(f"gradients.pre_last_scaling{tag}", f"the last layer's W2 gradient of Pre-LN scales like L^-1/2 ({where}, "
                    f"L = {', '.join(map(str, depths))}: log-log slope within -0.5 +- 0.25)", XIONG20 + ", Theorem 1",
                    _pick(measured, f"{name}_pre_last_slope"),
                    C.within(f"{name}_pre_last_slope", -0.5, 0.25, origin=slope_band, absolute=True), conditions),
        ]
    return {
        "title": "Gradient norms by layer at initialization: Xiong et al.'s model and this decoder",
        "question": "Is Post-LN's gradient norm larger near the output at initialization and Pre-LN's flat (Xiong et al., "
                    "Fig. 3), and does the last layer's gradient scale with depth as their Theorem 1 says?",
        "settings": {"model": {**width, **lab.model_over}, "settings": GRAD_SETTINGS, "depths": list(depths), "seeds": seeds,
                     "batches": n_batches, "batch_size": B, "seq_len": T},
        "columns": ["setting", "placement", "layers", "first", "last", "fitted_last_over_first", "last_vs_depth_slope"],
        "rows": rows, "claims": claims,
        "series": {"norms": {k: np.mean(v, axis=0).tolist() for k, v in per_seed.items()}, "depths": list(depths),
                   "slopes": {k: v for k, v in measured.items() if k.endswith("_last_slope")}},
        "notes": [f"Gradient norm of each block's FFN output projection (W2) at initialization, averaged over {n_batches} "
                  f"fixed batches, then over {len(seeds)} seeds (every claim's interval is over the seeds). 'xiong': the "
                  "paper's model; 'llama': this decoder with the same xavier init; 'xiong+...': the paper's model with one "
                  "factor from this decoder. last_vs_depth_slope: least squares of ln(last layer's norm) against ln(L).",
                  _factor_note(measured, fig3_depth)],
    }


def _factor_note(measured: dict, depth: int) -> str:
    """Which single factor moves Xiong's picture toward this decoder's the most."""
    base = {p: statistics.fmean(measured[f"xiong_{p}_growth"]) for p in ("post", "pre")}
    moves = {name: {p: statistics.fmean(measured[f"{name}_{p}_growth"]) for p in ("post", "pre")}
             for name in GRAD_SETTINGS if name.startswith("xiong+")}
    text = "; ".join(f"{name}: post {v['post']:.2f}, pre {v['pre']:.2f}" for name, v in moves.items())
    worst = max(moves, key=lambda n: sum(abs(math.log(moves[n][p] / base[p])) for p in base))
    return (f"Fitted last/first ratio at {depth} layers (mean over seeds), Xiong's model: post {base['post']:.2f}, pre "
            f"{base['pre']:.2f}; with one factor from this decoder: {text}. The factor that moves it most: {worst}.")


# ======================================================================================= depth


DEPTH_CONDITIONS = [
    "matches (DeepNet): Post-LN, DeepNorm and Pre-LN at the same depth with LayerNorm; DeepNorm's decoder-only "
    "constants alpha = (2L)^(1/4), beta = (8L)^(-1/4) and its init (xavier, gain beta on v, o and the FFN)",
    "matches: a Pre-LN baseline that trains at this depth (a precondition: 10% below the unigram loss)",
    "differs: no warmup at a high learning rate, to stress the placements (DeepNet trains with warmup); a character LM "
    "of width 32 for a few hundred steps (DeepNet: translation, 100 to 1,000 layers, long training)",
]


def preset_depth(lab: Lab) -> dict:
    train_fields, model = deep_sizes(lab, 24, 64)
    model = {**model, **XIONG_MODEL, **lab.pick(dict(d_model=32, n_heads=2), dict(d_model=64, n_heads=4), tiny={"n_layers": 4})}
    train_fields = {**train_fields, **lab.pick(dict(steps=300, batch_size=8, eval_every=50), {}, tiny={})}
    lr = 3e-3  # high for a model this deep, with no warmup: the setting DeepNorm is meant to survive
    seeds = lab.seeds(3, 3)
    runs, rows, measured = {}, [], {}
    for placement in ("post", "deepnorm", "pre"):
        rs = [lab.run(f"{placement}-deep-s{seed}", train_fields, model,
                      {"placement": placement, "lr": lr, "min_lr": lr / 10, "warmup": 0, "seed": seed}) for seed in seeds]
        runs[placement] = rs[0]
        val = stats([r["val_loss"] for r in rs])
        diverged = sum(r["status"] == "diverged" for r in rs)
        rows.append({"placement": placement, "seeds": len(rs), "diverged": diverged, "steps": min(r["steps"] for r in rs),
                     "val_loss": _round(val["mean"]), "val_std": _round(val["std"], 2),
                     "train_loss": _round(stats([r["train_loss"] for r in rs])["mean"])})
        measured[f"{placement}_val"] = [r["val_loss"] for r in rs]
        measured[f"{placement}_diverged"] = diverged
    measured["unigram_loss"] = unigram_loss(lab.dataset.train)
    layers = lab.model_over.get("n_layers", model["n_layers"])
    count = "a count of diverged seeds"
    clearly = C.ours("5% of the loss: DeepNet reports Post-LN failing outright at depth; 5% is well past seed noise")
    claims = [
        C.claim("depth.post_fails", f"a deep Post-LN model ({layers} layers, no warmup) diverges or ends at least 5% worse than "
                "Pre-LN, where Pre-LN trains", WANG22, _pick(measured, "post_val", "pre_val", "post_diverged", "unigram_loss"),
                C.given(trains("pre_val"), C.any_of(C.at_least("post_diverged", 1, point=count, origin=DIVERGED),
                                                    C.above("post_val", "pre_val", 0.05, origin=clearly, paired=True))),
                DEPTH_CONDITIONS),
        C.claim("depth.deepnorm_trains", "DeepNorm keeps the same Post-LN model trainable: it does not diverge and ends at most "
                "5% above Pre-LN, where Pre-LN trains", WANG22,
                _pick(measured, "deepnorm_val", "pre_val", "deepnorm_diverged", "unigram_loss"),
                C.given(trains("pre_val"), C.all_of(C.at_most("deepnorm_diverged", 0, point=count, origin=DIVERGED),
                                                    C.at_most("deepnorm_val", "pre_val", 0.05, origin=clearly, paired=True))),
                DEPTH_CONDITIONS),
    ]
    return {
        "title": f"Depth: Post-LN vs DeepNorm vs Pre-LN at {layers} layers without warmup",
        "question": "Does DeepNorm keep a deep Post-LN model trainable?",
        "settings": {"train": {**train_fields, **lab.train_over, "lr": lr, "warmup": 0}, "model": {**model, **lab.model_over},
                     "seeds": seeds},
        "columns": ["placement", "seeds", "diverged", "steps", "val_loss", "val_std", "train_loss"],
        "rows": rows, "claims": claims, "series": {"runs": {k: _curves(r) for k, r in runs.items()}},
        "notes": [f"{len(seeds)} seeds per placement, cosine schedule without warmup; curves: seed 0. Unigram loss "
                  f"{measured['unigram_loss']:.3f}: a model that learned only character frequencies."],
    }


# =================================================================================== batchnorm


@torch.no_grad()
def batch_effects(run_folder: Path, val_tokens, batch_size: int, seq_len: int, n_batches: int) -> dict:
    """For a trained model: how much one sequence's logits change (relative to their RMS) when its
    batch-mates change and when the batch-mates are half padding, in training mode (batch
    statistics); and the validation loss in eval mode and in training mode."""
    model, _ = load_run(run_folder)
    gen = D.Batches(val_tokens, batch_size, seq_len, seed=4242)
    batches = [gen.next() for _ in range(n_batches)]
    model.eval()
    eval_loss = statistics.fmean(model(x, y)[1].item() for x, y in batches)
    model.train()  # batch statistics, as in training (running statistics move; the model is not saved)
    train_loss = statistics.fmean(model(x, y)[1].item() for x, y in batches)
    (xa, _), (xb, _) = batches[0], batches[1]
    la = model(xa)[0][0]
    scale = la.pow(2).mean().sqrt().item()
    mates = torch.cat([xa[:1], xb[1:]])
    lb = model(mates)[0][0]
    mask = torch.ones_like(xa, dtype=torch.bool)
    mask[1:, seq_len // 2:] = False
    padded = xa.masked_fill(~mask, 0)
    lp = model(padded, mask=mask)[0][0]
    return {"mates_change": (la - lb).abs().max().item() / scale, "padding_change": (la - lp).abs().max().item() / scale,
            "eval_loss": eval_loss, "train_mode_loss": train_loss}


BATCH_SIZES = (2, 8, 32)
BATCHNORM_CONDITIONS = [
    "matches (Shen et al.): variable-length sequences padded per batch, BatchNorm's statistics over the real tokens "
    "only, small and large batches, LayerNorm as the control at every batch size",
    "differs: a character LM whose sequences are the text between blank lines (a speech), at most 64 tokens; the "
    "paper: translation and language modelling with word pieces",
    "differs: every batch size sees the same number of sequences (fewer steps for larger batches) at one learning rate",
]


def trend_sizes(lab: Lab) -> tuple[dict, dict, int]:
    """Training and model fields of the batch-size trend, and the sequences each run sees."""
    train_fields = dict(preset="small", tokenizer="char", ckpt_every=0, diverge_factor=3.0, batching="paragraphs",
                        lr=2e-3, min_lr=2e-4, weight_decay=0.1)
    if lab.size == "tiny":
        return {**train_fields, "seq_len": 16, "eval_batches": 2}, dict(d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                                                                        placement="pre"), 64
    if lab.quick:
        return {**train_fields, "seq_len": 64, "eval_batches": 8}, dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=64,
                                                                        placement="pre"), 3200
    return {**train_fields, "seq_len": 256, "eval_batches": 20}, dict(d_model=256, n_layers=4, n_heads=4, max_seq_len=256,
                                                                      placement="pre"), 32000


@torch.no_grad()
def train_eval_losses(run_folder: Path, tcfg_fields: dict, dataset, n_batches: int) -> dict:
    """A trained run's loss on fixed padded validation batches of its own batch size, with
    running statistics (eval mode) and with each batch's own statistics (training mode)."""
    from normlab.train import TrainConfig as _TC, make_batches

    model, _ = load_run(run_folder)
    tcfg = _TC(**tcfg_fields)
    gen = make_batches(dataset.val, tcfg, tcfg.seq_len, 4242, dataset.tokenizer)
    batches = [gen.next() for _ in range(n_batches)]
    model.eval()
    eval_loss = statistics.fmean(model(x, y, mask=m)[1].item() for x, y, m in batches)
    model.train()  # batch statistics, as in training (running statistics move; the model is not saved)
    train_loss = statistics.fmean(model(x, y, mask=m)[1].item() for x, y, m in batches)
    return {"eval_loss": eval_loss, "train_mode_loss": train_loss}


def preset_batchnorm(lab: Lab) -> dict:
    seeds = lab.seeds(LM_SEEDS, LM_SEEDS)  # the norms preset's seeds: its runs are reused
    norms = ("batchnorm", "layernorm", "rmsnorm")
    runs = train_norms(lab, norms, seeds)
    train_fields, _ = lm_sizes(lab)
    tf = {**train_fields, **lab.train_over}
    effects = {}
    for norm in norms:
        effects[norm] = [lab.job(f"effects-{norm}", {"run": r["run"], "bs": tf["batch_size"], "T": tf["seq_len"]},
                                 lambda r=r: batch_effects(lab.out / "runs" / r["run"], lab.dataset.val, tf["batch_size"],
                                                           tf["seq_len"], lab.pick(4, 10, tiny=2))) for r in runs[norm]]
    rows, measured = [], {}
    for norm in norms:
        e = effects[norm]
        mates = max(x["mates_change"] for x in e)
        pad = max(x["padding_change"] for x in e)
        val = stats([r["val_loss"] for r in runs[norm]])
        rows.append({"norm": norm, "batch_size": tf["batch_size"], "batching": "windows", "mates_change": _round(mates, 3),
                     "padding_change": _round(pad, 3), "val_loss": _round(val["mean"]), "val_std": _round(val["std"], 2)})
        measured.update({f"{norm}_mates_change": mates, f"{norm}_padding_change": pad})
    # the batch-size trend, on padded variable-length sequences (left out of the demo: 1.5 minutes on 2 cores)
    trend_train, trend_model, sequences = trend_sizes(lab)
    trend_seeds = lab.seeds(3, 3)
    trend = {}
    for norm in ("batchnorm", "layernorm") if not lab.s.brief else ():
        for bs in BATCH_SIZES:
            steps = max(1, sequences // bs)
            fields = {**trend_train, "batch_size": bs, "steps": steps, "warmup": max(1, steps // 10),
                      "eval_every": max(1, steps // 4)}
            rs = [lab.run(f"pad-{norm}-b{bs}-s{seed}", fields, trend_model, {"norm": norm, "seed": seed}) for seed in trend_seeds]
            losses = [lab.job(f"trainmode-{r['run']}", {"run": r["run"]},
                              lambda r=r, fields=fields: train_eval_losses(
                                  lab.out / "runs" / r["run"], {**fields, **lab.train_over}, lab.dataset, lab.pick(8, 20, tiny=2)))
                      for r in rs]
            gaps = [abs(x["train_mode_loss"] - x["eval_loss"]) / x["eval_loss"] for x in losses]
            trend[norm, bs] = {"val": [r["val_loss"] for r in rs], "gap": gaps}
            val = stats(trend[norm, bs]["val"])
            rows.append({"norm": norm, "batch_size": bs, "batching": "paragraphs", "val_loss": _round(val["mean"]),
                         "val_std": _round(val["std"], 2), "eval_loss": _round(statistics.fmean(x["eval_loss"] for x in losses)),
                         "train_mode_loss": _round(statistics.fmean(x["train_mode_loss"] for x in losses)),
                         "train_eval_gap": _round(statistics.fmean(gaps), 3)})
    small, large = BATCH_SIZES[0], BATCH_SIZES[-1]
    for bs in (small, large) if trend else ():
        measured[f"batchnorm_gap_b{bs}"] = trend["batchnorm", bs]["gap"]
        measured[f"layernorm_val_b{bs}"] = trend["layernorm", bs]["val"]
        measured[f"batchnorm_excess_b{bs}"] = [None if b is None or ln is None else b / ln - 1
                                               for b, ln in zip(trend["batchnorm", bs]["val"], trend["layernorm", bs]["val"])]
    worst = "the largest change over seeds: one sequence whose output moves proves the dependence"
    moves = C.ours("1e-3 of the logits' RMS: 100x above float32 rounding's 1e-7-1e-5, so rounding cannot pass it")
    still = C.ours("1e-5 of the logits' RMS: what float32 rounding through a few layers can reach, and no more")
    trend_cond = BATCHNORM_CONDITIONS + [f"batch sizes {small} and {large} compared, paired by seed ({len(trend_seeds)} seeds)"]
    claims = [
        C.claim("batchnorm.mates", "under BatchNorm a sequence's output changes with its batch-mates and their padding "
                "(largest change of its logits >= 1e-3 of their RMS), under LayerNorm and RMSNorm it does not (<= 1e-5)", SHEN20,
                _pick(measured, *[f"{n}_{k}" for n in norms for k in ("mates_change", "padding_change")]),
                C.all_of(C.at_least("batchnorm_mates_change", 1e-3, point=worst, origin=moves),
                         C.at_least("batchnorm_padding_change", 1e-3, point=worst, origin=moves),
                         *[C.at_most(f"{n}_{k}", 1e-5, point=worst, origin=still)
                           for n in ("layernorm", "rmsnorm") for k in ("mates_change", "padding_change")]),
                ["matches: the same sequence run with other batch-mates, and with half-padded batch-mates, in training mode",
                 "differs: measured on models trained on fixed windows (the norms preset's runs)"]),
    ]
    claims += [] if not trend else [
        C.claim("batchnorm.gap_grows", f"BatchNorm's train/eval mismatch grows as the batch shrinks: its loss in training "
                f"mode differs more from eval mode at batch {small} than at {large}", SHEN20,
                _pick(measured, f"batchnorm_gap_b{small}", f"batchnorm_gap_b{large}"),
                C.above(f"batchnorm_gap_b{small}", f"batchnorm_gap_b{large}", paired=True), trend_cond),
        C.claim("batchnorm.small_batch_worse", f"BatchNorm falls further behind LayerNorm as the batch shrinks: its excess "
                f"loss over LayerNorm is larger at batch {small} than at {large}", SHEN20,
                _pick(measured, f"batchnorm_excess_b{small}", f"batchnorm_excess_b{large}"),
                C.above(f"batchnorm_excess_b{small}", f"batchnorm_excess_b{large}", paired=True, absolute=True), trend_cond),
        C.claim("batchnorm.layernorm_steady", f"LayerNorm's loss does not grow as the batch shrinks: at batch {small} it ends "
                f"at most 2% above batch {large}", SHEN20, _pick(measured, f"layernorm_val_b{small}", f"layernorm_val_b{large}"),
                C.at_most(f"layernorm_val_b{small}", f"layernorm_val_b{large}", 0.02, paired=True, origin=COMPARABLE), trend_cond),
    ]
    brief = [] if trend else ["The demo leaves out the batch-size trend on padded sequences (1.5 minutes on 2 cores): "
                              "`normlab compare batchnorm --quick` runs it, reusing the demo's runs."]
    columns = ["norm", "batch_size", "batching", "mates_change", "padding_change", "val_loss", "val_std", "eval_loss",
               "train_mode_loss", "train_eval_gap"]
    rows = [{c: r.get(c) for c in columns} for r in rows]
    return {
        "title": "Why text models left BatchNorm",
        "question": "Does BatchNorm make a sequence's output depend on its batch, and does it fail with small, padded batches?",
        "settings": {"train": tf, "seeds": seeds, "trend": {"train": trend_train, "model": trend_model, "sequences": sequences,
                                                            "batch_sizes": list(BATCH_SIZES), "seeds": trend_seeds}},
        "columns": columns, "rows": rows, "claims": claims,
        "series": {"rows": [r for r in rows if r["batching"] == "windows"],
                   "trend": {f"{n}|{bs}": v for (n, bs), v in trend.items()}, "batch_sizes": list(BATCH_SIZES)},
        "notes": ["mates_change / padding_change (windows rows): largest change of one sequence's logits, relative to their "
                  "RMS, when its batch-mates are swapped for others / half padded (training mode: batch statistics; largest "
                  "over seeds). In a causal LM, training-mode BatchNorm also pools statistics over future positions.",
                  f"paragraphs rows: trained on the text between blank lines, padded per batch with a mask, {sequences} "
                  "sequences per run whatever the batch size; val_loss in eval mode (running statistics); train_eval_gap: "
                  "|training-mode loss - eval-mode loss| / eval-mode loss on fixed padded validation batches of the run's "
                  "own batch size."] + brief,
    }


# =================================================================================== precision

EPS16 = {"bf16": 2.0**-7, "fp16": 2.0**-10}  # machine epsilon


def precision_errors(op: str, dtype_name: str, scales, d: int, rows: int, seed: int) -> dict:
    """Max error (relative to the output's largest magnitude) against float64 of normlab's fused
    kernel, torch's own op and a naive version with statistics in the input dtype, at each scale;
    None where an output is not finite."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, d, generator=gen, dtype=torch.float64)
    w = (1 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64)).to(dtype)
    b = (0.1 * torch.randn(d, generator=gen, dtype=torch.float64)).to(dtype)
    eps = 1e-6 if op == "rms_norm" else 1e-5
    impls = {
        "rms_norm": {
            "normlab": lambda x: F.rms_norm(x, w, eps=eps),
            "torch": lambda x: TF.rms_norm(x, (d,), w, eps=eps),
            "naive": lambda x: reference.rms_norm(x, w, eps=eps, upcast=False),
        },
        "layer_norm": {
            "normlab": lambda x: F.layer_norm(x, w, b, eps=eps),
            "torch": lambda x: TF.layer_norm(x, (d,), w, b, eps=eps),
            "naive": lambda x: reference.layer_norm(x, w, b, eps=eps, upcast=False),
        },
    }[op]
    out = {name: [] for name in impls}
    for scale in scales:
        x = (base * scale).to(dtype)
        x64 = x.double()
        truth = (reference.rms_norm(x64, w.double(), eps=eps) if op == "rms_norm"
                 else reference.layer_norm(x64, w.double(), b.double(), eps=eps))
        top = truth.abs().max().item()
        for name, fn in impls.items():
            y = fn(x).double()
            out[name].append((y - truth).abs().max().item() / top if torch.isfinite(y).all() else None)
    return out


BROKEN = 0.1  # an output off by more than 10% of its scale is broken, not imprecise


def _median_eps(errors: list, dtype_name: str) -> float | None:
    """The median error over the scales where the output is finite, in machine epsilons."""
    finite = [v for v in errors if v is not None]
    return statistics.median(finite) / EPS16[dtype_name] if finite else None


def preset_precision(lab: Lab) -> dict:
    exps = lab.pick(np.arange(-4, 4.01, 0.5), np.arange(-4, 4.01, 0.25), tiny=np.arange(-4, 4.01, 1.0))
    scales = [float(10.0**e) for e in exps]
    d, n = lab.pick((4096, 16), (4096, 64), tiny=(1024, 4))
    draws = lab.pick(4, 8, tiny=2)  # independent random inputs: the samples of the median-error claim
    ops, dtypes = ("rms_norm", "layer_norm"), ("bf16", "fp16")
    per_draw = lab.job("errors_per_draw", {"scales": scales, "d": d, "rows": n, "draws": draws},
                       lambda: [{f"{op}|{dt}": precision_errors(op, dt, scales, d, n, seed=7 + i) for op in ops for dt in dtypes}
                                for i in range(draws)])
    # the plot and the table: the worst error over the draws at each scale (None: not finite in some draw)
    errors = {key: {impl: [None if any(e[key][impl][j] is None for e in per_draw) else max(e[key][impl][j] for e in per_draw)
                           for j in range(len(scales))] for impl in per_draw[0][key]} for key in per_draw[0]}
    rows, measured = [], {}
    for op in ops:
        for dt in dtypes:
            e = errors[f"{op}|{dt}"]
            for impl in ("normlab", "torch", "naive"):
                finite = [v for v in e[impl] if v is not None]
                bad = [s for s, v in zip(scales, e[impl]) if v is None or v > BROKEN]
                medians = [_median_eps(draw[f"{op}|{dt}"][impl], dt) for draw in per_draw]
                rows.append({"op": op, "dtype": dt, "impl": impl,
                             "max_err_in_eps": _round(max(finite) / EPS16[dt], 3) if finite else None,
                             "median_err_in_eps": _round(statistics.fmean(m for m in medians if m is not None), 3)
                             if any(m is not None for m in medians) else None,
                             "broken_scales": len(bad), "first_broken_scale": bad[0] if bad else None})
                measured[f"{op}_{dt}_{impl}_broken"] = len(bad)
                measured[f"{op}_{dt}_{impl}_max_eps"] = max(finite) / EPS16[dt] if finite else None
                measured[f"{op}_{dt}_{impl}_median_eps"] = medians
    combos = [(op, dt) for op in ops for dt in dtypes]
    conditions = ["matches: fp16/bf16 storage with reductions accumulated in fp32, against the same arithmetic in the input "
                  "dtype (the paper's rule for reductions such as normalization statistics)",
                  "differs: the norm alone on random rows at scales 1e-4 to 1e4, not a network in training"]
    count = "a count of scales where some draw broke: one non-finite output is a failure"
    broken_why = C.ours("one broken scale is a failure; 'broken': non-finite, or off by more than 10% of the output scale")
    claims = [
        C.claim("precision.fp16_overflow", "in fp16, statistics kept in the input dtype break (overflow or underflow: "
                "non-finite or >10% wrong output) over part of the activation range; fp32 statistics do not", MICIK18,
                _pick(measured, *[f"{op}_fp16_{i}_broken" for op in ops for i in ("naive", "normlab")]),
                C.all_of(*[C.at_least(f"{op}_fp16_naive_broken", 1, point=count, origin=broken_why) for op in ops],
                         *[C.at_most(f"{op}_fp16_normlab_broken", 0, point=count, origin=broken_why) for op in ops]),
                conditions),
        C.claim("precision.fp32_stats_exact", "with fp32 statistics the fused kernels stay within two machine epsilons of "
                "the float64 result at every scale, in bf16 and fp16", MICIK18,
                _pick(measured, *[f"{op}_{dt}_normlab_max_eps" for op, dt in combos]),
                C.all_of(*[C.at_most(f"{op}_{dt}_normlab_max_eps", 2.0, point="the worst case over every scale and draw",
                                     origin=C.ours("2 eps: the output's rounding (0.5 eps) and the weight multiply's, with "
                                                   "room for the fp32 statistics")) for op, dt in combos]),
                conditions),
        C.claim("precision.naive_bf16_worse", "where it does not break, bf16 arithmetic for the statistics still costs "
                "accuracy: the naive version's median error is at least twice the fused kernel's", MICIK18,
                _pick(measured, *[f"{op}_bf16_{i}_median_eps" for op in ops for i in ("naive", "normlab")]),
                C.all_of(*[C.above(f"{op}_bf16_naive_median_eps", f"{op}_bf16_normlab_median_eps", 1.0, over="input draws", paired=True,
                                   origin=C.ours("2x: one more rounding of the same size as the output's own"))
                           for op in ops]), conditions),
    ]
    return {
        "title": "Why statistics are kept in fp32",
        "question": "What happens to RMSNorm and LayerNorm in bf16/fp16 when the statistics are not kept in fp32?",
        "settings": {"d": d, "rows": n, "draws": draws, "scales": scales},
        "columns": ["op", "dtype", "impl", "max_err_in_eps", "median_err_in_eps", "broken_scales", "first_broken_scale"],
        "rows": rows, "claims": claims, "series": {"errors": errors, "scales": scales, "eps": EPS16},
        "notes": [f"{draws} independent draws of x = scale * N(0, 1), {n} rows of d features, rounded to the dtype; the "
                  "table and plot show the worst draw, the median-error claim takes one median per draw. "
                  "error: largest |y - y64| over the tensor "
                  "divided by the largest |y64|, in units of the dtype's machine epsilon (bf16 2^-7, fp16 2^-10). "
                  "naive: normlab's reference with upcast=False (squares, mean and rsqrt in the input dtype); "
                  "'broken': non-finite or more than 10% of the output scale off. fp16's largest value is 65504: "
                  "a square overflows once |x| passes 256."],
    }


# ======================================================================================= speed


def _round_totals(records: list[dict], backend: str) -> dict:
    """Per bench round, ``backend``'s rms_norm and layer_norm times summed over its cases (shapes,
    dtypes, passes): paired samples, since both ops ran in every round. Rounds where a slow case
    had already sat out are left off."""
    mine = [r for r in records if r["backend"] == backend and r["op"] in ("rms_norm", "layer_norm")]
    if not mine:
        return {f"{backend}_rms_norm_total_ms": None, f"{backend}_layer_norm_total_ms": None}
    k = min(len(r["times_ms"]) for r in mine)
    return {f"{backend}_{op}_total_ms": [sum(r["times_ms"][i] for r in mine if r["op"] == op) for i in range(k)]
            for op in ("rms_norm", "layer_norm")}


def preset_speed(lab: Lab) -> dict:
    from normlab import bench

    shapes = lab.pick(("4096x1024", "1024x4096"), bench.DEFAULT_SHAPES, tiny=("64x128",))
    backends = lab.pick(("normlab", "torch", "torch-module", "hf"), ("normlab", "torch", "torch-module", "hf", "compile", "liger", "apex"),
                        tiny=("normlab", "torch"))
    params = {"shapes": shapes, "backends": backends, "records": "with times_ms"}

    def kernels():
        records, notes = bench.run_bench(ops=("rms_norm", "layer_norm"), backends=backends, dtypes=("fp32", "bf16"),
                                         shapes=shapes, passes=("fwd", "bwd"), allocs=("alloc",),
                                         repeat=lab.pick(6, 10, tiny=3), case_seconds=lab.pick(0.4, 1.0, tiny=0.01))
        return {"records": records, "notes": notes}

    kern = lab.job("kernels", params, kernels)
    model = dict(d_model=256, n_layers=4, n_heads=4, max_seq_len=128)  # the "small" preset's width: norms are real work
    B, T = 8, 128
    if lab.size == "tiny":
        model, B, T = dict(d_model=16, n_layers=2, n_heads=2, max_seq_len=16), 4, 16
    batch = D.Batches(lab.dataset.train, B, T, seed=5).next()
    variants = {f"{n}|{impl}": {**model, "norm": n, "norm_impl": impl} for n in ("layernorm", "rmsnorm") for impl in ("normlab", "torch")}
    processes = lab.pick(4, 5, tiny=2)
    timing = lab.job("step_time", {"model": model, "over": lab.model_over, "B": B, "T": T, "processes": processes},
                     lambda: time_steps_in_processes({k: lab.model_config(v) for k, v in variants.items()}, batch,
                                                     rounds=lab.pick(4, 8, tiny=2), processes=processes))
    rows, measured = [], {}
    for r in kern["records"]:
        if r["op"] != "copy":
            rows.append({"what": "kernel", "op": r["op"], "backend": r["backend"], "dtype": r["dtype"], "shape": r["shape"],
                         "pass": r["pass"], "ms": r["ms"], "gbps": r["gbps"], "frac_of_copy": r["frac_of_copy"]})
    for key, t in timing.items():
        norm, impl = key.split("|")
        rows.append({"what": "train step", "op": norm, "backend": impl, "dtype": "fp32", "shape": f"{B}x{T}x{model['d_model']}",
                     "pass": "fwd+bwd+adamw", "ms": _round(t["ms"], 4), "gbps": None, "frac_of_copy": None})
        measured[f"{norm}_{impl}_step_ms"] = t["samples"]
    for backend in ("normlab", "torch"):
        measured.update(_round_totals(kern["records"], backend))
    # the paper's setting: a recurrent model, where the norms are most of the work
    gru = lab.pick(dict(d=512), dict(d=1024), tiny=dict(d=16))
    gru_B, gru_T = lab.pick((32, 32), (80, 50), tiny=(4, 8))
    gru_batch = D.Batches(lab.dataset.train, gru_B, gru_T, seed=6).next()
    vocab = lab.dataset.tokenizer.vocab_size
    gru_timing = lab.job("gru_step_time", {"gru": gru, "B": gru_B, "T": gru_T, "processes": processes},
                         lambda: time_steps_in_processes({n: {"gru": {"vocab_size": vocab, "d": gru["d"], "norm": n}}
                                                          for n in ("layernorm", "rmsnorm")}, gru_batch,
                                                         rounds=lab.pick(4, 8, tiny=2), processes=processes))
    for norm, t in gru_timing.items():
        rows.append({"what": "GRU train step", "op": norm, "backend": "normlab", "dtype": "fp32",
                     "shape": f"{gru_B}x{gru_T}x{gru['d']}", "pass": "fwd+bwd+adamw", "ms": _round(t["ms"], 4),
                     "gbps": None, "frac_of_copy": None})
        measured[f"gru_{norm}_step_ms"] = t["samples"]
    claims = [
        C.claim(f"speed.rms_kernel_{backend}", f"RMSNorm's kernel takes at least 7% less time than LayerNorm's ({backend}: "
                "forward + backward, summed over shapes and dtypes)", ZHANG19,
                _pick(measured, f"{backend}_rms_norm_total_ms", f"{backend}_layer_norm_total_ms"),
                C.below(f"{backend}_rms_norm_total_ms", f"{backend}_layer_norm_total_ms", 0.07, origin=ZHANG_SPEED,
                        paired=True, over="rounds"),
                [f"differs: the norm kernels alone ({backend}), on CPU (the paper timed whole models on GPUs)"])
        for backend in ("normlab", "torch")
    ] + [
        C.claim("speed.gru_step", "in a GRU whose gates are normalized, RMSNorm makes a training step at least 7% faster "
                "than LayerNorm (normlab's kernels)", ZHANG19, _pick(measured, "gru_rmsnorm_step_ms", "gru_layernorm_step_ms"),
                C.below("gru_rmsnorm_step_ms", "gru_layernorm_step_ms", 0.07, origin=ZHANG_SPEED, paired=True, over="processes"),
                ["matches: a recurrent model whose gates are normalized every step (Ba et al.'s layer-normalized GRU), the "
                 "kind of model behind the paper's largest gains",
                 f"differs: a one-layer character GRU LM of width {gru['d']}, batch {gru_B}x{gru_T}, on CPU with normlab's "
                 "kernels (the paper: RNNSearch on GPU)"]),
    ] + [
        C.claim(f"speed.step_{norm}", f"normlab's {norm} makes a training step at least 2% faster than torch's module", NORMLAB,
                _pick(measured, f"{norm}_normlab_step_ms", f"{norm}_torch_step_ms"),
                C.below(f"{norm}_normlab_step_ms", f"{norm}_torch_step_ms", 0.02, paired=True, over="processes",
                        origin=C.ours("2% of a step: the least a user would notice; the norms are a few percent of it")),
                ["normlab's own claim: the same decoder with torch's nn.LayerNorm / nn.RMSNorm as the baseline"])
        for norm in ("layernorm", "rmsnorm")
    ]
    return {
        "title": "Speed: kernels against the copy ceiling, and whole training steps",
        "question": "How fast are the norms per backend, and what do the fused kernels buy a training step?",
        "settings": {"shapes": list(shapes), "backends": list(backends), "step_model": model, "step_batch": [B, T],
                     "gru": {**gru, "batch": [gru_B, gru_T]}},
        "columns": ["what", "op", "backend", "dtype", "shape", "pass", "ms", "gbps", "frac_of_copy"],
        "rows": rows, "claims": claims, "series": {"records": kern["records"],
                                                "timing": {**{k: v["ms"] for k, v in timing.items()},
                                                           **{f"gru|{k}": v["ms"] for k, v in gru_timing.items()}}},
        "notes": ["Kernel rows come from normlab bench (allocating calls, median of interleaved rounds; frac_of_copy: GB/s "
                  "over the GB/s of y.copy_(x) on the same tensor in the same run; the kernel claims pair the ops by "
                  "round). Train-step rows: median time of a forward, backward and AdamW step, measured round-robin in "
                  f"each of {processes} fresh processes (the step claims pair the variants by process)."] + kern["notes"],
    }


# ===================================================================================== presets

PRESETS: dict[str, Callable[[Lab], dict]] = {
    "norms": preset_norms,
    "warmup": preset_warmup,
    "gradients": preset_gradients,
    "depth": preset_depth,
    "batchnorm": preset_batchnorm,
    "precision": preset_precision,
    "speed": preset_speed,
}
GROUPS = {"all": tuple(PRESETS), "demo": ("norms", "gradients", "batchnorm", "precision")}
# The fields a preset compares: the user cannot override them for it.
VARIES = {"norms": {"norm", "seed"},
          "warmup": {"placement", "lr", "min_lr", "warmup", "seed", "qk_norm", "beta2", "grad_clip", "norm", "mlp", "positions"},
          "gradients": {"placement", "n_layers", "norm", "mlp", "positions", "tie_embeddings", "embed_scale", "init"}, "depth": {"placement", "lr", "min_lr", "warmup", "seed", "norm", "mlp", "positions"},
          "batchnorm": {"norm", "seed", "batch_size", "batching", "steps"}, "precision": set(), "speed": {"norm", "norm_impl"}}


def expand(names: list[str]) -> list[str]:
    out = []
    for name in names:
        if name in GROUPS:
            out.extend(GROUPS[name])
        elif name in PRESETS:
            out.append(name)
        else:
            raise ValueError(f"unknown preset {name!r}; choose from {', '.join(list(PRESETS) + list(GROUPS))}")
    return list(dict.fromkeys(out))


def check_overrides(presets: list[str], overrides: dict) -> None:
    for name in presets:
        clash = sorted(set(overrides) & VARIES[name])
        if clash:
            raise ValueError(f"the {name} preset compares {', '.join(clash)}; it cannot be overridden for it "
                             f"(run another preset, or train that setting alone with `normlab train`)")


def run_presets(names: list[str], settings: Settings, console=None, command: str = "") -> dict:
    """Run the presets (skipping finished work) and write results.json; returns the results."""
    presets = expand(names)
    if "demo" in names:
        settings = dataclasses.replace(settings, size="tiny" if settings.size == "tiny" else "quick", brief=True)
    check_overrides(presets, settings.overrides)
    lab = Lab(settings, console)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {"presets": {}}
    from normlab.env import environment

    for i, name in enumerate(presets, 1):
        lab.preset, lab.cost, lab.stale = name, 0.0, []
        lab.say(f"[bold cyan]({i}/{len(presets)}) {name}[/bold cyan]")
        section = PRESETS[name](lab)
        section["seconds"] = round(lab.cost, 1)  # to compute it from nothing: cached work counts at its original cost
        if lab.stale:
            section["notes"].append(f"Cached results that no longer matched their data or code were computed again: "
                                    f"{', '.join(lab.stale)}.")
        section["size"] = lab.size
        results["presets"][name] = section
        results["presets"] = {k: results["presets"][k] for k in PRESETS if k in results["presets"]}
        results["meta"] = {**environment(), "command": command, "size": lab.size, "seeds": settings.seeds,
                           "data": settings.data or "shakespeare", "data_sha256": lab.data_hash, "overrides": settings.overrides}
        section["meta"] = results["meta"]  # results.json may merge sections of several commands: each says its own
        _write_json(path, results)
    return results


def _clean(obj):
    """JSON without NaN/Infinity (not JSON): non-finite numbers become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_clean(obj), indent=1, allow_nan=False))
    os.replace(tmp, path)


recheck = C.recheck
