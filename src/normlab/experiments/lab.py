"""The lab's machinery: settings, cached training runs and jobs, statistics and timing,
shared by every preset."""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import functools
import hashlib
import json
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from normlab import data as D
from normlab.env import clock
from normlab.experiments import cost as CO
from normlab.experiments import design as DS
from normlab.experiments import ladder as LD
from normlab.experiments.timing import TIMING_JOBS, bench_machine
from normlab.model import Decoder, ModelConfig
from normlab.runs import RunDir, clean_json, read_json, wait_for, write_json
from normlab.train import TrainConfig, split_overrides, train

SIZES = ("full", "quick", "tiny", "gpu")


class Interrupted(Exception):
    """A training run was stopped by Ctrl-C/SIGTERM; its checkpoint is saved."""


class RunsPending(Exception):
    """Raised at a preset's first measurement when it is being planned, or collected with
    training runs still unfinished: the measurements wait for the runs."""


MODES = ("run", "plan", "collect", "pilot")


@dataclass
class Pending:
    """A training run a preset needs that has not finished: its folder and the `normlab train`
    command that trains it there."""

    label: str
    folder: Path
    argv: list[str]
    # parameters, tokens, FLOPs, estimated GPU seconds (experiments.cost)
    cost: dict = field(default_factory=dict)
    preset: str = ""

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


@dataclass
class Settings:
    out: str = "runs/compare"
    # full, quick, tiny or gpu (the full size widened for one GPU: normlab.experiments.ladder)
    size: str = "full"
    seeds: int | None = None  # None: the preset's default number of seeds
    # the first test seed: a confirmatory run on seeds that no earlier verdict has seen
    seed_start: int = 0
    data: str | None = None  # None: the default corpus
    steps: int | None = None  # None: the preset's default
    overrides: dict = field(default_factory=dict)  # key=value training and model fields for every run
    quiet: bool = False  # no per-run progress bars
    # the demo: leave out a preset's slowest measurement (its notes say which and how to run it)
    brief: bool = False
    lrs: tuple[float, ...] | None = None  # the warmup preset's learning-rate sweep; None: the size's default
    # judge each claim alone (unadjusted) instead of the invocation's claims family-wise
    per_claim: bool = False
    design: str | None = None  # the design file (tuned learning rates, seed counts); None: the packaged one
    # a size-ladder rung (normlab.experiments.ladder): widths, tokens and rates scaled
    rung: int | None = None
    # --tune --arms: shell patterns (fnmatch) of the arms to pilot; the others keep the design's
    # rates. None: every arm
    tune_arms: tuple[str, ...] | None = None
    # "run": train what is missing; "plan": train and measure nothing, list the runs to train;
    # "collect": train nothing, measure and write results once every run has finished;
    # "pilot": train each tuned arm at the pilot seeds and learning rates, nothing else (--tune)
    mode: str = "run"


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
        # every run's floor, as tuned runs have it
        if "lr" in self.train_over and "min_lr" not in self.train_over:
            self.train_over["min_lr"] = self.train_over["lr"] / 10
        if settings.seeds is not None and settings.seeds < 1:
            raise ValueError(f"--seeds must be at least 1, got {settings.seeds}")
        if settings.size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}; got {settings.size!r}")
        if settings.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {settings.mode!r}")
        self.size = settings.size
        # the gpu size's width (a d_model or n_heads the user set is the gpu width, not the full size's)
        self.gpu_width = LD.gpu_width(self.model_over) if self.size == "gpu" else None
        if self.gpu_width:
            self.model_over = {k: v for k, v in self.model_over.items() if k not in self.gpu_width}
        self.quick = settings.size in ("quick", "tiny")
        self.preset = ""
        # seconds the current preset's runs and measurements took to compute (cached ones included)
        self.cost = 0.0
        # cached entries of the current preset that no longer matched their data or code
        self.stale: list[str] = []
        self.pending: dict[Path, Pending] = {}  # plan and collect: the unfinished runs, by folder
        self._measured = False  # the current preset has asked for a measurement (its runs come first)
        self.waiting = False  # plan and collect: the current preset needs a run that has not finished
        self._dataset = None
        self.design = DS.load(settings.design)
        # --tune: each arm's pilot losses, the equivalences to power
        self.pilot: dict = {"arms": {}, "pairs": []}
        self.arms_seen: set[str] = set()  # --tune: every tuned arm the presets asked for, piloted or not
        # the current preset's arms: the learning rate each trained at, and why
        self.tuned: dict[str, dict] = {}
        self.parameters: list[int] = []  # the non-embedding parameters of the current preset's runs
        # the conditions (env.clock, as JSON) its runs were trained under and its timings measured under
        self.clocks: dict[str, set[str]] = {"runs": set(), "timings": set()}
        # (d_model, n_layers, steps, lr) of its runs as sized (gpu, ladder)
        self.trained_at: set[tuple] = set()

    def begin(self, preset: str) -> None:
        self.preset, self.cost, self.stale, self._measured, self.waiting = preset, 0.0, [], False, False
        self.tuned, self.parameters, self.clocks = {}, [], {"runs": set(), "timings": set()}
        self.trained_at: set[tuple] = set()

    # -- sizes and seeds
    def pick(self, quick, full, tiny=None):
        """The value for this size (tiny falls back to quick; gpu is full, widened at training)."""
        if self.size == "tiny" and tiny is not None:
            return tiny
        return quick if self.quick else full

    def seeds(self, quick: int, full: int, preset: str | None = None) -> list[int]:
        """The test seeds from --seed-start on: --seeds of them, else the design's count for
        ``preset`` (the current one) at this size, else the preset's default (tiny: 1)."""
        if self.s.rung is not None and not self.s.seeds:  # the ladder's own count, every arm alike
            n = self.pick(LD.SEEDS, LD.SEEDS, tiny=1)
        else:
            n = self.s.seeds or DS.planned_seeds(self.design, self.size,
                                                 preset or self.preset) or self.pick(quick, full, tiny=1)
        seeds = list(range(self.s.seed_start, self.s.seed_start + n))
        if set(seeds) & set(DS.PILOT_SEEDS):  # a verdict on the seeds the rates were tuned on
            raise ValueError(f"--seed-start {self.s.seed_start} with {n} seeds reaches the pilot's seeds "
                             f"{', '.join(map(str, DS.PILOT_SEEDS))}: start at most {DS.PILOT_SEEDS[0] - n} "
                             f"or above {DS.PILOT_SEEDS[-1]}")
        return seeds

    def arm_seeds(self, arm: str, seeds: list[int], default: int, preset: str | None = None) -> list[int]:
        """The seeds of one arm: all of the preset's where the design sized them for an equivalence
        this arm is part of, else the preset's default count (the other arms' claims are
        directions with large effects; they pair with the first seeds)."""
        pairs = self.design.get(self.size, {}).get("seeds", {}).get(preset or self.preset,
                                                                    {}).get("pairs", [])
        if self.s.seeds or self.s.rung is not None or not pairs or any(arm in (p["a"], p["b"])
                                                                       for p in pairs):
            return seeds
        return seeds[:self.pick(default, default, tiny=1)]

    def plan_equivalence(self, a: str, b: str, margin: float) -> None:
        """Declare an equivalence claim between two tuned arms: --tune sizes the seeds to decide it
        (where it pilots both arms; else the design's seeds stand)."""
        if (
            self.s.mode == "pilot"
            and self.piloted(a)
            and self.piloted(b)
            and (self.preset, a, b, margin) not in self.pilot["pairs"]
        ):
            self.pilot["pairs"].append((self.preset, a, b, margin))

    def piloted(self, arm: str) -> bool:
        """Whether --tune pilots this arm (every arm, unless --arms names some)."""
        return self.s.tune_arms is None or any(fnmatch.fnmatchcase(arm, p) for p in self.s.tune_arms)

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
                    self.say(f"  [yellow]{what}: the cached result in {old.name} no longer matches its data "
                             "or code; computing it again[/yellow]")
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
            t = TrainConfig(**{k: v for k, v in self.train_over.items()
                               if k in ("data", "tokenizer", "bpe_vocab", "val_fraction")})
            self._dataset = D.prepare(t.data, t.tokenizer, t.bpe_vocab, t.val_fraction)
        return self._dataset

    def model_config(self, model: dict) -> ModelConfig:
        """A measurement's model: the preset's fields < the user's overrides (vocabulary from the data)."""
        fields = {**model, **self.model_over, "vocab_size": self.dataset.tokenizer.vocab_size}
        return ModelConfig.preset(fields.pop("preset", "small"), **fields)

    # -- training runs
    def run(self, label: str, train_fields: dict, model_fields: dict, varied: dict,
            tune: bool = False) -> dict:
        """Train (or reuse, or resume) one run: the preset's base fields < the user's overrides <
        the ``varied`` fields the preset compares. Returns the run's summary and curves.

        ``tune``: the run is one seed of an arm (its label less "-s<seed>") that trains at its own
        learning rate, the design's for this size (unless the user set lr for every run); with
        --tune the arm's pilot runs are trained instead."""
        if self._measured:  # --plan lists a preset's runs up to its first measurement
            raise RuntimeError(f"the {self.preset} preset asks for run {label} after a measurement: ask for "
                               "every training run first, so that --plan can list them")
        if self.s.mode == "pilot":
            if self.s.rung is not None:
                raise ValueError("--tune runs at the preset's own size; the ladder transfers the tuned "
                                 f"learning rates by its rule ({LD.LR_RULE})")
            if tune:
                self.arms_seen.add(arm_of(label))
            if tune and self.piloted(arm_of(label)):
                self._pilot(arm_of(label), train_fields, model_fields, varied)
            self.waiting = True
            return _pending_result(self.out / "runs" / label)
        if tune:
            lr, how = self._design_lr(arm_of(label))
            if lr is not None:
                varied = {**varied, "lr": lr, "min_lr": lr / 10}
            self.tuned[arm_of(label)] = {"lr": {**train_fields, **self.train_over, **varied}.get("lr"),
                                         "how": how}
        return self._train(label, train_fields, model_fields, varied)

    @property
    def design_key(self) -> str:
        return design_key(self.size, self.train_over)

    def _design_lr(self, arm: str) -> tuple[float | None, str]:
        """An arm's rate and how it was chosen: the user's lr for every run, else the pilot's under
        this lab's tokens, else (another tokenizer, no pilot under it) the character pilot's,
        said so, else none (the preset's)."""
        if "lr" in self.train_over:
            return None, "set for every run"
        lr = DS.tuned_lr(self.design, self.design_key, arm)
        if lr is not None:
            return lr, "tuned (the design)"
        lr = DS.tuned_lr(self.design, self.size, arm)
        if lr is not None:
            tokens = self.design_key.split("|")[1]
            return lr, f"tuned on characters (the design has no pilot under {tokens} tokens)"
        return None, "the preset's (no design at this size)"

    def at_rung(self, model: dict) -> dict:
        """A measurement's model fields (one that trains no run: gradients at initialization) at
        this lab's ladder rung: d_model scaled as a run's would be, so the ladder can say how the
        measurement moves with width. Unchanged off a ladder and on its middle rung."""
        if self.s.rung is None or self.s.rung == LD.MIDDLE:
            return model
        cfg = self.model_config(model)
        return {**model, "d_model": LD.width(cfg.d_model, cfg.n_heads, self.s.rung)}

    def size_of(self, model: dict) -> int:
        """A measurement's model's non-embedding parameter count (see :meth:`_non_embedding`)."""
        return self._non_embedding({}, model)

    def _non_embedding(self, tf: dict, mf: dict) -> int:
        """The run's non-embedding parameter count, from a model on the meta device: no memory,
        no initialization, and the global random state untouched (measurements may rely on it)."""
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return Decoder(self.model_config({**mf,
                                              "preset": tf.get("preset", "small")})).num_parameters(False)

    def _cost(self, tf: dict, mf: dict) -> dict:
        cfg = self.model_config({**mf, "preset": tf.get("preset", "small")})
        return CO.run_cost(self.parameters[-1], cfg.n_layers, cfg.d_model, tf.get("seq_len")
                           or cfg.max_seq_len, tf["steps"],
                           tf["batch_size"], tf.get("grad_accum", 1))

    def sized(self, tf: dict, mf: dict, model_fields: dict) -> tuple[dict, dict]:
        """A run's fields (``tf``, ``mf``) at this lab's size: widened for the gpu size, then
        scaled to its ladder rung (normlab.experiments.ladder). ``model_fields``: the preset's base
        model, without the fields its arms vary."""
        base = {**model_fields, **self.model_over}
        if self.gpu_width:
            tf, mf, base = self._resized(tf, mf, base, self.gpu_width)
        if self.s.rung is not None and self.s.rung != LD.MIDDLE:  # the middle rung: the very same runs
            cfg = self.model_config({**mf, "preset": tf.get("preset", "small")})
            tf, mf, base = self._resized(tf, mf, base,
                                         {"d_model": LD.width(cfg.d_model, cfg.n_heads, self.s.rung)})
        return tf, mf

    def sized_train(self, train_fields: dict, model_fields: dict, varied: dict | None = None) -> dict:
        """The training fields a run (:meth:`run`'s arguments) trains with at this lab's size: on a
        ladder rung or at the gpu size :meth:`sized` scales steps, warmup and rate, so what a preset
        derives from them (dyt's small data set) or states (a warmup in steps) uses these."""
        t_varied = {k: v for k, v in (varied or {}).items() if k in _TRAIN_FIELDS}
        tf = {**train_fields, **self.train_over, **t_varied}
        return self.sized(tf, {**model_fields, **self.model_over}, model_fields)[0]

    def _resized(self, tf: dict, mf: dict, base: dict, wide: dict) -> tuple[dict, dict, dict]:
        """A run's fields at another width (``wide``: d_model, maybe n_heads; see
        normlab.experiments.ladder): tokens grown with the parameters, the learning rate times
        d / d_new. The token ratio is the preset's base model's (``base``: without the fields its
        arms vary), so that every arm of a comparison trains on the same tokens."""
        d = self.model_config({**base, "preset": tf.get("preset", "small")}).d_model
        ratio = self._non_embedding(tf, {**base, **wide}) / self._non_embedding(tf, base)
        return LD.scale_lr(LD.scale_steps(tf, ratio), d / wide["d_model"]), {**mf, **wide}, {**base, **wide}

    def arm_lr(self, arm: str) -> float | None:
        """The learning rate the current preset's arm trained at (see :meth:`run`)."""
        return self.tuned.get(arm, {}).get("lr")

    def _pilot(self, arm: str, train_fields: dict, model_fields: dict, varied: dict) -> None:
        """Train an arm at every pilot seed and learning rate (once per arm)."""
        if arm in self.pilot["arms"]:
            return
        base = {**train_fields, **self.train_over, **varied}["lr"]
        losses = {}

        def train_at(factor: float) -> None:
            lr = float(f"{base * factor:.3g}")
            losses[str(lr)] = [self._train(f"pilot-{arm}-lr{lr:g}-s{seed}", train_fields, model_fields,
                                           {**varied, "seed": seed, "lr": lr, "min_lr": lr / 10})["val_loss"]
                               for seed in DS.PILOT_SEEDS]

        factors = list(DS.LR_FACTORS)
        for factor in factors:
            train_at(factor)
        for _ in range(DS.MAX_EXTEND):  # a best rate on the grid's edge: one more step beyond it
            best = DS.best_lr({float(k): v for k, v in losses.items()})[0]
            lrs = sorted(float(k) for k in losses)
            if best not in (lrs[0], lrs[-1]) or all(v is None for v in losses[str(best)]):
                break
            step = DS.LR_FACTORS[-1] / DS.LR_FACTORS[1]
            factors.append(max(factors) * step if best == lrs[-1] else min(factors) / step)
            train_at(factors[-1])
        self.pilot["arms"][arm] = {"preset": self.preset, "base_lr": base, "losses": losses}

    def _train(self, label: str, train_fields: dict, model_fields: dict, varied: dict) -> dict:
        t_varied = {k: v for k, v in varied.items() if k in _TRAIN_FIELDS}
        m_varied = {k: v for k, v in varied.items() if k not in _TRAIN_FIELDS}
        tf = {**train_fields, **self.train_over, **t_varied}
        mf = {**model_fields, **self.model_over, **m_varied}
        tf, mf = self.sized(tf, mf, model_fields)
        arm = self.tuned.get(arm_of(label))
        if arm is not None and arm["lr"] != tf.get("lr"):  # the rate it trains at is the size rule's
            arm.update(lr=tf.get("lr"), how=f"{arm['how']}, times d / d_new = {tf.get('lr')} (the size rule)")
        self.parameters.append(self._non_embedding(tf, mf))
        self.trained_at.add((mf.get("d_model"), mf.get("n_layers"), tf.get("steps"), tf.get("lr")))
        # stop_at only pauses a run: the same run resumed without it is the same run
        config = [{k: v for k, v in tf.items() if k != "stop_at"}, mf]
        key, config_key = self._keys(config)
        folder = self.out / "runs" / f"{label}-{key}"
        run = RunDir(folder)
        if not folder.exists():
            self._note_stale(self.out / "runs", f"{label}-*", config_key, f"run {label}")
        if self.s.mode in ("run", "pilot"):  # another process training it: wait, then take what it left
            wait_for(folder, f"normlab compare, waiting for run {label}",
                     lambda who: self.say(f"  [bold]{self.preset}[/bold] {label} is in progress in process "
                                          f"{who}: waiting for it"))
        resume = False
        summary = run.summary()
        if summary is not None:
            if summary.get("status") in ("completed", "diverged"):
                self.cost += summary.get("wall_s") or 0.0
                if not run.cache_file.exists():  # trained by a planned `normlab train`
                    write_json(run.cache_file, {"config_key": config_key, "key": key})
                return self._clocked(_run_result(run, summary, tf.get("lr")))
            resume = run.has_checkpoint()
        elif run.has_checkpoint() and run.config_file.exists():
            resume = True  # killed without a summary: its last checkpoint stands
        if self.s.mode not in ("run", "pilot"):
            self.pending.setdefault(folder, Pending(label, folder, _train_argv(folder, tf, mf, resume),
                                                    self._cost(tf, mf),
                                                     self.preset))
            self.waiting = True
            return _pending_result(folder)
        tcfg = TrainConfig(**{**tf, "out": str(folder), "quiet": self.s.quiet, "overwrite": not resume})
        tcfg.validate()
        with run.lock(f"normlab compare, run {label}"):  # another process training it: refused, not doubled
            if not resume:
                run.clear()
            write_json(run.cache_file, {"config_key": config_key, "key": key})
            self.say(f"  [bold]{self.preset}[/bold] {label}" + (" (resuming)" if resume else ""))
            summary = train(tcfg, mf, resume=resume, console=self.console, lock=False)
        if summary["status"] in ("interrupted", "stopped"):
            raise Interrupted(f"{label} stopped at step {summary['step']}; its checkpoint is in {folder}")
        self.cost += summary.get("wall_s") or 0.0
        return self._clocked(_run_result(run, summary, tf.get("lr")))

    def _clocked(self, result: dict) -> dict:
        if result.get("clock"):
            self.clocks["runs"].add(json.dumps(result["clock"], sort_keys=True))
        return result

    # -- measurements that are not training runs
    def job(self, name: str, params: dict, fn: Callable[[], dict]) -> dict:
        """``fn()``'s result, cached as JSON under jobs/<preset>/ by ``name`` and ``params`` (and,
        for timings, the machine and thread count)."""
        self._measured = True
        if self.s.mode in ("plan", "pilot") or self.waiting:
            raise RunsPending(self.preset)
        if name in TIMING_JOBS:
            params = {**params, "machine": [bench_machine(), torch.get_num_threads()]}
            self.clocks["timings"].add(json.dumps(clock(), sort_keys=True))
        key, config_key = self._keys(params)
        path = self.out / "jobs" / self.preset / f"{name}-{key}.json"
        if not path.exists():
            self._note_stale(path.parent, f"{name}-*.json", config_key, f"{self.preset} {name}")
        if path.exists():
            saved = read_json(path)
            if not isinstance(saved, dict) or "result" not in saved and "config_key" not in saved:
                raise ValueError(f"{path} is not a job result; delete it and rerun to measure again")
            if "result" not in saved:  # written before results carried their cost
                return saved
            self.cost += saved["seconds"]
            return saved["result"]
        self.say(f"  [bold]{self.preset}[/bold] {name}")
        t0 = time.perf_counter()
        result = clean_json(fn())
        seconds = time.perf_counter() - t0
        self.cost += seconds
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"seconds": round(seconds, 2), "result": result, "config_key": config_key})
        return result


def arm_of(label: str) -> str:
    """The arm a run belongs to: its label less the seed ("rmsnorm-s3" -> "rmsnorm")."""
    return re.sub(r"-s\d+$", "", label)


_TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}
# The sources whose change changes a result; the lab's own files (presets, claims, report) do not.
RESULT_SOURCES = ("model.py", "model_config.py", "train.py", "train_config.py", "data.py", "nn.py",
                  "functional.py", "reference.py", "rnn.py",
                  "kernels")


def design_key(size: str, train_fields: dict) -> str:
    """Where the design keeps the tuned rates of runs of this size and these training fields: the
    size, and for tokens other than characters the tokenizer too ("quick|bpe2048"). A rate tuned
    on characters is not one tuned on BPE tokens (docs/results/ladder-shallow-depth-quick-epyc,
    its BPE condition)."""
    kind = str(train_fields.get("tokenizer", "char"))
    if kind == "char":
        return size
    return f"{size}|{kind}" + (str(train_fields.get("bpe_vocab", TrainConfig.bpe_vocab)) if kind == "bpe"
                               else "")


def code_of(source: str) -> bytes:
    """What a Python source does, without its layout and comments (its syntax tree): a change of
    line breaks or comments leaves the lab's cached runs valid, any change of code does not."""
    return ast.dump(ast.parse(source)).encode()


@functools.lru_cache(maxsize=1)
def sources_hash() -> str:
    """sha256 of the code of the normlab sources that decide a training run's or a measurement's result."""
    root = Path(__file__).parents[1]  # src/normlab
    h = hashlib.sha256()
    for name in RESULT_SOURCES:
        for f in sorted((root / name).rglob("*.py")) if (root / name).is_dir() else [root / name]:
            h.update(f.relative_to(root).as_posix().encode())
            h.update(code_of(f.read_text()))
    return h.hexdigest()[:16]


def _train_argv(folder: Path, tf: dict, mf: dict, resume: bool) -> list[str]:
    """The `normlab train` command line that trains (or resumes) this run into its folder; checked
    to parse back to the same config, so that the run it trains is the one the lab asked for."""
    if resume:
        return ["normlab", "train", "--quiet", "--resume", str(folder)]

    def text(v) -> str:
        if v is None:
            return "none"
        return str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, float) else str(v)

    pairs = {**{k: text(v) for k, v in {**tf, **mf}.items()}, "out": str(folder), "overwrite": "true"}
    from normlab.train import resolve

    tcfg, m = resolve(None, pairs)
    if dataclasses.asdict(tcfg) != {**dataclasses.asdict(TrainConfig(**tf)), "out": str(folder),
                                    "overwrite": True} or m != mf:
        raise ValueError(f"the run in {folder} cannot be written as a `normlab train` command line: {pairs}")
    return ["normlab", "train", "--quiet", *(f"{k}={v}" for k, v in pairs.items())]


def _pending_result(folder: Path) -> dict:
    """What a preset sees of a run not trained yet (plan and collect): no losses, empty curves."""
    return {"run": folder.name, "status": "pending", "steps": 0, "val_loss": None, "init_val_loss": None,
            "train_loss": None, "wall_s": None, "step_ms": None, "tokens_per_s": None,
            "val_curve": {"step": [], "loss": [], "time_s": []}, "train_curve": {"step": [], "loss": []}}


def _run_result(run: RunDir, summary: dict, lr: float | None) -> dict:
    """A run's summary plus its curves from metrics.jsonl (validation loss against step and
    against training time, the training loss thinned to at most 200 points), and ``lr``, the rate
    it trained at (on a ladder rung or the gpu size the size rule's, not the preset's)."""
    diverged = summary["status"] == "diverged"
    return {
        "run": run.path.name, "status": summary["status"], "steps": summary["step"],
        "val_loss": None if diverged else summary.get("val_loss"),
        "init_val_loss": summary.get("init_val_loss"),
        "train_loss": summary.get("loss"), "wall_s": summary.get("wall_s"),
        "tokens_per_s": summary.get("tokens_per_s"), "parameters": summary.get("parameters_no_embedding"),
        "lr": lr,
        # what its times depend on (machine, threads); None before normlab recorded it
        "clock": summary.get("clock"),
        **run.curves(200),  # step_ms: the median past the first fifth of the steps
    }


