"""A training run's folder on disk: crash-safe writes, checkpoints that prove they are intact, and
the metrics log.

A run folder holds config.json (the resolved configs), tokenizer.json, metrics.jsonl (one JSON
record per line: training steps and evaluations), checkpoint.pt (torch.save of plain tensors and
numbers, loaded with ``weights_only=True``), checkpoint.pt.sha256 (the checkpoint's digest) and,
once a run ends, summary.json.

The digest file is written before the new checkpoint is renamed into place and holds the new
digest and the previous one, so that a crash at any point leaves a checkpoint whose digest it
holds. A checkpoint whose bytes match neither was changed or damaged after it was written: it is
refused, because torch's zip reader does not check its own CRCs and would train on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import statistics
import uuid
import warnings
from pathlib import Path

import torch

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoint.pt")  # what makes a folder a run


def write_atomic(path: Path, write, before_replace=None) -> None:
    """``write(tmp)`` into a temporary file beside ``path``, fsync it, (``before_replace(tmp)``),
    rename it over ``path``, fsync the folder: a crash leaves the old file or the new one, never
    half of one. The temporary name is unique, so two writers never share one. A failure (a full
    disk) removes the temporary file and says which path it was writing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace(tmp)
        os.replace(tmp, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise OSError(err.errno, f"could not write {path}: {err.strerror or err}") from err
    except RuntimeError as err:  # torch.save reports a full disk as an enforce failure
        raise OSError(f"could not write {path}: {err}") from err
    finally:
        tmp.unlink(missing_ok=True)


def clean_json(obj):
    """JSON without NaN/Infinity (not JSON): non-finite numbers become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    return obj


def write_json(path: Path, obj) -> None:
    """Crash-safe JSON, non-finite numbers as null."""
    text = json.dumps(clean_json(obj), indent=1, allow_nan=False)
    write_atomic(Path(path), lambda tmp: tmp.write_text(text))


def read_json(path: Path) -> dict:
    """A JSON file, or a ValueError that names it and what to do."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); restore it or start the run afresh with "
                         "overwrite=true") from err


# --------------------------------------------------------------------------------- locks


class Busy(OSError):
    """Another process holds the lock on a run folder (an OSError, as EBUSY is)."""

    def __str__(self) -> str:
        return str(self.strerror)


@contextlib.contextmanager
def locked(folder: Path, what: str, wait: bool = False):
    """An exclusive lock (fcntl.flock on <folder>/.lock, released when the process dies, also by
    SIGKILL) while one process writes a run folder or a results file. A second one is refused
    with the holder's PID, or (``wait``) waits for it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            pid, _, theirs = _holder_text(fd).partition(" ")
            raise Busy(errno.EBUSY, f"{folder} is in use by process {pid or 'unknown'} "
                                    f"({theirs or 'unknown'}); wait for it to finish or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _holder_text(fd: int) -> str:
    """What a lock file says of its holder: "PID what" (written by ``locked``)."""
    return os.pread(fd, 200, 0).decode(errors="replace").strip()


def holder(folder: Path) -> str | None:
    """Who holds ``folder``'s lock now ("PID what"), or None when no process does."""
    path = Path(folder) / ".lock"
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_text(fd) or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def wait_for(folder: Path, what: str, before=None) -> str | None:
    """If another process holds ``folder``'s lock, wait until it lets go (``before(holder)`` first)
    and return who held it; None, at once, when nobody did."""
    who = holder(folder)
    if who:
        if before:
            before(who)
        with locked(folder, what, wait=True):
            pass
    return who


def clear(folder: Path) -> None:
    """Empty a run folder but keep its lock file, which a process may hold."""
    for child in Path(folder).iterdir():
        if child.name == ".lock":
            continue
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


# ----------------------------------------------------------------------------- checkpoints


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def digest_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".sha256")


def _recorded(path: Path) -> list[str]:
    side = digest_path(path)
    if not side.exists():
        return []
    try:
        rec = json.loads(side.read_text())
        return [d for d in (rec.get("sha256"), rec.get("previous")) if isinstance(d, str)]
    except (json.JSONDecodeError, AttributeError):
        return ["unreadable"]


def save_checkpoint(path: Path, state: dict) -> None:
    """Write atomically, with the digest recorded before the rename (see the module's text)."""
    path = Path(path)

    def record(tmp: Path) -> None:
        previous = file_sha256(path) if path.exists() else None
        write_json(digest_path(path), {"sha256": file_sha256(tmp), "previous": previous})

    write_atomic(path, lambda tmp: torch.save(state, tmp), before_replace=record)


def load_checkpoint(path: Path) -> dict:
    """A checkpoint whose digest matches the one recorded for it, loaded with weights_only."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    recorded = _recorded(path)
    if not recorded:
        warnings.warn(f"{path} has no recorded digest ({digest_path(path).name} is missing), so it cannot be "
                      "checked for damage", stacklevel=2)
    elif file_sha256(path) not in recorded:
        raise ValueError(f"checkpoint {path} does not match the digest in {digest_path(path).name}: it was "
                         "changed or damaged after it was written. Restore an earlier copy of the run "
                         "folder, or start the run afresh with overwrite=true")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: say so plainly
        raise ValueError(f"checkpoint {path} is corrupt or not a normlab checkpoint ({type(err).__name__}: "
                         f"{err})") from err


# ------------------------------------------------------------------------------ metrics


def read_metrics(path: Path, *, last_line_may_be_cut: bool = False) -> list[dict]:
    """The records of metrics.jsonl. A line that is not a record is an error naming the file and
    line, except (with ``last_line_may_be_cut``) a last line a crash cut short."""
    path = Path(path)
    lines = path.read_text().splitlines() if path.exists() else []
    records = []
    for i, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
            if not isinstance(r, dict) or not isinstance(r.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError as err:
            if last_line_may_be_cut and i == len(lines):
                break
            raise ValueError(f"{path} line {i} is not a metrics record ({err}); restore the file or start "
                             "the run afresh with overwrite=true") from err
        records.append(r)
    return records


def truncate_metrics(path: Path, step: int) -> list[dict]:
    """Keep the records of the first ``step`` training steps (and the evaluations after them) and
    drop the rest, including a line a crash cut short: a run resumed from the checkpoint at
    ``step`` logs each later step once. Returns the kept records."""
    kept = [r for r in read_metrics(path, last_line_may_be_cut=True)
            if r["step"] < step or ("val_loss" in r and r["step"] <= step)]
    write_atomic(Path(path), lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in kept)))
    return kept


def logged_summary(records: list[dict]) -> dict:
    """What a summary says about the steps in ``records``: the last training and validation
    losses, and the training throughput over the timed steps (for a run resumed at its end)."""
    out: dict = {}
    trained = [r for r in records if "loss" in r and "step_ms" in r]
    if trained:
        out["loss"] = trained[-1]["loss"]
        seconds = sum(r["step_ms"] for r in trained) / 1e3
        tokens = sum(r["tokens_per_s"] * r["step_ms"] / 1e3 for r in trained)
        out["tokens_per_s"] = round(tokens / seconds, 1) if seconds > 0 else None
        out["train_s"] = round(seconds, 3)
    vals = [r for r in records if "val_loss" in r]
    if vals:
        out["val_loss"] = vals[-1]["val_loss"]
    return out


# ------------------------------------------------------------------------------ the folder


class RunDir:
    """One training run's folder: where each file is, how it is written (crash-safely, through the
    functions above) and how it is read back (checked). train.py writes a run through it; the
    lab, the presets and ``normlab sample`` read runs through it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config_file = self.path / "config.json"  # the resolved configs
        self.tokenizer_file = self.path / "tokenizer.json"
        self.metrics_file = self.path / "metrics.jsonl"  # a line per step and per evaluation
        self.summary_file = self.path / "summary.json"  # written when the run ends
        self.checkpoint_file = self.path / "checkpoint.pt"
        self.cache_file = self.path / "cache.json"  # the lab's key for the run

    def __str__(self) -> str:
        return str(self.path)

    def held(self) -> list[str]:
        """The run files already in the folder (none: no run there)."""
        return [name for name in RUN_FILES if (self.path / name).exists()]

    def lock(self, what: str, wait: bool = False):
        return locked(self.path, what, wait)

    def clear(self) -> None:
        clear(self.path)

    # -- writing, in the order a run writes
    def start(self, config: dict, save_tokenizer) -> None:
        """A new run: its configs, its tokenizer (``save_tokenizer(path)``) and an empty metrics log."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(self.config_file, config)
        write_atomic(self.tokenizer_file, save_tokenizer)
        self.metrics_file.write_text("")

    def write_config(self, config: dict) -> None:
        write_json(self.config_file, config)

    @contextlib.contextmanager
    def metrics_log(self):
        """``log(record)`` appends a record to metrics.jsonl and flushes it: a crash loses nothing
        that was logged. A failed write (a full disk) names the file."""
        f = open(self.metrics_file, "a")  # noqa: SIM115 (closed below)

        def log(record: dict) -> None:
            try:
                f.write(json.dumps(record) + "\n")
                f.flush()
            except OSError as err:  # resuming drops a half-written last line
                raise OSError(err.errno,
                              f"could not write {self.metrics_file}: {err.strerror or err}") from err

        try:
            yield log
        finally:
            f.close()

    def truncate_metrics(self, step: int) -> list[dict]:
        return truncate_metrics(self.metrics_file, step)

    def save_checkpoint(self, state: dict) -> None:
        save_checkpoint(self.checkpoint_file, state)

    def write_summary(self, summary: dict) -> None:
        write_json(self.summary_file, summary)

    # -- reading
    def config(self) -> dict:
        if not self.config_file.is_file():
            raise FileNotFoundError(f"{self.path} is not a run directory (no config.json)")
        return read_json(self.config_file)

    def summary(self) -> dict | None:
        """summary.json, or None before the run has ended."""
        return read_json(self.summary_file) if self.summary_file.exists() else None

    def has_checkpoint(self) -> bool:
        return self.checkpoint_file.exists()

    def load_checkpoint(self) -> dict:
        return load_checkpoint(self.checkpoint_file)

    def tokenizer_digest(self) -> str | None:
        return file_sha256(self.tokenizer_file) if self.tokenizer_file.exists() else None

    def metrics(self, *, last_line_may_be_cut: bool = False) -> list[dict]:
        return read_metrics(self.metrics_file, last_line_may_be_cut=last_line_may_be_cut)

    def curves(self, points: int = 200) -> dict:
        """The validation loss against step and against training time, the training loss (thinned
        to at most ``points``), and the median step time past the first fifth of the steps."""
        val_steps, val_loss, val_time, steps, losses, step_ms = [], [], [], [], [], []
        elapsed = 0.0
        for r in self.metrics():
            if "val_loss" in r:
                val_steps.append(r["step"])
                val_loss.append(r["val_loss"])
                val_time.append(round(elapsed, 3))
            elif "step_ms" in r:
                elapsed += r["step_ms"] / 1e3
                steps.append(r["step"])
                losses.append(r["loss"])
                step_ms.append(r["step_ms"])
        stride = max(1, len(steps) // points)
        return {"val_curve": {"step": val_steps, "loss": val_loss, "time_s": val_time},
                "train_curve": {"step": steps[::stride], "loss": losses[::stride]},
                "step_ms": statistics.median(step_ms[len(step_ms) // 5:]) if step_ms else None}
