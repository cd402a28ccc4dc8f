"""The training loop: AdamW, warmup then cosine or constant, clipping, accumulation, bf16 autocast,
validation, JSON-lines metrics, atomic checkpoints, exact resume, divergence as a result, DDP.

A run lives in its own directory: config.json (the resolved config), tokenizer.json,
metrics.jsonl (one line per step and per evaluation, flushed as written), summary.json (status,
final losses, tokens/s, wall time, versions) and checkpoint.pt (model, optimizer, scheduler, RNG
states, step and data position; written to a temporary file then renamed), whose digest
checkpoint.pt.sha256 holds. normlab.runs.RunDir owns those files; a resume refuses a checkpoint that does
not match its digest, config.json or tokenizer.json, and rebuilds a summary a kill prevented.

Multi-process: ``torchrun --nproc_per_node=N -m normlab train ...`` runs DistributedDataParallel
(gloo on CPU, nccl on CUDA); each rank draws its own windows, the global batch is preserved
(batch_size is split across ranks) and only rank 0 logs and writes checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from normlab import data as D
from normlab import env
from normlab.footprint import CONTENTION_WINDOW, check_fits, warn_if_contended
from normlab.model import Decoder, ModelConfig
from normlab.runs import RunDir, logged_summary
# the configuration, re-exported: callers and configs name them through normlab.train
from normlab.train_config import (BATCHINGS, DTYPES, RESUMABLE, SCHEDULES, TrainConfig, resolve,  # noqa: F401
                                  split_overrides)


def resumed(run: str | Path, changes: dict | None = None) -> tuple[TrainConfig, dict]:
    """The config a run resumes with: its own (config.json), with the RESUMABLE ``changes``."""
    if not RunDir(run).config_file.is_file():
        raise FileNotFoundError(f"--resume {run}: not a run directory (no config.json); start a run there "
                                f"with out={run}")
    saved = RunDir(run).config()
    # train() refuses the rest
    kept = {k: v for k, v in (changes or {}).items() if k in TrainConfig.__dataclass_fields__}
    # quiet is this command's
    tcfg = TrainConfig(**{**saved["train"], "quiet": False, **kept, "out": str(run)})
    tcfg.validate()
    return tcfg, saved["model"]


# ---------------------------------------------------------------------------------- pieces


def lr_at(step: int, cfg: TrainConfig) -> float:
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


class _Stop:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint and stops after the current step."""

    def __init__(self) -> None:
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C: give up at once
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


# -------------------------------------------------------------------------------- training


def train(tcfg: TrainConfig, model_overrides: dict | None = None, *, resume: bool = False, console=None,
          changes: dict | None = None, lock: bool = True) -> dict:
    """Run (or resume) training; returns the summary written to summary.json. A resumed run keeps
    its saved config except ``tcfg``'s quiet and stop_at and the ``changes`` (only RESUMABLE fields:
    more steps, another evaluation or checkpoint cadence). ``lock=False``: the caller holds the
    run folder's lock already (the lab)."""
    bad = sorted(set(changes or {}) - set(RESUMABLE))
    if bad:
        raise ValueError("--resume continues a run as it was configured; it can change only "
                         f"{', '.join(RESUMABLE)}, not {', '.join(bad)} (start a new run with out=DIR for "
                         "that)")
    model_overrides = dict(model_overrides or {})
    run = RunDir(tcfg.out)
    done = run.summary() if resume else None
    if done and set(changes or {}) <= {"quiet", "stop_at", "steps"}:
        saved = run.config()
        steps = (changes or {}).get("steps") or saved["train"]["steps"]
        if done.get("status") == "diverged" or (done.get("status") == "completed"
                                                and done.get("step", 0) >= steps):
            _check_finished(run, saved)
            return {**done, "already": True}  # nothing to train: the run's own figures, not a rerun's
    world = World.join()
    if world.size > 1 and tcfg.batch_size % world.size:
        world.leave()
        raise ValueError(
            f"batch_size {tcfg.batch_size} must divide by the number of processes ({world.size})"
        )
    try:
        # one writer per run folder: rank 0 writes it, a second `train` on it is refused
        with run.lock("normlab train") if world.main and lock else contextlib.nullcontext():
            return _train(tcfg, model_overrides, run, world, (changes or {}) if resume else None, console)
    finally:
        world.leave()


@dataclass(frozen=True)
class World:
    """The processes a run trains in: this one alone, or the ranks torchrun started."""

    device: torch.device
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:  # rank 0 logs and writes the run folder
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @staticmethod
    def join() -> World:
        """This process's place: DDP under torchrun (WORLD_SIZE > 1), else alone."""
        device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return World(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return World(device, dist.get_rank(), dist.get_world_size())

    def leave(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _train(tcfg: TrainConfig, model_overrides: dict, run: RunDir, world: World, resume: dict | None,
           console) -> dict:
    """Train the run in ``run`` (``resume``: None for a new run, else the RESUMABLE changes it
    resumes with) and return its summary."""
    device, rank = world.device, world.rank
    previous: dict = {}  # a resumed run's summary: its values stay until new steps replace them
    if resume is not None:
        saved = run.config()
        tcfg = TrainConfig(**{**saved["train"], "out": str(run), "quiet": tcfg.quiet, "stop_at": tcfg.stop_at,
                              **resume})
        tcfg.validate()
        # they pause or quiet, not change, a run
        kept = {k: v for k, v in resume.items() if k not in ("quiet", "stop_at")}
        if kept and world.main:  # the run's recorded config is what it runs with from now on
            saved["train"].update(kept)
            run.write_config(saved)
        previous = run.summary() or {}
        model_overrides = saved["model"]
    dataset = D.prepare(tcfg.data, tcfg.tokenizer, tcfg.bpe_vocab, tcfg.val_fraction)
    mcfg = ModelConfig.preset(tcfg.preset, **{**model_overrides, "vocab_size": dataset.tokenizer.vocab_size})
    seq_len = tcfg.seq_len or mcfg.max_seq_len
    if seq_len > mcfg.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len}")
    check_fits(mcfg, max(1, tcfg.batch_size // world.size), seq_len, device, eval_batches=tcfg.eval_batches,
               what=f"training {'the run in ' + str(run) if resume is not None else 'this model'}")
    model = _initialized(mcfg, tcfg.seed).to(device)
    opt = make_optimizer(model, tcfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, tcfg) / tcfg.lr)
    batches = make_batches(train_split(dataset, tcfg.train_tokens), tcfg, seq_len, tcfg.seed,
                           dataset.tokenizer, rank, world.size)
    val_batches = _fixed_batches(dataset.val, tcfg, seq_len, dataset.tokenizer)
    start = 0
    first_loss = None  # the divergence test compares with it (restored on resume)
    init_val_loss = None  # the loss at initialization, where the lab's curves start (restored on resume)
    resolved = {"train": dataclasses.asdict(tcfg), "model": {**model_overrides},
                "model_resolved": dataclasses.asdict(mcfg)}
    if resume is not None:
        state = run.load_checkpoint()
        _check_agrees(run, state,
                      {"train": dataclasses.asdict(tcfg), "model_resolved": dataclasses.asdict(mcfg)})
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as err:
            raise ValueError(
                f"checkpoint {run.checkpoint_file} does not fit this model config: {err}"
            ) from err
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        batches.load_state(state["data"])
        start = int(state["step"])
        first_loss = state.get("first_loss")
        init_val_loss = state.get("init_val_loss")
    elif world.main:
        held = run.held()
        if held and not tcfg.overwrite:
            raise ValueError(f"{run} already holds a run ({', '.join(held)}); resume it (--resume {run}), "
                             "choose another out=DIR, or pass overwrite=true to start it afresh")
        run.start(resolved, dataset.tokenizer.save)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=tcfg.dtype == "bf16")
    # the clock (step_ms, the lab's loss-per-second axis) must time training, not compilation
    warm_up(model, val_batches[0], device, autocast)
    net = torch.nn.parallel.DistributedDataParallel(model) if world.distributed else model
    logged = {}
    if resume is not None and world.main:  # a crash after the checkpoint logged steps that will now run again
        kept = run.truncate_metrics(start)
        last = max((r["step"] for r in kept if "step_ms" in r), default=-1)
        if last != start - 1:
            raise ValueError(f"{run.checkpoint_file} is at step {start} but {run.metrics_file} records "
                             f"training up to step {last + 1}: the files disagree. Restore them, or start "
                             "the run afresh with overwrite=true")
        logged = logged_summary(kept)  # a summary the run may have died before writing is rebuilt from these
    summary = {**previous, **{k: v for k, v in logged.items() if k in ("loss", "val_loss")},
               "status": "running", "step": start}
    t_start = time.perf_counter()
    tokens_seen = 0
    progress, task = _progress(tcfg, start, console) if world.main else (None, None)

    run_config = {"train": dataclasses.asdict(tcfg), "model_resolved": dataclasses.asdict(mcfg)}
    tokenizer_digest = run.tokenizer_digest()

    def checkpoint(step: int) -> None:
        if world.main:  # every rank holds the same data position and (DDP) the same weights
            run.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                        "scheduler": sched.state_dict(), "rng": torch.get_rng_state(),
                                        "data": batches.state(), "step": step, "first_loss": first_loss,
                                        "init_val_loss": init_val_loss, "config": run_config,
                                        "tokenizer_sha256": tokenizer_digest})
        if world.distributed:
            dist.barrier()

    # rank 0 logs; the others' log() does nothing
    with run.metrics_log() if world.main else contextlib.nullcontext(lambda record: None) as log:
        if start == 0:  # the loss at initialization: where every curve starts
            init_val_loss = evaluate(model, val_batches, device, autocast)
            log({"step": 0, "val_loss": init_val_loss})
        summary["init_val_loss"] = init_val_loss
        status = "completed"
        step_times, warned = [], False  # this process's step times, for the contention warning
        with _Stop() as stop, (progress or contextlib.nullcontext()):
            for step in range(start, tcfg.steps):
                t0 = time.perf_counter()
                diag = tcfg.diag_every and step % tcfg.diag_every == 0
                model.record_activations(bool(diag))
                loss_sum = 0.0
                tokens_before = tokens_seen
                micro_batches = [[t.to(device) for t in batches.next()] for _ in range(tcfg.grad_accum)]
                weights = _token_weights(micro_batches, world, device)
                for micro, (x, y, *mask) in enumerate(micro_batches):
                    mask = mask[0] if mask else None  # paragraphs: (B, T) real tokens
                    # every rank alike
                    tokens_seen += (int(mask.sum()) if mask is not None else x.numel()) * world.size
                    sync = not world.distributed or micro == tcfg.grad_accum - 1
                    ctx = net.no_sync() if world.distributed and not sync else contextlib.nullcontext()
                    with ctx, autocast:
                        _, loss = net(x, y, mask=mask)
                    (loss / tcfg.grad_accum if weights is None else loss * weights[micro]).backward()
                    loss_sum += (
                        loss.item() / tcfg.grad_accum if weights is None else loss.item() * weights[micro]
                    )
                stopping = stop.requested
                # the loss, and whether any rank was asked to stop: all ranks stop at the same step
                if world.distributed:
                    t = torch.tensor([loss_sum, float(stop.requested)], device=device)
                    dist.all_reduce(t)
                    loss_sum, stopping = t[0].item() / world.size, t[1].item() > 0
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip
                                                           if tcfg.grad_clip > 0 else float("inf"))
                if first_loss is None:
                    first_loss = loss_sum
                if not math.isfinite(loss_sum) or loss_sum > tcfg.diverge_factor * first_loss:
                    status = "diverged"  # keep the last good checkpoint: this state is not saved
                    log({"step": step, "loss": loss_sum, "diverged": True})
                    break
                record = {"step": step, "loss": loss_sum, "lr": sched.get_last_lr()[0],
                          "grad_norm": float(grad_norm)}
                if diag:
                    record["layer_grad_norms"] = model.grad_norms()
                    record["activation_rms"] = model.activation_rms()
                    record["head_input_rms"] = model.head_input_rms()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step_s = time.perf_counter() - t0
                record.update(step_ms=round(step_s * 1e3, 3),
                              tokens_per_s=round((tokens_seen - tokens_before) / step_s, 1))
                log(record)
                step_times.append(record["step_ms"])
                if not warned and device.type == "cpu" and len(step_times) % CONTENTION_WINDOW == 0:
                    warned = warn_if_contended(step_times)
                last = step + 1 == tcfg.steps
                if (tcfg.eval_every and (step + 1) % tcfg.eval_every == 0) or last:
                    val = evaluate(model, val_batches, device, autocast)
                    summary["val_loss"] = val
                    log({"step": step + 1, "val_loss": val})
                summary.update(step=step + 1, loss=loss_sum)
                if progress:
                    progress.update(task, completed=step + 1, loss=loss_sum,
                                    val=summary.get("val_loss", float("nan")),
                                    tps=record["tokens_per_s"])
                if tcfg.ckpt_every and (step + 1) % tcfg.ckpt_every == 0 and not last:
                    checkpoint(step + 1)
                if stopping:
                    status = "interrupted"
                    break
                if tcfg.stop_at and step + 1 >= tcfg.stop_at and not last:
                    status = "stopped"
                    break
    if status != "diverged" or not run.has_checkpoint():
        # diverged: the last good checkpoint stays; with none written yet, the state reached is
        # saved so that the run can still be inspected and sampled
        checkpoint(summary["step"])
    wall = time.perf_counter() - t_start
    summary.update(status=status, first_loss=first_loss, wall_s=round(wall, 2),
                   tokens_per_s=round(tokens_seen / wall, 1) if wall > 0 else None, versions=env.versions(),
                   clock={**env.clock(), **({"loaded": True} if warned else {})},  # what its times depend on
                   parameters=model.num_parameters(), parameters_no_embedding=model.num_parameters(False))
    if tokens_seen == 0 and logged:  # resumed at its end: the run's figures are the logged ones
        summary.update(tokens_per_s=logged.get("tokens_per_s"),
                       wall_s=previous.get("wall_s", logged.get("train_s")))
        if not previous:
            summary["rebuilt"] = "summary.json was missing: rebuilt from checkpoint.pt and metrics.jsonl"
    if world.main:
        run.write_summary(summary)
    return summary


def _token_weights(micro_batches: list, world: World, device) -> list[float] | None:
    """Each padded micro-batch's share of the step's real tokens (all ranks'), times the rank
    count that DDP's gradient average divides by: a micro-batch's loss is the mean over its own
    real tokens, so equal weights would count a token of a short batch more than one of a long
    batch, and accumulated steps would not give the true batch's gradient. None for windows,
    whose micro-batches hold equal token counts (the loss is divided by grad_accum, as always)."""
    if len(micro_batches[0]) < 3 or (len(micro_batches) == 1 and not world.distributed):
        return None
    counts = torch.tensor([float(b[2].sum()) for b in micro_batches], dtype=torch.float64)
    total = counts.sum()
    if world.distributed:
        total = total.to(device)
        dist.all_reduce(total)
        total = total.cpu()
    return (counts * world.size / total).tolist()


def warm_up(model: Decoder, batch: tuple, device, autocast) -> None:
    """Compile and call once, untimed, every kernel the run will use: the training forward and
    backward and the evaluation forward, in the run's dtype. Leaves no trace: the buffers
    (BatchNorm's running statistics) are restored, gradients cleared and the RNG untouched."""
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    x, y, *mask = (t.to(device) for t in batch)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with autocast:
            _, loss = model(x, y, mask=mask[0] if mask else None)
        loss.backward()
        evaluate(model, [batch], device, autocast)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def train_split(dataset, train_tokens: int):
    """The training tokens a run draws from: the split, or its first ``train_tokens`` (a small
    dataset that the steps go over again and again, the data-scarce regime)."""
    if not train_tokens:
        return dataset.train
    if train_tokens > len(dataset.train):
        raise ValueError(f"train_tokens must be at most the training split's {len(dataset.train):,} tokens, "
                         f"got {train_tokens:,}")
    return dataset.train[:train_tokens]


def make_batches(tokens, tcfg: TrainConfig, seq_len: int, seed: int, tokenizer, rank: int = 0,
                 world: int = 1):
    """The batch source ``tcfg.batching`` asks for: (x, y) windows, or (x, y, mask) paragraphs."""
    if tcfg.batching == "paragraphs":
        return D.ParagraphBatches(tokens, tcfg.batch_size, seq_len, seed, D.newline_id(tokenizer), rank,
                                  world)
    return D.Batches(tokens, tcfg.batch_size, seq_len, seed, rank, world)


def _fixed_batches(tokens, tcfg: TrainConfig, seq_len: int, tokenizer) -> list:
    val = make_batches(tokens, tcfg, seq_len, 12345, tokenizer)
    return [val.next() for _ in range(tcfg.eval_batches)]


@torch.no_grad()
def evaluate(model: Decoder, batches: list, device, autocast) -> float:
    was = model.training
    model.eval()
    total = 0.0
    for x, y, *mask in batches:
        with autocast:
            _, loss = model(x.to(device), y.to(device), mask=mask[0].to(device) if mask else None)
        total += loss.item()
    model.train(was)
    return total / len(batches)


def _progress(tcfg: TrainConfig, start: int, console):
    if tcfg.quiet:
        return None, None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}  val {task.fields[val]:.3f}  {task.fields[tps]:.0f} tok/s"),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console,
    )
    task = progress.add_task("train", total=tcfg.steps, completed=start, loss=float("nan"), val=float("nan"),
                             tps=0.0)
    return progress, task


# ---------------------------------------------------------------------------------- sample


# Fields a resumed run may differ in from its checkpoint: what --resume may change, and where
# the folder is.
_VOLATILE = (*RESUMABLE, "out", "overwrite")


def _check_finished(run: RunDir, saved: dict) -> None:
    """A finished run's files agree (checkpoint digest, config.json as ``saved``, tokenizer.json),
    checked without building its model or reading its data."""
    vocab = saved["model_resolved"]["vocab_size"]
    resolved = dataclasses.asdict(ModelConfig.preset(saved["train"]["preset"],
                                                     **{**saved["model"], "vocab_size": vocab}))
    _check_agrees(run, run.load_checkpoint(), {"train": saved["train"], "model_resolved": resolved})


def _check_agrees(run: RunDir, state: dict, config: dict) -> None:
    """The run folder's config.json and tokenizer.json are the ones its checkpoint was trained
    with (checkpoints from before this check carry neither and pass)."""
    held = state.get("config")
    if held:
        differ = [f"{k}: {held['train'][k]!r} in checkpoint.pt, {v!r} in config.json"
                  for k, v in config["train"].items()
                  if k not in _VOLATILE and k in held["train"] and held["train"][k] != v]
        differ += [f"{k}: {held['model_resolved'][k]!r} in checkpoint.pt, {v!r} in config.json"
                   for k, v in config["model_resolved"].items() if held["model_resolved"].get(k, v) != v]
        if differ:
            raise ValueError(f"{run}: config.json does not describe the run its checkpoint holds "
                             f"({'; '.join(differ)}). Restore config.json, or start a new run with out=DIR")
    digest = state.get("tokenizer_sha256")
    if digest and digest != run.tokenizer_digest():
        raise ValueError(f"{run}: tokenizer.json is not the tokenizer checkpoint.pt was trained with; "
                         "restore it, or start a new run with out=DIR")


def _initialized(mcfg: ModelConfig, seed: int) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(mcfg)


def _saved_config(run: RunDir) -> dict:
    """A run's config.json, refused if its model could not fit this machine even to sample from."""
    saved = run.config()
    mcfg = ModelConfig(**saved["model_resolved"])
    check_fits(mcfg, 1, mcfg.max_seq_len, torch.device("cpu"), training=False,
               what=f"the model {run.config_file} describes")
    return saved


def load_run(run: str | Path) -> tuple[Decoder, D.Tokenizer]:
    """A finished (or stopped) run's model, in eval mode, and its tokenizer, its files checked."""
    run = RunDir(run)
    saved = _saved_config(run)
    tok = D.load_tokenizer(run.tokenizer_file)
    state = run.load_checkpoint()
    _check_agrees(run, state, {"train": {}, "model_resolved": saved["model_resolved"]})
    model = Decoder(ModelConfig(**saved["model_resolved"]))
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise ValueError(
            f"{run.checkpoint_file} does not fit the model config.json describes: {err}"
        ) from err
    return model.eval(), tok


def initial_model(run: str | Path) -> Decoder:
    """The run's model as it was before its first step: the same config and seed, untrained."""
    saved = _saved_config(RunDir(run))
    with torch.random.fork_rng(devices=[]):  # leaves the caller's random state alone
        return _initialized(ModelConfig(**saved["model_resolved"]), saved["train"]["seed"]).eval()


def sample(run: str | Path, prompt: str, tokens: int = 200, temperature: float = 0.8, top_k: int | None = 50,
           seed: int = 0) -> str:
    """The prompt and ``tokens`` sampled tokens after it. Past the model's context (max_seq_len)
    it goes on from the last half of what it has written, positions from 0 again, as a training
    window starts anywhere in the text."""
    model, tok = load_run(run)
    ids = tok.encode(prompt) or [0]
    window = model.cfg.max_seq_len
    if len(ids) >= window:
        raise ValueError(f"prompt is {len(ids)} tokens, the model takes at most {window - 1} before what it "
                         "writes")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    generator = torch.Generator().manual_seed(seed)
    out = torch.tensor([ids])
    while tokens > 0:
        context = out if out.shape[1] < window else out[:, -max(1, window // 2):]
        n = min(tokens, window - context.shape[1])
        written = model.generate(context, n, temperature=temperature, top_k=top_k, generator=generator)
        out, tokens = torch.cat([out, written[:, context.shape[1]:]], 1), tokens - n
    return tok.decode(out[0].tolist())
