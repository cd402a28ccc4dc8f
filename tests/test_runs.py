"""The run folder refuses what it cannot trust: a damaged checkpoint, files that disagree with it,
and repairs what a kill leaves behind (a checkpoint without its summary)."""

import json
import random
import signal
import shutil
import warnings

import pytest
import torch

from normlab import runs as RN
from normlab import train as T
from normlab.cli import main


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    """A finished tiny run (checkpoints at 5 and 10), copied by each test that changes it."""
    out = tmp_path_factory.mktemp("runs") / "run"
    tcfg, m = T.resolve(None,
                        dict(data=str(corpus), preset="tiny", steps=10, batch_size=4, seq_len=16, warmup=2,
                             eval_every=5, eval_batches=1, ckpt_every=5, quiet=True, out=str(out)))
    T.train(tcfg, m)
    return out


@pytest.fixture
def run(finished, tmp_path):
    return shutil.copytree(finished, tmp_path / "run")


def _resume(run, *more):
    return main(["train", "--resume", str(run), "--quiet", *more])


@pytest.mark.parametrize("where", [0.3, 0.5, 0.8])
def test_a_damaged_checkpoint_is_refused_on_resume_and_sample(run, capsys, where):
    path = run / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    at = int(len(data) * where)
    data[at:at + 64] = random.Random(at).randbytes(64)
    path.write_bytes(bytes(data))
    assert _resume(run, "steps=12") != 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"checkpoint {path} does not match the digest" in said and "overwrite=true" in said
    with pytest.raises(ValueError, match="does not match the digest"):
        T.sample(run, "the", tokens=3)


def test_a_crash_between_the_renames_leaves_a_checkpoint_that_loads(tmp_path):
    """The digest file is written first and keeps the previous digest, so the old checkpoint
    still loads if the process dies before the new one is renamed into place."""
    path = tmp_path / "checkpoint.pt"
    RN.save_checkpoint(path, {"step": 1})
    old = path.read_bytes()
    RN.save_checkpoint(path, {"step": 2})
    assert RN.load_checkpoint(path)["step"] == 2
    path.write_bytes(old)  # as if the rename of step 2 never happened
    assert RN.load_checkpoint(path)["step"] == 1
    RN.digest_path(path).unlink()
    with pytest.warns(UserWarning, match="no recorded digest"):
        assert RN.load_checkpoint(path)["step"] == 1


def test_a_run_killed_before_its_summary_resumes_to_its_real_figures(run):
    done = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()  # killed after the last checkpoint, before the summary
    assert _resume(run) == 0
    again = json.loads((run / "summary.json").read_text())
    assert again["status"] == "completed" and again["step"] == 10
    assert again["loss"] == done["loss"] and again["val_loss"] == done["val_loss"]
    assert again["tokens_per_s"] > 0 and "rebuilt" in again


def _edit(path, change):
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


def test_an_edited_learning_rate_in_config_json_is_refused(run, capsys):
    _edit(run / "config.json", lambda c: c["train"].update(lr=0.5))
    assert _resume(run, "steps=12") != 0
    said = " ".join(capsys.readouterr().out.split())
    assert "config.json does not describe the run" in said
    assert "lr: 0.001 in checkpoint.pt, 0.5 in config.json" in said


def test_an_edited_model_or_tokenizer_is_refused_by_sample(run):
    saved = (run / "config.json").read_text()
    _edit(run / "config.json", lambda c: c["model_resolved"].update(n_layers=3))
    with pytest.raises(ValueError, match="n_layers: 2 in checkpoint.pt, 3 in config.json"):
        T.sample(run, "the", tokens=3)
    (run / "config.json").write_text(saved)
    tok = json.loads((run / "tokenizer.json").read_text())
    chars = tok["chars"] if "chars" in tok else None
    assert chars, tok.keys()
    tok["chars"] = chars[::-1]
    (run / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError,
                       match="tokenizer.json is not the tokenizer checkpoint.pt was trained with"):
        T.sample(run, "the", tokens=3)


def test_a_checkpoint_step_the_metrics_do_not_hold_is_refused(run, capsys):
    state = RN.load_checkpoint(run / "checkpoint.pt")
    state["step"] = 999
    torch.save(state, run / "checkpoint.pt")
    assert _resume(run, "steps=1000") != 0  # edited without its digest
    assert "does not match the digest" in capsys.readouterr().out
    RN.save_checkpoint(run / "checkpoint.pt", state)  # and with it: the metrics still disagree
    assert _resume(run, "steps=1000") != 0
    said = " ".join(capsys.readouterr().out.split())
    assert "is at step 999 but" in said and "records training up to step 10" in said


def test_bad_json_and_metrics_lines_name_their_file(run, tmp_path):
    (run / "config.json").write_text('{"train": {')
    with pytest.raises(ValueError, match=f"{run / 'config.json'} is not valid JSON"):
        T.sample(run, "the")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[3] = "{}"
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl line 4 is not a metrics record"):
        RN.read_metrics(run / "metrics.jsonl")
    (tmp_path / "m.jsonl").write_text('{"step": 0, "step_ms": 1}\n{"st')
    # a line cut short by a crash
    assert RN.truncate_metrics(tmp_path / "m.jsonl", 3) == [{"step": 0, "step_ms": 1}]


def test_a_failed_write_names_its_path_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("old")

    def fail(tmp):
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match=f"could not write {target}"):
        RN.write_atomic(target, fail)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RN.write_json(target, {"loss": float("nan")})
    assert json.loads(target.read_text()) == {"loss": None}


def test_a_full_disk_while_logging_names_metrics_jsonl(corpus, tmp_path, monkeypatch, capsys):
    import builtins
    import errno

    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, text):
            self.n += 1
            if self.n == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fake_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return Full(f) if str(path).endswith("metrics.jsonl") and mode == "a" else f

    monkeypatch.setattr(builtins, "open", fake_open)
    out = tmp_path / "run"
    code = main(["train", f"data={corpus}", "preset=tiny", "steps=6", "batch_size=4", "seq_len=16",
                 "eval_batches=1",
                 f"out={out}", "--quiet"])
    said = " ".join(capsys.readouterr().out.split())
    assert code == 1 and f"could not write {out / 'metrics.jsonl'}" in said and "No space left" in said


def test_a_second_writer_on_one_run_folder_is_refused_and_nothing_doubles(corpus, tmp_path):
    import os
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "normlab", "train", f"data={corpus}", "preset=tiny", "steps=100000",
            "batch_size=4",
            "seq_len=16", "eval_every=0", "ckpt_every=50", f"out={out}", "overwrite=true", "--quiet"]
    first = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # training, so its SIGINT handler is in place (a cold numba cache compiles first)
    deadline = time.time() + 300
    while time.time() < deadline and "step_ms" not in ((out / "metrics.jsonl").read_text()
                                                       if (out / "metrics.jsonl").exists() else ""):
        time.sleep(0.1)
    second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    said = " ".join(second.stdout.split())
    assert second.returncode == 1 and f"in use by process {first.pid} (normlab train)" in said, said
    first.send_signal(signal.SIGINT)  # stops with a checkpoint after its current step
    assert first.wait(timeout=300) == 130, first.stderr.read()
    steps = [r["step"] for r in RN.read_metrics(out / "metrics.jsonl") if "step_ms" in r]
    assert steps == list(range(len(steps))) and json.loads((out / "summary.json").read_text())["step"] == len(
        steps
    )


def test_two_compares_into_one_folder_keep_both_presets(corpus, tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "compare"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "normlab", "compare", name, "--size", "tiny", "--data",
                               str(corpus),
                               "--out", str(out), "--quiet"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for name in ("eps", "invariance")]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stdout.read()[-2000:]
    assert set(json.loads((out / "results.json").read_text())["presets"]) == {"eps", "invariance"}


def test_a_bad_results_file_is_named_by_report(tmp_path, capsys):
    (tmp_path / "results.json").write_text('{"presets": {"norms": ')
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path / 'results.json'} is not valid JSON" in " ".join(capsys.readouterr().out.split())
    (tmp_path / "results.json").write_text('{"presets": {"nonsense": {}}}')
    assert main(["report", str(tmp_path)]) == 2
    assert "is not a results file of this normlab (presets nonsense)" in " ".join(
        capsys.readouterr().out.split()
    )


def test_jobs_die_with_a_killed_parent(corpus, tmp_path):
    import os
    import subprocess
    import sys
    import time

    out = tmp_path / "compare"
    parent = subprocess.Popen([sys.executable, "-m", "normlab", "compare", "norms", "--size", "tiny",
                               "--steps", "100000",
                               "--data", str(corpus), "--out", str(out), "--jobs", "2", "--quiet"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def children() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"train" in cmd and any(str(out).encode() in c for c in cmd) and int(pid) != parent.pid:
                found.append(int(pid))
        return found

    def training() -> int:  # children past their start-up (a cold numba cache compiles for a while)
        return len(list(out.glob("runs/*/metrics.jsonl")))

    try:
        deadline = time.time() + 300
        while time.time() < deadline and (len(children()) < 2 or training() < 2):
            time.sleep(0.2)
        assert len(children()) == 2
        parent.kill()
        parent.wait()
        deadline = time.time() + 180
        while time.time() < deadline and children():
            time.sleep(0.2)
        assert children() == []
    finally:  # never leave a trainer behind to load the machine for the tests after this one
        parent.kill()
        for pid in children():
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("damage", ["cut short", "bpe garbled", "not an object"])
def test_a_damaged_tokenizer_file_is_named_with_what_to_do(run, damage):
    path = run / "tokenizer.json"
    text = path.read_text()
    path.write_text({"cut short": text[: len(text) // 2],
                     "bpe garbled": json.dumps({"kind": "bpe", "tokenizer": "{\"model\": 3}"}),
                     "not an object": "[1, 2]"}[damage])
    with pytest.raises(ValueError, match=r"tokenizer.json (cannot be read as a tokenizer|is not a normlab "
                                         r"tokenizer).*overwrite=true"):
        T.sample(run, "the", tokens=3)


_HOLD = """
import fcntl, os, sys, time
folder = sys.argv[1]
os.makedirs(folder, exist_ok=True)
fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"{os.getpid()} normlab train\\n".encode(), 0)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _hold(folder, seconds):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder), str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_run_another_process_trains_is_in_progress_not_unstarted(corpus, tmp_path, capsys):
    # a rerun beside a live trainer planned (and --jobs launched) the same run again
    from normlab import experiments
    from normlab.experiments.lab import Settings

    settings = Settings(out=str(tmp_path / "compare"), size="tiny", data=str(corpus), quiet=True)
    planned = experiments.plan_presets(["sandwich"], settings)
    assert planned
    holder = _hold(planned[0].folder, 60)
    try:
        again = experiments.plan_presets(["sandwich"], settings)
        assert [r.folder for r in again] == [r.folder for r in planned[1:]]
        said = " ".join(capsys.readouterr().err.split())
        assert "1 run(s) in progress in other processes" in said
        assert f"process {holder.pid} normlab train" in said
    finally:
        holder.kill()
        holder.wait()
    assert [r.folder for r in experiments.plan_presets(["sandwich"], settings)] == [r.folder for r in planned]


def test_compare_waits_for_a_run_in_progress_then_trains_on(corpus, tmp_path):
    from rich.console import Console

    from normlab import experiments
    from normlab.experiments.lab import Settings

    settings = Settings(out=str(tmp_path / "compare"), size="tiny", data=str(corpus), quiet=True)
    first = experiments.plan_presets(["sandwich"], settings)[0]
    holder = _hold(first.folder, 3)
    console = Console(record=True, width=200)
    try:
        results = experiments.run_presets(["sandwich"], settings, console)
    finally:
        holder.kill()
    said = console.export_text()
    assert f"is in progress in process {holder.pid} normlab train: waiting for it" in said
    assert "sandwich" in results["presets"] and (first.folder / "summary.json").exists()


def test_resuming_a_finished_run_prints_its_config_and_trains_nothing(run, capsys, monkeypatch):
    # it printed the default config ("steps 1000") and "loss nan, val nan, 0 tokens/s" after
    # rebuilding everything
    summary = json.loads((run / "summary.json").read_text())
    monkeypatch.setattr(T, "_train", lambda *a, **k: pytest.fail("a finished run was trained again"))
    assert main(["train", "--resume", str(run)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "'steps': 10" in said and "'steps': 1000" not in said
    assert f"loss {summary['loss']:.4f}" in said and "complete already: nothing trained" in said


@pytest.mark.parametrize("argv, message", [
    (["train", "--resume", "/nonexistent/run"],
     "--resume /nonexistent/run: not a run directory (no config.json)"),
    (["train", "--config", "/nonexistent.json"], "--config /nonexistent.json: no such file"),
    (["train", "norm=foo"], "norm must be one of"),
])
def test_train_errors_come_first_and_name_what_is_wrong(argv, message, capsys):
    assert main(argv) != 0
    said = " ".join(capsys.readouterr().out.split())
    assert said.startswith("error:") and message in said and "Errno" not in said, said


def test_a_run_dir_reads_back_what_it_wrote(tmp_path):
    run = RN.RunDir(tmp_path / "r")
    assert run.held() == [] and run.summary() is None
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        run.config()
    run.start({"train": {"lr": 0.1}}, lambda path: path.write_text("{}"))
    rng = random.Random(7)
    times = [rng.uniform(1, 9) for _ in range(10)]
    with run.metrics_log() as log:
        log({"step": 0, "val_loss": 4.0})
        for step, ms in enumerate(times):
            log({"step": step, "loss": 4.0 - step / 10, "step_ms": ms, "tokens_per_s": 100.0})
        log({"step": 10, "val_loss": 3.0})
    run.write_summary({"status": "completed", "step": 10, "val_loss": float("nan")})
    assert run.config() == {"train": {"lr": 0.1}} and run.summary()["val_loss"] is None  # NaN written as null
    assert run.held() == ["config.json", "metrics.jsonl", "summary.json"]
    curves = run.curves(points=5)
    assert curves["val_curve"] == {"step": [0, 10], "loss": [4.0, 3.0],
                                   "time_s": [0.0, round(sum(times) / 1e3, 3)]}
    assert curves["train_curve"]["step"] == [0, 2, 4, 6, 8]
    assert curves["step_ms"] == pytest.approx(sorted(times[2:])[3] / 2 + sorted(times[2:])[4] / 2)
    kept = run.truncate_metrics(4)  # a resume from step 4 logs steps 4.. again
    assert [r["step"] for r in kept] == [0, 0, 1, 2, 3] and len(run.metrics()) == 5
