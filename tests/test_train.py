"""The training loop on a tiny corpus made here: loss falls, exact resume, divergence, SIGINT,
two-process DDP (gloo) against one process, config resolution and checkpoint errors."""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from normlab import data as D
from normlab import footprint as FP
from normlab import train as T
from normlab.runs import load_checkpoint
from normlab.cli import main

pytestmark = pytest.mark.slow(minutes=1.5)  # minutes cold on 2 cores (conftest.py)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "cache"))


def tiny(corpus, out, **kw):
    fields = dict(data=str(corpus), preset="tiny", steps=30, batch_size=8, seq_len=32, lr=3e-3, warmup=3,
                  eval_every=10, eval_batches=2, ckpt_every=10, quiet=True, out=str(out))
    fields.update(kw)
    tcfg, model = T.resolve(None, {k: v for k, v in fields.items()})
    return tcfg, model


def losses(run):
    return [r["loss"] for r in map(json.loads, Path(run, "metrics.jsonl").read_text().splitlines())
            if "loss" in r and "diverged" not in r]


def test_loss_falls_and_the_run_directory_is_complete(corpus, tmp_path):
    tcfg, m = tiny(corpus, tmp_path / "run", diag_every=10)
    summary = T.train(tcfg, m)
    assert summary["status"] == "completed" and summary["step"] == 30
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r]
    assert {"step", "loss", "lr", "grad_norm", "step_ms", "tokens_per_s"} <= set(steps[0])
    assert [r["val_loss"] for r in lines if "val_loss" in r] and len(steps) == 30
    assert len(steps[0]["layer_grad_norms"]) == 2 and len(steps[0]["activation_rms"]) == 2
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    saved = json.loads((run / "config.json").read_text())
    assert saved["train"]["steps"] == 30 and saved["model_resolved"]["d_model"] == 32
    assert (run / "tokenizer.json").exists() and json.loads((run / "summary.json").read_text())["versions"][
        "torch"
    ] == torch.__version__
    # what its times depend on, so that a report can tell runs timed under different conditions apart
    clock = json.loads((run / "summary.json").read_text())["clock"]
    assert clock["threads"] == torch.get_num_threads() and clock["processor"] and "loaded" not in clock
    text = T.sample(run, "the ", tokens=20)
    assert text.startswith("the ") and len(text) == 24
    # past the model's context it goes on from the last half window: every token asked for, and
    # the first window's tokens those of a call that asks for no more than fit
    window = T.load_run(run)[0].cfg.max_seq_len
    long = T.sample(run, "the ", tokens=2 * window + 5)
    assert len(long) == 4 + 2 * window + 5 and long.startswith(T.sample(run, "the ", tokens=window - 4))


def test_resume_continues_exactly(corpus, tmp_path):
    tcfg, m = tiny(corpus, tmp_path / "straight")
    T.train(tcfg, m)
    tcfg, m = tiny(corpus, tmp_path / "split", stop_at=13)
    assert T.train(tcfg, m)["status"] == "stopped"
    tcfg, m = tiny(corpus, tmp_path / "split")
    summary = T.train(tcfg, m, resume=True)
    assert summary["status"] == "completed" and summary["step"] == 30
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")  # fp32 on CPU: bitwise
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    # the loss at init survives the resume
    assert summary["init_val_loss"] == straight["init_val_loss"] is not None


def test_initial_model_is_the_run_before_its_first_step(corpus, tmp_path):
    tcfg, m = tiny(corpus, tmp_path / "run", steps=5)
    summary = T.train(tcfg, m)
    dataset = D.prepare(tcfg.data, tcfg.tokenizer, tcfg.bpe_vocab, tcfg.val_fraction)
    batches = T._fixed_batches(dataset.val, tcfg, tcfg.seq_len, dataset.tokenizer)
    state = torch.random.get_rng_state()
    start = T.initial_model(tmp_path / "run")
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is left alone
    # fp32 on CPU: bitwise
    assert T.evaluate(start, batches, "cpu", contextlib.nullcontext()) == summary["init_val_loss"]
    trained = T.load_run(tmp_path / "run")[0]
    assert not torch.equal(trained.state_dict()["embed.weight"], start.state_dict()["embed.weight"])
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        T.initial_model(tmp_path)


def test_a_huge_learning_rate_ends_as_diverged_with_a_usable_checkpoint(corpus, tmp_path):
    tcfg, m = tiny(corpus, tmp_path / "run", lr=50.0, warmup=0, grad_clip=0, steps=40)
    summary = T.train(tcfg, m)
    assert summary["status"] == "diverged" and summary["step"] < 40
    model, tok = T.load_run(tmp_path / "run")
    assert model.num_parameters() > 0 and tok.vocab_size > 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "diverged"


def test_sigint_leaves_a_loadable_checkpoint_and_complete_metrics(corpus, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "NORMLAB_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "normlab", "train", f"data={corpus}", "preset=tiny", "steps=100000",
           "batch_size=8",
           "seq_len=32", "ckpt_every=0", "eval_every=0", f"out={run}", "--quiet"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line complete
    state = load_checkpoint(run / "checkpoint.pt")
    assert state["step"] == summary["step"] == len([r for r in lines if "step_ms" in r])


def paragraph_corpus(folder: Path) -> Path:
    """Paragraphs of 3 to ~45 characters between blank lines, shorter than the window: padded
    batches whose micro-batches hold different numbers of real tokens."""
    rng = random.Random(1)
    words = "the king queen love death night day sword crown heart".split()
    paragraphs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 6))) for _ in range(3000)]
    folder.mkdir()
    for i in range(3):
        (folder / f"play{i}.txt").write_text("\n\n".join(paragraphs[i::3]))
    return folder


@pytest.mark.parametrize("batching", ["windows", "paragraphs"])
def test_two_processes_match_one(corpus, tmp_path, batching):
    # paragraphs: each rank's loss is the mean over its own real tokens, weighted by its share
    env = {**os.environ, "NORMLAB_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    data = corpus if batching == "windows" else paragraph_corpus(tmp_path / "texts")
    args = [f"data={data}", "preset=tiny", "steps=8", "batch_size=8", "seq_len=32", "eval_every=0",
            f"batching={batching}",
            "norm=layernorm", "--quiet"]
    one = subprocess.run([sys.executable, "-m", "normlab", "train", *args, f"out={tmp_path / 'one'}"],
                         env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          "--master_port=29517",
                          "-m", "normlab", "train", *args, f"out={tmp_path / 'two'}"], env=env,
                         capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 8
    assert all(abs(x - y) < 1e-4 * abs(x) for x, y in zip(a, b)), (a, b)


def test_config_resolution_and_unknown_keys(tmp_path):
    cfg_file = tmp_path / "c.json"
    cfg_file.write_text(json.dumps({"train": {"steps": 7, "lr": 0.01}, "model": {"norm": "layernorm"}}))
    tcfg, model = T.resolve(str(cfg_file), {"lr": "0.02", "placement": "post", "final_norm": "true"})
    assert tcfg.steps == 7 and tcfg.lr == 0.02  # the override wins over the file
    assert model == {"norm": "layernorm", "placement": "post", "final_norm": True}
    with pytest.raises(ValueError, match="unknown key 'learning_rate'"):
        T.resolve(None, {"learning_rate": "1"})
    with pytest.raises(ValueError, match="lr expects a number, got 'fast'"):
        T.resolve(None, {"lr": "fast"})
    with pytest.raises(ValueError, match="batch_size expects a whole number, got '1.5'"):
        T.resolve(None, {"batch_size": "1.5"})
    with pytest.raises(ValueError, match="final_norm expects true or false, got 'maybe'"):
        T.resolve(None, {"final_norm": "maybe"})
    with pytest.raises(ValueError, match="schedule must be one of cosine, constant"):
        T.resolve(None, {"schedule": "linear"})


def test_corrupt_checkpoint_gives_a_clear_error(tmp_path):
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(b"not a checkpoint")
    with (
        pytest.raises(ValueError, match="is corrupt or not a normlab checkpoint"),
        pytest.warns(UserWarning, match="no recorded digest"),
    ):
        load_checkpoint(bad)


def test_cli_refuses_to_overwrite_a_run_and_reports_data_errors(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", f"data={corpus}", "preset=tiny", "steps=2", "batch_size=4", "seq_len=16",
                 "eval_batches=1", f"out={out}", "--quiet"]) == 0
    assert main(["train", f"data={corpus}", "preset=tiny", "steps=2", f"out={out}", "--quiet"]) == 2
    assert "already holds a run" in capsys.readouterr().out
    assert main(["train", f"data={tmp_path / 'nothing'}", "--quiet", f"out={tmp_path / 'r2'}"]) == 2
    assert "neither a corpus" in capsys.readouterr().out
    # a prompt character the training text never had is said, not silently read as "unknown"
    seen = D.load_tokenizer(out / "tokenizer.json").chars
    odd = next(c for c in "\u20ac\u00e9\u4e2d\u2603" if c not in seen)
    assert main(["sample", "--run", str(out), "--prompt", f"{seen[-1]}{odd}", "--tokens", "3"]) == 0
    said = capsys.readouterr()
    assert f"training text has no {odd!r}" in said.err and len(said.out.rstrip("\n")) == 5
    assert main(["sample", "--run", str(out), "--prompt", seen[-1], "--tokens", "3"]) == 0
    assert "training text has no" not in capsys.readouterr().err


def test_the_cli_says_when_warmup_outlasts_the_run(corpus, tmp_path, capsys):
    # steps=2 under the default warmup of 100: the rate never reaches lr and never decays
    base = ["train", f"data={corpus}", "preset=tiny", "steps=2", "batch_size=4", "seq_len=16",
            "eval_batches=1", "--quiet"]
    assert main(base + [f"out={tmp_path / 'a'}"]) == 0
    last = T.lr_at(1, T.TrainConfig(steps=2, warmup=100, lr=1e-3))  # the schedule's own last rate
    assert last == pytest.approx(1e-3 * 2 / 100)  # a fiftieth of lr: the ramp's second step of 100
    err = capsys.readouterr().err
    assert "warmup=100 >= steps=2" in err and f"ends at {last:g} (lr=0.001)" in err
    assert main(base + ["warmup=1", f"out={tmp_path / 'b'}"]) == 0
    assert "warmup=" not in capsys.readouterr().err


def test_bf16_autocast_and_gradient_accumulation_train(corpus, tmp_path):
    tcfg, m = tiny(corpus, tmp_path / "bf16", dtype="bf16", grad_accum=2, steps=20, eval_every=0,
                   ckpt_every=0)
    summary = T.train(tcfg, m)
    assert summary["status"] == "completed"
    ls = losses(tmp_path / "bf16")
    assert len(ls) == 20 and ls[-1] < ls[0] - 0.3
    step = next(r for r in map(json.loads, (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines())
                if "step_ms" in r)
    assert step["tokens_per_s"] > 0 and step["lr"] == pytest.approx(3e-3 / 3)  # warmup: step 1 of 3


def test_resuming_with_an_incompatible_checkpoint_says_so(corpus, tmp_path):
    tcfg, m = tiny(corpus, tmp_path / "run", steps=3, eval_every=0)
    T.train(tcfg, m)
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    cfg["model"]["d_model"] = 64  # the saved weights are for d_model 32
    (tmp_path / "run" / "config.json").write_text(json.dumps(cfg))
    tcfg, _ = tiny(corpus, tmp_path / "run", steps=3)
    with pytest.raises(ValueError,
                       match="config.json does not describe the run its checkpoint holds .d_model: 32"):
        T.train(tcfg, None, resume=True)


def test_step_times_do_not_include_compilation(corpus, tmp_path):
    """A cold numba cache (every kernel compiles in this process) and a warm one give the same
    step times: the run compiles and calls its kernels before the clock starts."""
    env = {**os.environ, "NORMLAB_CACHE": str(tmp_path / "cache"), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}

    def step_ms(name):
        cmd = [sys.executable, "-m", "normlab", "train", f"data={corpus}", "preset=tiny", "norm=layernorm",
               "steps=20",
               "batch_size=8", "seq_len=32", "ckpt_every=0", "eval_every=10", f"out={tmp_path / name}",
               "--quiet"]
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
        return [json.loads(line)["step_ms"] for line in open(tmp_path / name / "metrics.jsonl")
                if "step_ms" in line]

    cold, warm = step_ms("cold"), step_ms("warm")
    assert len(cold) == len(warm) == 20, (cold, warm)  # a time for every step
    assert any((tmp_path / "numba").rglob("*.nbi")), "the first run should have filled the cold cache"
    # Compiling the layer_norm kernels takes about 3 s, all in the first step that calls them; a
    # step takes some 40 ms. So a compilation on the clock is one step seconds above every other,
    # whereas a busy machine slows many steps alike (the test must not read that as compiling).
    for ms in (cold, warm):
        slowest, next_slowest = sorted(ms[:20])[-2:][::-1]
        assert slowest - next_slowest <= 1000, ms


def test_a_killed_run_resumes_with_every_step_logged_once(corpus, tmp_path):
    """SIGKILL at a random step after a checkpoint: the steps logged since that checkpoint run
    again on resume, and metrics.jsonl must hold each step once, with the losses of a run that
    was never interrupted."""
    env = {**os.environ, "NORMLAB_CACHE": str(tmp_path / "cache")}
    args = [f"data={corpus}", "preset=tiny", "steps=40", "batch_size=8", "seq_len=32", "ckpt_every=5",
            "eval_every=5",
            "warmup=3", "lr=3e-3", "--quiet"]
    subprocess.run([sys.executable, "-m", "normlab", "train", *args, f"out={tmp_path / 'straight'}"], env=env,
                   check=True,
                   capture_output=True, timeout=600)
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "normlab", "train", *args, f"out={run}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after = 7 + int.from_bytes(os.urandom(1), "little") % 25  # steps logged before the kill
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        text = (run / "metrics.jsonl").read_text() if (run / "metrics.jsonl").exists() else ""
        if text.count("step_ms") >= kill_after:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert load_checkpoint(run / "checkpoint.pt")["step"] % 5 == 0
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "step_ms" in r]
    assert steps == list(range(40)), (kill_after, steps)
    assert [r["step"] for r in records if "val_loss" in r] == [0, 5, 10, 15, 20, 25, 30, 35, 40]
    assert losses(run) == losses(tmp_path / "straight")


@pytest.mark.parametrize("key, value, message", [
    ("min_lr", "-1e-4", "min_lr must be a number >= 0"),
    ("eval_every", "-1", "eval_every must be an int >= 0"),
    ("diverge_factor", "1.0", "diverge_factor must be a number > 1"),
    ("seq_len", "0", "seq_len must be a positive int"),
    ("grad_clip", "nan", "grad_clip must be a number >= 0"),
    ("train_tokens", "-5", "train_tokens must be an int >= 0"),
    ("min_lr", "0.01", r"min_lr must be a number >= 0 and at most lr \(0.001\)"),  # the cosine would climb
    ("weight_decay", "-0.1", "weight_decay must be a number >= 0"),
    ("beta1", "1.5", r"beta1 must be in \[0, 1\)"),
    ("beta2", "1", r"beta2 must be in \[0, 1\)"),
])
def test_training_fields_are_checked(key, value, message):
    with pytest.raises(ValueError, match=message):
        T.resolve(None, {key: value})


def test_train_tokens_draws_every_window_from_the_first_tokens(corpus, tmp_path, monkeypatch):
    dataset = D.prepare(str(corpus), "char")
    assert T.train_split(dataset, 0) is dataset.train
    small = T.train_split(dataset, 300)
    assert len(small) == 300 and (small == dataset.train[:300]).all()
    text = "".join(map(chr, small + 1000))  # windows found in the first 300 tokens, as text
    gen = D.Batches(small, 8, 32, seed=0)
    for _ in range(20):
        for row in gen.next()[0].tolist():
            assert "".join(chr(t + 1000) for t in row) in text
    with pytest.raises(ValueError, match="train_tokens must be at most the training split's "
                                         f"{len(dataset.train):,} tokens"):
        T.train_split(dataset, len(dataset.train) + 1)
    seen = []  # a run hands the batches the first train_tokens tokens, and records the field
    real = T.make_batches
    monkeypatch.setattr(T, "make_batches", lambda tokens, *a, **k: seen.append(tokens)
                        or real(tokens, *a, **k))
    tcfg, m = tiny(corpus, tmp_path / "run", steps=3, train_tokens=300)
    assert T.train(tcfg, m)["status"] == "completed"
    # (then validation's)
    assert [len(t) for t in seen] == [300, len(dataset.val)] and (seen[0] == dataset.train[:300]).all()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["train_tokens"] == 300


def test_train_refuses_a_folder_that_holds_a_run_unless_told_to_overwrite(corpus, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a run that died before its first checkpoint
    (out / "metrics.jsonl").write_text('{"step": 0, "loss": 4.0}\n')
    tcfg, m = tiny(corpus, out, steps=3)
    with pytest.raises(ValueError,
                       match=r"already holds a run \(config.json, metrics.jsonl\).*overwrite=true"):
        T.train(tcfg, m)
    assert (out / "metrics.jsonl").read_text() == '{"step": 0, "loss": 4.0}\n'  # untouched
    tcfg, m = tiny(corpus, out, steps=3, overwrite=True)
    assert T.train(tcfg, m)["status"] == "completed"
    assert len([line for line in (out / "metrics.jsonl").read_text().splitlines() if "step_ms" in line]) == 3


def test_a_full_disk_names_the_path_and_keeps_the_last_good_checkpoint(corpus, tmp_path, monkeypatch, capsys):
    import errno

    real_save, calls = torch.save, []

    def save(obj, f, *a, **k):  # the second checkpoint meets a full disk halfway through
        calls.append(f)
        if len(calls) == 2:
            Path(f).write_bytes(b"half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "run"
    code = main(["train", f"data={corpus}", "preset=tiny", "steps=12", "batch_size=4", "seq_len=16",
                 "eval_batches=1",
                 "ckpt_every=5", f"out={out}", "--quiet"])
    text = capsys.readouterr().out
    assert (
        code == 1
        and f"could not write {out / 'checkpoint.pt'}" in " ".join(text.split())
        and "No space left" in text
    )
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 5  # the last good one
    assert not list(out.glob("*.tmp"))  # no debris


def test_resume_takes_more_steps_refuses_other_changes_and_keeps_the_summary(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    base = [f"data={corpus}", "preset=tiny", "steps=6", "batch_size=4", "seq_len=16", "eval_batches=1",
            "eval_every=3"]
    assert main(["train", *base, f"out={out}", "--quiet"]) == 0
    done = json.loads((out / "summary.json").read_text())
    assert main(["train", "--resume", str(out), "steps=6", "--quiet"]) == 0  # nothing left to do
    again = json.loads((out / "summary.json").read_text())
    assert again["loss"] == done["loss"] and again["val_loss"] == done["val_loss"]  # nothing lost
    assert main(["train", "--resume", str(out), "lr=1.0", "--quiet"]) == 2
    assert "can change only steps" in capsys.readouterr().out
    assert main(["train", "--resume", str(out), "steps=9", "--quiet"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "step_ms" in line]
    assert steps == list(range(9)) and json.loads((out / "summary.json").read_text())["step"] == 9
    # a later --resume continues to 9
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 9


def test_sigint_to_one_ddp_rank_stops_both_at_the_same_step(corpus, tmp_path):
    """Only rank 1 gets SIGINT: the ranks agree to stop (no deadlock in the checkpoint barrier)
    and leave one checkpoint at the step the summary names."""
    env = {**os.environ, "NORMLAB_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    run = tmp_path / "ddp"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                             "--master_port=29523",
                             "-m", "normlab", "train", f"data={corpus}", "preset=tiny", "steps=100000",
                             "batch_size=8",
                             "seq_len=32", "eval_every=0", "ckpt_every=0", f"out={run}", "--quiet"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, deadline = run / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and (not metrics.exists() or metrics.read_text().count("step_ms") < 5):
        time.sleep(0.2)
    workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                              text=True).stdout.split()]
    rank1 = next(p for p in workers
                 if b"RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes().replace(b"LOCAL_RANK", b"X"))
    os.kill(rank1, signal.SIGINT)
    try:
        proc.wait(timeout=120)  # a deadlocked barrier would hang here
    finally:
        for pid in [proc.pid, *workers]:  # nothing left behind if it did
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert load_checkpoint(run / "checkpoint.pt")["step"] == summary["step"]


@pytest.mark.parametrize("field", ["n_layers=1000000", "d_model=1048576", "batch_size=1000000000",
                                   "max_seq_len=100000000",
                                   "eval_batches=1000000000"])
def test_a_config_that_cannot_fit_is_refused_before_anything_is_built(corpus, tmp_path, field, monkeypatch):
    # these ran until killed or died in the allocator with a raw traceback
    name, value = field.split("=")
    built = []
    monkeypatch.setattr(T, "_initialized", lambda *a: built.append(a) or pytest.fail("the model was built"))
    tcfg, m = tiny(corpus, tmp_path / "run", **{name: int(value)},
                   **({"seq_len": None} if name == "max_seq_len" else {}))
    with pytest.raises(MemoryError,
                       match=r"needs at least [\d,.]+ GiB .* more than the [\d,.]+ GiB this machine has"):
        T.train(tcfg, m)
    assert not built and not (tmp_path / "run" / "checkpoint.pt").exists()


def test_sample_refuses_a_run_whose_config_was_edited_past_the_machine(corpus, tmp_path):
    tcfg, m = tiny(corpus, tmp_path / "run", steps=3)
    T.train(tcfg, m)
    config = tmp_path / "run" / "config.json"
    saved = json.loads(config.read_text())
    saved["model_resolved"]["n_layers"] = 10**6
    config.write_text(json.dumps(saved))
    with pytest.raises(MemoryError, match=r"the model .*config.json describes needs at least"):
        T.sample(tmp_path / "run", "the ", tokens=5)


def test_the_cli_refuses_a_model_too_large_in_one_line(corpus, tmp_path, capsys):
    code = main(["train", f"data={corpus}", "preset=tiny", "n_layers=1000000", "quiet=true",
                 f"out={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert code == 2 and "error:" in out and "GiB" in out and "Traceback" not in out


def test_slowdown_compares_the_last_window_with_the_fastest():
    assert FP.slowdown([1.0] * 19) is None  # not two windows yet
    # a slow start (warm-up) is not contention
    assert FP.slowdown([5.0] * 10 + [1.0] * 10 + [1.0] * 10) == 1.0
    assert FP.slowdown([1.0] * 10 + [2.0] * 5 + [7.0] * 5 + [6.0] * 10) == 6.0


def test_train_warns_once_when_steps_slow_down_under_load(corpus, tmp_path, monkeypatch, capsys):
    # on a loaded CPU a run fell 100x with torch's default threads and kept its speed with one:
    # the run says so while it trains, once
    from normlab.model import Decoder

    real, calls = Decoder.forward, []

    def loaded(self, *args, **kwargs):  # from the 25th call on, as if another process took the cores
        calls.append(1)
        if len(calls) > 25:
            time.sleep(0.6)  # far above a step on a loaded 2-core machine (about 0.1 s)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Decoder, "forward", loaded)
    monkeypatch.setattr(FP, "_told_contended", False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # real steps stay fast even when this machine is loaded
    try:
        tcfg, m = tiny(corpus, tmp_path / "run", steps=30, eval_every=0, ckpt_every=0)
        with monkeypatch.context() as mp:  # the warning is for several threads: as if torch ran two
            mp.setattr(FP, "_torch_threads", lambda: 2)
            T.train(tcfg, m)
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    steps = [
        r["step_ms"]
        for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "step_ms" in r
    ]
    assert re.search(r"normlab: warning: training steps now take \d+x as long as this run's "
                     r"fastest.*OMP_NUM_THREADS=1", err), (err, steps, len(calls))
    assert err.count("as long as this run's fastest") == 1


@pytest.mark.parametrize("field, value", [("lr", -1.0), ("warmup", -3)])
def test_a_bad_lr_or_warmup_is_named_alone(corpus, tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got {value}$"):
        tiny(corpus, tmp_path / "run", **{field: value})[0].validate()


def test_accumulated_padded_batches_give_the_true_batchs_step(tmp_path):
    # a padded micro-batch's loss is the mean over its own real tokens: weighted by its share of
    # the step's tokens, 4 micro-batches of 2 paragraphs give the batch of 8's loss and gradient
    # (LayerNorm, no dropout: up to summation order); equal weights would count the tokens of
    # short batches more
    texts = paragraph_corpus(tmp_path / "texts")
    first = {}
    for name, bs, accum in (("true", 8, 1), ("accum", 2, 4)):
        tcfg, m = tiny(texts, tmp_path / name, batching="paragraphs", batch_size=bs, grad_accum=accum,
                       steps=1,
                       eval_every=0, norm="layernorm")
        T.train(tcfg, m)
        first[name] = next(
            r
            for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
            if "loss" in r
        )
    for key in ("loss", "grad_norm"):
        assert first["accum"][key] == pytest.approx(first["true"][key], rel=1e-5), key
