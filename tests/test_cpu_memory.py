"""The CPU backend's memory and threads: streaming stores and prefetches into L2 give the plain
path's bits, cache sizes from sysfs, staging rows stay zero, the output buffer pool, out=,
statistics no graph keeps, environment settings, torch's thread count, and kernels in forked
DataLoader workers."""

import json
import os
import threading

import numpy as np
import pytest
import torch

from normlab import functional as F

from opcheck import DTYPES, OPS, call_op, check, op_leaves, run_op

pytestmark = pytest.mark.xdist_group("kernels")  # in-process compiles, run on one worker (conftest.py)
pytest.importorskip("numba", reason="the cpu backend needs numba (pip install normlab[cpu])")
from normlab.kernels.cpu import launch, memory, simd  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("path", ["streaming stores", "prefetch into L2", "prefetch 8 rows on"])
def test_each_memory_path_gives_the_same_bits(gen, op, dtype, path, monkeypatch):
    # Large outputs are written with non-temporal stores (16-bit ones two vectors to a line); the
    # values must be those of the plain path, bit for bit, whatever the alignment of the rows
    # (d = 1000: every row of a float32 output starts at a different offset from a 64-byte
    # boundary). Rows too wide for L1 have their successors prefetched into L2 instead, a
    # run-time branch at every prefetch, which must change no value either; each launch asks
    # with the bytes of one row over the inputs its passes read. Short rows prefetch rows further
    # on (here every row counts as short): a run-time skip, no value changed; asked by x's row.
    leaves = op_leaves(gen, op, (37, 1000), dtype)
    asked, asked_skip = [], []

    def far(row_bytes):
        asked.append(row_bytes)
        return memory.prefetch_far(row_bytes)

    def skip(row_bytes):
        asked_skip.append(row_bytes)
        return memory.prefetch_skip(row_bytes)

    monkeypatch.setattr(launch, "prefetch_far", far)
    monkeypatch.setattr(launch, "prefetch_skip", skip)
    runs = []
    for min_bytes in (1 << 62, 0):
        if path == "streaming stores":
            monkeypatch.setattr(launch, "STREAM_MIN_BYTES", min_bytes)
        elif path == "prefetch into L2":
            monkeypatch.setattr(memory, "PREFETCH_L2_MIN_BYTES", min_bytes)
        else:
            monkeypatch.setattr(memory, "SHORT_ROW_BYTES", 1 << 62)
            monkeypatch.setattr(memory, "SHORT_ROWS_AHEAD", 1 if min_bytes else 8)
            assert memory.prefetch_skip(1000 * dtype.itemsize) == (0 if min_bytes else 7)
        grads = torch.Generator().manual_seed(7)
        runs.append(run_op(op, leaves, {}, "cpu",
                           [torch.randn(leaves["x"].shape, generator=grads).to(dtype)] * 2))
    (plain, plain_g), (other, other_g) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain, other))
    assert all(torch.equal(plain_g[k], other_g[k]) for k in plain_g)
    row = 1000 * dtype.itemsize
    read = 2 * row if op.startswith("add") else row  # the forward's x (and residual); the backward's x and dy
    assert asked[:2] == [read, 2 * row], asked
    assert asked_skip[:2] == [row, row], asked_skip


def test_short_rows_prefetch_further_ahead_where_that_was_measured_to_gain(monkeypatch):
    # Rows of x of at most SHORT_ROW_BYTES (qk-norm's heads) prefetch SHORT_ROWS_AHEAD rows on,
    # wider ones the next row; the distance is 8 but on AMD's CPUs, where a Zen 4 lost up to 30%
    # with it (LLVM names them znver*), and NORMLAB_CPU_PREFETCH_ROWS sets it.
    names = ("znver3", "znver4", "znver5", "sapphirerapids", "icelake-server", "generic")
    assert [memory.short_rows_ahead(name) for name in names] == [1, 1, 1, 8, 8, 8]
    if not os.environ.get("NORMLAB_CPU_PREFETCH_ROWS"):
        from llvmlite import binding as llvm

        assert memory.SHORT_ROWS_AHEAD == memory.short_rows_ahead(llvm.get_host_cpu_name())
    monkeypatch.setattr(memory, "SHORT_ROWS_AHEAD", 8)
    for itemsize, d in ((2, 64), (2, 256), (4, 128), (4, 1), (2, 257), (4, 129), (4, 4096)):
        short = d * itemsize <= 512
        assert memory.prefetch_skip(d * itemsize) == (7 if short else 0), (itemsize, d)
    monkeypatch.setattr(memory, "SHORT_ROWS_AHEAD", 1)
    assert memory.prefetch_skip(128) == 0


def test_cache_sizes_come_from_sysfs(tmp_path, monkeypatch):
    if not os.environ.get("NORMLAB_CPU_PREFETCH_L2_KB"):  # the default: a quarter of this machine's L1
        assert memory.PREFETCH_L2_MIN_BYTES == memory._l1_data_bytes() // 4
    caches = [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"), (3, "Unified", "36M")]
    for i, (level, kind, size) in enumerate(caches):
        (tmp_path / f"index{i}").mkdir()
        for name, text in (("level", str(level)), ("type", kind), ("size", size)):
            (tmp_path / f"index{i}" / name).write_text(text + "\n")
    (tmp_path / "index9").mkdir()  # an entry that is not a size is skipped
    for name, text in (("level", "1"), ("type", "Data"), ("size", "")):
        (tmp_path / "index9" / name).write_text(text)
    caches = memory._caches(str(tmp_path))
    assert sorted(caches) == [(1, "Data", 48 << 10), (1, "Instruction", 32 << 10), (2, "Unified", 2 << 20),
                              (3, "Unified", 36 << 20)]
    monkeypatch.setattr(memory, "_caches", lambda: caches)
    assert (memory._l1_data_bytes(), memory._last_level_cache_bytes()) == (48 << 10, 36 << 20)
    assert memory.stream_min_bytes() == 16 << 20  # half of 36 MiB, capped
    monkeypatch.setattr(memory, "_caches", lambda: [])
    assert (memory._l1_data_bytes(), memory._last_level_cache_bytes()) == (32 << 10, 32 << 20)  # the defaults
    for llc, streamed_from in ((8 << 20, 4 << 20), (480 << 20, 16 << 20)):  # a small L3; a VM's whole socket
        monkeypatch.setattr(memory, "_caches", lambda llc=llc: [(3, "Unified", llc)])
        assert memory.stream_min_bytes() == streamed_from


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_a_small_call_on_one_thread_matches_the_chunked_call(gen, op, dtype, monkeypatch):
    # Below SERIAL_MAX_BYTES a call runs as one chunk on the calling thread. Rows do not depend
    # on each other, so outputs and dx keep their bits, in every dtype; the weight gradients are
    # summed over one chunk instead of several, so they may move by rounding: against float64.
    leaves = op_leaves(gen, op, (37, 256), dtype)
    grads = [torch.randn(37, 256, generator=gen).to(dtype)] * 2
    runs = []
    for limit in (0, 1 << 20):
        monkeypatch.setattr(launch, "SERIAL_MAX_BYTES", limit)
        runs.append(run_op(op, leaves, {}, "cpu", grads))
        assert launch.nchunks(37, 37 * 256 * 2) == (1 if limit else min(37, torch.get_num_threads()))
    (chunked, chunked_g), (one, one_g) = runs
    assert all(torch.equal(a, b) for a, b in zip(chunked, one))
    for name in ("x", "residual"):
        if name in one_g:
            assert torch.equal(chunked_g[name], one_g[name]), name
    check(gen, op, (37, 256), dtype, leaves=leaves)  # still under the one-thread limit


@pytest.mark.parametrize("policy, limit", [("PASSIVE", "2048 KiB"), ("", "128 KiB")])
def test_the_one_thread_limit_follows_how_numbas_idle_threads_wait(policy, limit):
    # Waking a sleeping worker (passive waits) costs more than waking a spinning one, so more
    # calls are worth keeping on one thread there. Each policy needs a fresh process: GNU
    # OpenMP reads it once, as it loads. `normlab info` says what it chose.
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "NORMLAB_CPU_SERIAL_MB")}
    out = subprocess.run([sys.executable, "-m", "normlab", "info"], env={**env, "OMP_WAIT_POLICY": policy},
                         capture_output=True, text=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("cpu threads:"))
    if "numba's omp layer" in line:
        assert f"outputs under {limit} on one thread" in line, line
    else:  # tbb and workqueue workers sleep when idle
        assert "outputs under 2048 KiB on one thread" in line, line


def test_small_calls_leave_numbas_other_threads_asleep_and_large_ones_use_torchs_count(monkeypatch):
    monkeypatch.setattr(launch, "SERIAL_MAX_BYTES", 128 << 10)
    import numba

    assert launch.nchunks(1000, (128 << 10) - 1) == 1 and numba.get_num_threads() == 1
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    assert launch.nchunks(1000, 128 << 10) == threads and numba.get_num_threads() == threads


def test_shared_staging_rows_stay_zero_and_aligned(gen, monkeypatch):
    # The launchers share one set of staging rows per chunk count between calls and threads
    # (memory.zero_stages), and the streamed 16-bit stores read a line of zeros from them. A kernel
    # that wrote there would corrupt every later call: run every op forward and backward, plain
    # and streamed, in every dtype, then look.
    shape = (37, 1000)
    for min_bytes in (1 << 62, 0):
        monkeypatch.setattr(launch, "STREAM_MIN_BYTES", min_bytes)
        for op in OPS:
            for dtype in DTYPES:
                leaves = op_leaves(gen, op, shape, dtype)
                grads = [torch.randn(shape, generator=gen).to(dtype)] * 2
                run_op(op, leaves, {}, "cpu", grads)
    stages = memory.zero_stages(launch.nchunks(shape[0], 1 << 30))
    assert stages.shape[0] == launch.nchunks(shape[0], 1 << 30) and not stages.any()
    assert stages.ctypes.data % 64 == 0


def test_out_writes_into_the_given_tensor(gen):
    x = torch.randn(16, 64, generator=gen).bfloat16()
    w = torch.randn(64, generator=gen).bfloat16()
    out = torch.empty_like(x)
    assert F.rms_norm(x, w, out=out, backend="cpu") is out
    assert torch.equal(out, F.rms_norm(x, w, backend="cpu"))
    assert F.layer_norm(x, w, w, out=out, backend="cpu") is out
    assert torch.equal(out, F.layer_norm(x, w, w, backend="cpu"))
    with pytest.raises(ValueError, match=r"out has shape \(16, 32\).*expected \(16, 64\)"):
        F.rms_norm(x, out=torch.empty(16, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="out= does not support autograd"):
        F.rms_norm(x.requires_grad_(), out=out)


def test_buffer_pool_reuses_only_unreferenced_buffers():
    pool = memory.BufferPool(max_bytes=64 << 20, min_bytes=0)
    a = pool.take(1 << 20)
    b = pool.take(1 << 20)
    assert a.ctypes.data != b.ctypes.data  # a is still held
    addr = a.ctypes.data
    del a
    c = pool.take(1 << 20)
    assert c.ctypes.data == addr  # a's buffer came back
    view = torch.from_numpy(c.view(np.float32))[3:]  # a tensor view keeps it held
    del c
    assert pool.take(1 << 20).ctypes.data != addr
    del view
    assert pool.take(1 << 20).ctypes.data == addr
    assert pool.stats()["buffers"] == 3


def test_buffer_pool_respects_its_cap():
    pool = memory.BufferPool(max_bytes=3 << 20, min_bytes=0)
    held = [pool.take(1 << 20) for _ in range(5)]  # beyond the cap: served, not pooled
    assert pool.stats()["held_bytes"] == 3 << 20
    del held
    pool.take(2 << 20)  # evicts free 1 MiB buffers to make room
    assert pool.stats()["held_bytes"] <= 3 << 20
    pool.clear()
    assert pool.stats()["held_bytes"] == 0


def test_outputs_from_the_pool_are_not_overwritten_while_alive(gen):
    x = torch.randn(512, 1024, generator=gen)
    y1 = F.rms_norm(x, backend="cpu")
    keep = y1.clone()
    y2 = F.rms_norm(x * 2, backend="cpu")  # must not land in y1's buffer
    assert y1.data_ptr() != y2.data_ptr() and torch.equal(y1, keep)


@pytest.mark.parametrize("name, value", [("NORMLAB_CPU_POOL_MB", "lots"), ("NORMLAB_CPU_STREAM_MB", "-4"),
                                         ("NORMLAB_CPU_ALLOC", "malloc"), ("NORMLAB_CPU_SERIAL_MB", "nan"),
                                         ("NORMLAB_CPU_PREFETCH_L2_KB", "-1"),
                                         ("NORMLAB_CPU_PREFETCH_ROWS", "two")])
def test_a_bad_environment_setting_names_its_variable(name, value):
    import subprocess
    import sys

    code = "import torch, normlab; normlab.rms_norm(torch.randn(2, 8), backend='cpu')"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, name: value}, capture_output=True,
                         text=True)
    assert out.returncode != 0 and f"environment variable {name} must be" in out.stderr, out.stderr[-500:]


def test_info_names_the_memory_thresholds_and_their_settings():
    import subprocess
    import sys

    env = {**os.environ, "NORMLAB_CPU_PREFETCH_L2_KB": "12", "NORMLAB_CPU_STREAM_MB": "3",
           "NORMLAB_CPU_PREFETCH_ROWS": "3"}
    out = subprocess.run([sys.executable, "-m", "normlab", "info"], env=env, capture_output=True, text=True)
    text = " ".join(out.stdout.split())  # rich wraps long lines
    stream = ("outputs from 3 MiB streamed past the caches (NORMLAB_CPU_STREAM_MB)" if simd.X86 else
              "outputs never streamed past the caches (non-temporal stores: x86 only)")
    assert stream in text, text[-600:]
    assert "into L2, not L1, from rows of 12 KiB (NORMLAB_CPU_PREFETCH_L2_KB)" in text, text[-600:]
    assert "rows of x up to 512 bytes prefetch the row 3 on (NORMLAB_CPU_PREFETCH_ROWS)" in text, text[-600:]


def test_info_says_outputs_are_not_streamed_off_x86(monkeypatch, capsys):
    """The launchers stream only on x86 (launch._stages); on ARM info must not claim a threshold."""
    from normlab import cli

    monkeypatch.setattr(simd, "X86", False)
    assert cli.main(["info"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "outputs never streamed past the caches (non-temporal stores: x86 only)" in text, text[-600:]
    assert "MiB streamed past" not in text


def test_threads_follow_torch():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert launch.nchunks(1000, 1 << 30) == 1
        import numba

        assert numba.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert launch.nchunks(1000, 1 << 30) == min(before, launch.numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("how", ["torch.set_num_threads(1)", "OMP_NUM_THREADS=1"])
def test_the_first_kernel_call_leaves_torchs_thread_count_and_gradients_alone(how):
    """numba's OpenMP layer resets the process's thread count when it starts; a fresh process
    checks that torch's count is still the user's after the first call, and that the first
    call's weight gradient is bitwise that of later calls."""
    import subprocess
    import sys

    code = (
        "import torch, normlab\n"
        + ("torch.set_num_threads(1)\n" if how.startswith("torch") else "")
        + "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(512, 1000, generator=g); dy = torch.randn(512, 1000, generator=g)\n"
        "grads = []\n"
        "for _ in range(3):\n"
        "    w = torch.ones(1000, requires_grad=True); xx = x.clone().requires_grad_()\n"
        "    normlab.layer_norm(xx, w, torch.zeros(1000), backend='cpu').backward(dy)\n"
        "    grads.append(w.grad)\n"
        "print(torch.get_num_threads(), all(torch.equal(grads[0], g) for g in grads[1:]))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if how.startswith("OMP") else {k: v
                                                                                for k, v in os.environ.items()
                                                                                 if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["1", "True"], out.stdout + out.stderr[-500:]


_FORK_PROBE = """
import json, torch
from torch.utils.data import DataLoader, Dataset
from normlab import functional as F, reference as R
from normlab.kernels.cpu import launch, rmsnorm

class Rows(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(i), dtype=torch.bfloat16)
        y = F.rms_norm(x, backend="cpu")
        ran = rmsnorm.rms_fwd.serial().signatures if launch.serial() else rmsnorm.rms_fwd.signatures
        return x, y, launch.serial(), len(ran)

F.rms_norm(torch.randn(4, 256), backend="cpu")  # the parent starts the threading layer first
err, serial, ran = 0.0, set(), []
loader = DataLoader(Rows(), batch_size=2, num_workers=2, multiprocessing_context="fork")
for x, y, was_serial, kernels in loader:
    truth = R.rms_norm(x.double())
    err = max(err, ((y.double() - truth).abs() / truth.abs().clamp_min(1)).max().item())
    serial |= set(was_serial.tolist())
    ran += kernels.tolist()
print(json.dumps({"layer": launch.threading_layer(), "serial": sorted(serial), "ran": min(ran), "err": err}))
"""


def test_dataloader_workers_forked_after_a_kernel_call_run_the_kernels():
    # with GNU OpenMP as numba's layer, a worker forked after the parent's first kernel died
    # ("fork() called from a process already using GNU OpenMP"); the workers now run the same
    # kernels compiled serially (their own signatures compiled there, not the reference)
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FORK_PROBE], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["err"] <= 2 ** -8  # bf16 output: within one rounding of the float64 math
    assert got["ran"] >= 1  # a compiled rms_fwd signature in every worker: the kernels ran there
    assert got["serial"] == [got["layer"] == "omp"], got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_every_allocator_gives_the_same_outputs_and_gradients(gen, op, dtype, monkeypatch):
    # Outputs and per-row statistics come from the pool, numpy or torch (NORMLAB_CPU_ALLOC),
    # each made together with the array the kernel writes (memory.empty, memory.vector): a 3-D
    # input checks the tensor's shape and dtype views on top of that array. With the pool's
    # minimum at 0 every output and statistic takes the pool's path, which bf16 and fp16 reach
    # through integer arrays.
    shape = (3, 7, 96)
    leaves = op_leaves(gen, op, shape, dtype)
    grads = [torch.randn(shape, generator=gen).to(dtype)] * 2
    runs = []
    for allocator in ("torch", "numpy", "pool"):
        monkeypatch.setattr(memory, "ALLOCATOR", allocator)
        monkeypatch.setattr(memory.POOL, "min_bytes", 0)
        outs, gs = run_op(op, leaves, {}, "cpu", grads)
        assert all(o.shape == shape for o in outs) and outs[0].dtype == dtype
        runs.append((outs, gs))
        # the statistics a compiled graph's backward receives, from the pool and below its
        # minimum: the shapes and dtypes the fake ops declare
        for min_bytes in (0, 1 << 20):
            monkeypatch.setattr(memory.POOL, "min_bytes", min_bytes)
            *_, rstd = launch.rms_fwd_launch(leaves["x"], None, 1e-6, True, True, 0.0, shape[-1])
            *_, mean, ln_rstd = launch.ln_fwd_launch(leaves["x"], None, None, 1e-5)
            assert rstd.shape == ln_rstd.shape == mean.shape == shape[:-1]
            assert (rstd.dtype, ln_rstd.dtype, mean.dtype) == (torch.float32, torch.float32, torch.float64)
    (first, first_g), *rest = runs
    for outs, gs in rest:
        assert all(torch.equal(a, b) for a, b in zip(first, outs))
        assert all(torch.equal(first_g[k], gs[k]) for k in first_g)
    check(gen, op, shape, dtype, leaves=leaves)  # the pool's path, against float64


@pytest.mark.parametrize("op", OPS)
def test_a_forward_without_a_graph_makes_no_statistics_and_the_same_outputs(gen, op, monkeypatch):
    # No graph reads a no-grad forward's per-row statistics: the kernels write them to a scratch
    # array (memory.scratch) and no tensor is made for them, while a forward that records a
    # graph keeps them for its backward. The outputs must not depend on which.
    shape = (5, 3, 80)
    leaves = op_leaves(gen, op, shape, torch.bfloat16)
    made = []
    real = memory.vector
    monkeypatch.setattr(launch, "vector", lambda *a: made.append(a) or real(*a))
    with torch.no_grad():
        no_graph = call_op(op, leaves, {}, "cpu")
        if op in ("rms_norm", "layer_norm"):  # into out= too
            into = torch.empty_like(no_graph[0])
            call_op(op, leaves, {"out": into}, "cpu")
            assert torch.equal(into, no_graph[0])
    assert made == []
    kept = call_op(op, {k: v.clone().requires_grad_() for k, v in leaves.items()}, {}, "cpu")
    assert {a[1] for a in made} == ({torch.float32} if "rms" in op else {torch.float32, torch.float64})
    assert all(torch.equal(a, b) for a, b in zip(no_graph, kept))
    check(gen, op, shape, torch.bfloat16, leaves=leaves)


def test_scratch_statistics_are_per_thread_and_grow():
    first = memory.scratch(10, torch.float32)
    assert first.shape[0] >= 10 and first.dtype == np.float32
    assert memory.scratch(3, torch.float64).dtype == np.float64
    grown = memory.scratch(100_000, torch.float32)
    assert grown.shape[0] >= 100_000 and not np.shares_memory(first, grown)
    other = []
    thread = threading.Thread(target=lambda: other.append(memory.scratch(10, torch.float32)))
    thread.start()
    thread.join()
    assert not np.shares_memory(other[0], memory.scratch(10, torch.float32))


def test_no_grad_forwards_in_threads_give_the_one_thread_results(gen):
    # Threads share nothing a caller reads: each writes its discarded statistics to its own
    # scratch, and its outputs are those of the same calls made one after another.
    xs = [torch.randn(rows, 256, generator=gen).to(torch.bfloat16) for rows in (7, 300, 64, 1000)]
    w, b = torch.randn(256, generator=gen), torch.randn(256, generator=gen)
    with torch.no_grad():
        alone = [(F.rms_norm(x, w, backend="cpu"), F.layer_norm(x, w, b, backend="cpu")) for x in xs]
    results = {}

    def work(i):
        with torch.no_grad():
            for _ in range(20):
                got = (F.rms_norm(xs[i], w, backend="cpu"), F.layer_norm(xs[i], w, b, backend="cpu"))
                results.setdefault(i, []).append(all(torch.equal(a, e) for a, e in zip(got, alone[i])))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(all(ok) for ok in results.values()) and len(results) == len(xs)
