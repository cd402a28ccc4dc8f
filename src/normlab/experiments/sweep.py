"""``normlab compare --jobs N``: train a plan's runs N at a time on this machine, each in its own
`normlab train` process, with the CPU threads split evenly and, on a machine with several GPUs,
one GPU per job. Across machines, hand the `--plan` command lines to Slurm or GNU parallel instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from normlab.experiments.lab import Pending


def cpus() -> int:
    """The CPUs this process may run on (a Slurm or taskset allocation, not the whole machine)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def job_env(slot: int, jobs: int, gpus: int) -> dict:
    """The environment of the job in ``slot``: its share of the threads, and its GPU when there are some."""
    env = dict(os.environ)
    threads = str(max(1, cpus() // jobs))
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(slot % gpus)
    return env


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (also by SIGKILL), so that no
    orphan trains on beside a rerun (Linux). SIGTERM: a training loop checkpoints on it, and a
    child started in the background, where SIGINT is ignored, still gets it."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def execute(pending: list[Pending], jobs: int, logs: Path, console=None,
            quiet: bool = False) -> list[tuple[Pending, Path]]:
    """Train the pending runs, ``jobs`` at a time; each writes its output to ``logs/<run>.log``.
    Returns the runs whose process failed, with their logs. Ctrl-C stops every job (each saves a
    checkpoint: the next command resumes it) and is raised again."""
    if jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    import torch
    from rich.progress import Progress

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    logs.mkdir(parents=True, exist_ok=True)
    queue, running, failed = list(pending), {}, []  # running: slot -> (process, run, log file)
    with Progress(console=console, disable=quiet or console is None, transient=True) as bar:
        task = bar.add_task(f"training {len(pending)} runs, {jobs} at a time", total=len(pending))
        try:
            while queue or running:
                for slot in range(jobs):
                    if slot not in running and queue:
                        run = queue.pop(0)
                        # (closed when the job ends)
                        log = open(logs / f"{run.folder.name}.log", "w")  # noqa: SIM115
                        proc = subprocess.Popen([sys.executable, "-m", "normlab", *run.argv[1:]],
                                                env=job_env(slot, jobs, gpus),
                                                stdout=log, stderr=subprocess.STDOUT,
                                                preexec_fn=_die_with_parent)
                        running[slot] = proc, run, log
                for slot, (proc, run, log) in list(running.items()):
                    if proc.poll() is not None:
                        log.close()
                        if proc.returncode != 0:
                            failed.append((run, Path(log.name)))
                        del running[slot]
                        bar.advance(task)
                time.sleep(0.2)
        except KeyboardInterrupt:
            for proc, _, _ in running.values():  # a terminal's Ctrl-C reached them too; a kill did not
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for proc, _, log in running.values():
                proc.wait()
                log.close()
            raise
    return failed
