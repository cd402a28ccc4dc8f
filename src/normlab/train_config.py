"""The training configuration: TrainConfig (every field typed and checked, with what it means),
and how ``key=value`` overrides and a config file resolve into it and the model's fields
(:mod:`normlab.model_config`). :mod:`normlab.train` runs what it describes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from normlab import data as D
from normlab.model_config import ModelConfig
from normlab.runs import read_json

SCHEDULES = ("cosine", "constant")
# what --resume may change
RESUMABLE = ("steps", "eval_every", "ckpt_every", "diag_every", "stop_at", "quiet")
BATCHINGS = ("windows", "paragraphs")
DTYPES = ("fp32", "bf16")


@dataclass
class TrainConfig:
    data: str = "shakespeare"  # corpus name or a path to a .txt file or folder
    tokenizer: str = "char"  # char, byte or bpe
    bpe_vocab: int = 1024  # vocabulary size when tokenizer=bpe
    val_fraction: float = 0.1  # share of documents held out for validation
    # train on the first N tokens of the training split only, a fixed set the steps repeat (0: all)
    train_tokens: int = 0
    preset: str = "small"  # model preset; model fields (d_model=..., norm=...) override it
    steps: int = 1000  # optimizer steps
    batch_size: int = 16  # sequences per micro-batch, all ranks together (a step: batch_size * grad_accum)
    seq_len: int | None = None  # tokens per sequence; None: the model's max_seq_len
    # "windows" of seq_len tokens, or "paragraphs": text between blank lines, padded and masked
    batching: str = "windows"
    # micro-batches per step (padded ones weighted by their real tokens: the true batch's gradient)
    grad_accum: int = 1
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # floor of the cosine schedule
    warmup: int = 100  # linear warmup steps (0: none)
    schedule: str = "cosine"  # cosine or constant after warmup
    weight_decay: float = 0.1  # AdamW decay on matrices (not on norms or embeddings)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm (0: no clipping)
    dtype: str = "fp32"  # fp32, or bf16 autocast
    eval_every: int = 100  # steps between validation losses (0: only at the end)
    eval_batches: int = 10  # fixed validation batches
    diag_every: int = 0  # steps between per-layer gradient norms and activation RMS (0: never)
    ckpt_every: int = 500  # steps between checkpoints (0: only at the end)
    diverge_factor: float = 3.0  # a loss above this times the first loss ends the run as "diverged"
    stop_at: int = 0  # stop with a checkpoint after this step, to --resume later (0: run to the end)
    seed: int = 0
    out: str = "runs/default"  # the run directory
    quiet: bool = False  # no progress bar
    overwrite: bool = False  # start afresh in an out directory that already holds a run's files

    def validate(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        if self.batching not in BATCHINGS:
            raise ValueError(f"batching must be one of {', '.join(BATCHINGS)}; got {self.batching!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.tokenizer not in D.TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {', '.join(D.TOKENIZERS)}; got {self.tokenizer!r}")
        for name in ("steps", "batch_size", "grad_accum", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        checks = {"lr": (self.lr > 0, "a number > 0"), "warmup": (self.warmup >= 0, "an int >= 0 (0: none)"),
                  "min_lr": (0 <= self.min_lr <= self.lr,
                             f"a number >= 0 and at most lr ({self.lr:g}): the schedule's floor"),
                  "weight_decay": (self.weight_decay >= 0, "a number >= 0 (0: none)"),
                  "beta1": (0 <= self.beta1 < 1, "in [0, 1)"), "beta2": (0 <= self.beta2 < 1, "in [0, 1)"),
                  "eval_every": (self.eval_every >= 0, "an int >= 0 (0: at the end)"),
                  "ckpt_every": (self.ckpt_every >= 0, "an int >= 0 (0: at the end)"),
                  "diag_every": (self.diag_every >= 0, "an int >= 0 (0: never)"),
                  "diverge_factor": (self.diverge_factor > 1, "a number > 1 (a multiple of the first loss)"),
                  "seq_len": (self.seq_len is None or self.seq_len >= 1,
                              "a positive int or None (None: max_seq_len)"),
                  "grad_clip": (self.grad_clip >= 0, "a number >= 0 (0: no clipping)"),
                  "train_tokens": (self.train_tokens >= 0, "an int >= 0 (0: the whole training split)")}
        for name, (ok, expected) in checks.items():
            value = getattr(self, name)
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(f"{name} must be {expected}, got {value!r}")


def split_overrides(pairs: dict) -> tuple[dict, dict]:
    """Split key=value overrides into (training fields, model fields); unknown keys are errors."""
    train_fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    model_fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    t, m = {}, {}
    for key, value in pairs.items():
        if key in train_fields:
            t[key] = _coerce(key, value, train_fields[key].type)
        elif key in model_fields:
            m[key] = _coerce(key, value, model_fields[key].type)
        else:
            valid = sorted(set(train_fields) | set(model_fields))
            raise ValueError(f"unknown key {key!r}; valid keys: {', '.join(valid)}")
    return t, m


def _coerce(key: str, value, annotation):
    if not isinstance(value, str):
        return value
    ann = str(annotation)
    if value.lower() in ("none", "null") and "None" in ann:
        return None
    if "bool" in ann:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key} expects true or false, got {value!r}")
    try:
        if ann.startswith("int"):
            return int(value)
        if ann.startswith("float"):
            return float(value)
    except ValueError as err:
        what = "a whole number" if ann.startswith("int") else "a number"
        raise ValueError(f"{key} expects {what}, got {value!r}") from err
    return value


def resolve(config_file: str | None = None, overrides: dict | None = None) -> tuple[TrainConfig, ModelConfig]:
    """Defaults < config file (JSON, flat or {"train": ..., "model": ...}) < overrides."""
    pairs: dict = {}
    if config_file:
        if not Path(config_file).is_file():
            raise FileNotFoundError(f"--config {config_file}: no such file")
        raw = read_json(Path(config_file))
        if "train" in raw or "model" in raw:
            raw = {**raw.get("train", {}), **raw.get("model", {})}
        pairs.update(raw)
    pairs.update(overrides or {})
    t, m = split_overrides(pairs)
    tcfg = TrainConfig(**t)
    tcfg.validate()
    ModelConfig.preset(tcfg.preset, **m)  # a bad model field fails here, before anything is printed or read
    return tcfg, m
