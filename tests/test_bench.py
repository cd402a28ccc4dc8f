"""normlab bench: records, byte counts and the command line (tiny sizes: a tool, not a timing test)."""

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from normlab import bench, bench_tables
from normlab import functional as F
from normlab.cli import main

pytestmark = pytest.mark.slow(minutes=1.5)  # minutes cold on 2 cores (conftest.py)


def test_moved_bytes_counts_what_each_op_must_move():
    n, d, e = 8 * 16, 16, 4
    assert bench.moved_bytes("rms_norm", "fwd", (8, 16), torch.float32) == 2 * n * e + d * e
    assert bench.moved_bytes("layer_norm", "bwd", (8, 16), torch.float32) == 3 * n * e + 2 * 2 * d * e
    assert bench.moved_bytes("add_rms_norm", "fwd", (8, 16), torch.bfloat16) == 4 * n * 2 + d * 2
    fb = bench.moved_bytes("add_layer_norm", "fwdbwd", (8, 16), torch.float32)
    assert fb == bench.moved_bytes("add_layer_norm", "fwd", (8, 16), torch.float32) + bench.moved_bytes(
        "add_layer_norm", "bwd", (8, 16), torch.float32
    )


@pytest.mark.parametrize("bad, message",
                         [("8192", "ROWSxHIDDEN"), ("axb", "ROWSxHIDDEN"), ("4x", "ROWSxHIDDEN"),
                          ("0x4", "rows and hidden size must each be at least 1")])
def test_parse_shape_rejects_bad_shapes(bad, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_shape(bad)


@pytest.mark.parametrize("option, message", [({"repeat": 0}, "repeat must be at least 1"),
                                             ({"case_seconds": float("nan")},
                                              "case_seconds must be a number >= 0")])
def test_bench_refuses_rounds_it_cannot_take_a_median_of(option, message):
    with pytest.raises(ValueError, match=message):
        bench.run_bench(ops=("rms_norm",), backends=("normlab",), shapes=("4x8",), **option)


def test_every_op_and_peer_runs_and_records_have_the_documented_keys():
    records, notes = bench.run_bench(
        ops=bench.OPS, backends=("normlab", "reference", "torch", "torch-module", "hf", "liger"),
        dtypes=("fp32", "bf16"), shapes=("6x40",), passes=bench.PASSES, repeat=2, warmup=1,
    )
    keys = {"op", "backend", "dtype", "shape", "pass", "alloc", "ms", "gbps", "frac_of_copy"}
    assert all(keys <= set(r) for r in records)
    copies = [r for r in records if r["op"] == "copy"]
    assert len(copies) == 2 and all(r["frac_of_copy"] == 1.0 for r in copies)
    got = {(r["op"], r["backend"], r["pass"], r["alloc"]) for r in records if r["dtype"] == "fp32"}
    for op in bench.OPS:
        for p in bench.PASSES:
            assert (op, "normlab", p, "alloc") in got
    assert ("rms_norm", "normlab", "fwd", "prealloc") in got and ("add_rms_norm", "normlab", "fwd",
                                                                  "prealloc") not in got
    assert ("rms_norm", "hf", "bwd", "alloc") in got and ("layer_norm", "hf", "fwd", "alloc") not in got
    assert any("liger" in n for n in notes)
    for r in records:  # GB/s and the fraction follow from the bytes and the time
        assert r["gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6, rel=0.02)


@pytest.mark.parametrize("scrub", [True, False])
def test_the_cache_is_scrubbed_before_every_timed_call_and_rounds_rotate(monkeypatch, scrub):
    # A log of what ran, in order: the scrub must come right before each timed forward, and
    # between a backward's untimed forward and its timed backward.
    log = []
    monkeypatch.setattr(bench, "scrubber", lambda device: lambda: log.append("scrub"))
    real_grad = torch.autograd.grad
    monkeypatch.setattr(bench.torch.autograd, "grad", lambda *a,
                        **k: (log.append("backward"), real_grad(*a, **k))[1])
    fn = bench.make_peer("normlab", "rms_norm", 16, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(bench, "make_peer", lambda name,
                        *a: bench.Peer(lambda x, r: (log.append("forward"), fn.fn(x, r))[1],
                                      fn.params, fn.out_fn))
    bench.run_bench(ops=("rms_norm",), backends=("normlab",), dtypes=("fp32",), shapes=("4x16",),
                    passes=("fwd", "bwd"),
                    allocs=("alloc",), repeat=3, warmup=0, scrub=scrub)
    rounds = "".join({"scrub": "s", "forward": "f", "backward": "b"}[e] for e in log)
    copy, fwd, bwd = ("s", "sf", "sfsb") if scrub else ("", "f", "fb")
    # each round starts one case later: copy, forward, backward; forward, backward, copy; ...
    assert rounds == copy + fwd + bwd + fwd + bwd + copy + bwd + copy + fwd


def test_forward_calls_run_with_autograd_off_set_outside_their_timing(monkeypatch):
    # The grad mode is set around each timed call, not inside it: a no_grad block inside cost a
    # forward ~35 us after the cache read that the copy did not pay. Forwards (allocating and
    # into out=) must see autograd off, the backward's graph must be recorded, and no runner may
    # enter torch.no_grad itself.
    seen = []
    entered = []
    real_no_grad = torch.no_grad
    monkeypatch.setattr(torch, "no_grad", lambda *a, **k: (entered.append(1), real_no_grad(*a, **k))[1])
    fn = bench.make_peer("normlab", "rms_norm", 16, torch.float32, torch.device("cpu"))

    def record(x, r):
        seen.append(("fn", torch.is_grad_enabled()))
        return fn.fn(x, r)

    def record_out(x, r, out):
        seen.append(("out", torch.is_grad_enabled()))
        return fn.out_fn(x, r, out)

    monkeypatch.setattr(bench, "make_peer", lambda name, *a: bench.Peer(record, fn.params, record_out))
    records, _ = bench.run_bench(ops=("rms_norm",), backends=("normlab",), dtypes=("fp32",), shapes=("4x16",),
                                 passes=("fwd", "bwd"), allocs=("alloc", "prealloc"), repeat=2, warmup=1)
    assert {r["alloc"] for r in records if r["pass"] == "fwd"} == {"alloc", "prealloc"}
    # fwd x2, and bwd's graph
    assert ("out", False) in seen and ("fn", False) in seen and ("fn", True) in seen
    # warm-up and two rounds of the backward
    assert ("out", True) not in seen and seen.count(("fn", True)) == 3
    assert not entered
    assert torch.is_grad_enabled()


def test_a_record_says_whether_the_cache_was_scrubbed(tmp_path):
    records, _ = bench.run_bench(ops=("rms_norm",), backends=("normlab",), dtypes=("fp32",), shapes=("4x16",),
                                 passes=("fwd",), allocs=("alloc",), repeat=1, warmup=0)
    for scrub in (True, False):
        bench.write_json(str(tmp_path / "r.json"), records, {}, scrub=scrub)
        method = json.loads((tmp_path / "r.json").read_text())["method"]
        assert method == {"scrub_bytes": bench.ROTATE_BYTES if scrub else 0, "grad_mode": "untimed",
                          "freed_memory": "returned"}


# Run in a process of its own (the setting is for good): the bench, then a 64 MiB tensor made and
# freed, with glibc's account of where it came from (mmapped bytes) and what it holds free after.
_FREED_MEMORY = """
import ctypes, json, sys, torch
from normlab.cli import main
main(["bench", "--ops", "rms_norm", "--backends", "normlab", "--dtypes", "fp32", "--shapes", "4x64",
      "--passes", "fwd", "--alloc", "alloc", "--repeat", "1", "--quiet", "--json", sys.argv[1],
      *sys.argv[2:]])
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
x = torch.ones(64 << 20, dtype=torch.uint8)
mapped = libc.mallinfo2().hblkhd
del x
print(json.dumps({"mapped": mapped, "free_after": libc.mallinfo2().fordblks,
                  "method": json.load(open(sys.argv[1]))["method"]}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the option sets glibc's malloc options")
def test_keep_freed_memory_makes_glibc_keep_a_freed_large_block(tmp_path):
    def run(*flags):
        out = subprocess.run([sys.executable, "-c", _FREED_MEMORY, str(tmp_path / "r.json"), *flags],
                             capture_output=True, text=True, check=True, timeout=300)
        return json.loads(out.stdout.strip().splitlines()[-1])

    block = 64 << 20
    default, kept = run(), run("--keep-freed-memory")
    # glibc's default: the block is mapped for itself and returned to the OS on free
    assert default["mapped"] >= block and default["free_after"] < block
    assert default["method"]["freed_memory"] == "returned"
    # kept: it comes from the heap and stays there, free for the next allocation
    assert kept["mapped"] < block and kept["free_after"] >= block
    assert kept["method"]["freed_memory"] == "kept"


def test_keep_freed_memory_refuses_a_c_library_it_cannot_set(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    with pytest.raises(RuntimeError, match="--keep-freed-memory sets glibc's malloc options"):
        bench.keep_freed_memory()


def test_a_record_cut_short_by_a_full_disk_leaves_the_last_one_whole(tmp_path, monkeypatch):
    import errno
    import pathlib

    path = tmp_path / "r.json"
    bench.write_json(str(path), [{"op": "copy", "ms": 1.0}], {"cpus": 2})
    before = path.read_text()

    def half_then_full(self, text):  # the disk fills halfway through the new file
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", half_then_full)
    with pytest.raises(OSError, match="r.json"):
        bench.write_json(str(path), [{"op": "copy", "ms": 2.0}] * 100, {"cpus": 2})
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_compile_peer_runs():
    records, _ = bench.run_bench(ops=("rms_norm",), backends=("compile",), dtypes=("fp32",), shapes=("4x32",),
                                 passes=("fwd",), allocs=("alloc",), repeat=1, warmup=1)
    assert [r["backend"] for r in records] == ["torch", "compile"]


def test_ipex_peer_times_its_forward_norms_and_says_why_not_the_backward(monkeypatch):
    import sys
    import types

    calls = []

    def rms_norm(x, w, eps):
        calls.append(("rms_norm", tuple(x.shape), tuple(w.shape), eps))
        return F.rms_norm(x, w, eps, backend="reference")

    def fast_layer_norm(x, shape, w, b, eps):
        calls.append(("fast_layer_norm", tuple(x.shape), shape, eps))
        return torch.nn.functional.layer_norm(x, shape, w, b, eps)

    fake = types.ModuleType("intel_extension_for_pytorch")
    fake.llm = types.SimpleNamespace(functional=types.SimpleNamespace(rms_norm=rms_norm,
                                                                      fast_layer_norm=fast_layer_norm))
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", fake)
    records, notes = bench.run_bench(ops=("rms_norm", "layer_norm"), backends=("ipex",), dtypes=("fp32",),
                                     shapes=("4x32",),
                                     passes=("fwd", "bwd"), allocs=("alloc",), repeat=1, warmup=1)
    assert sorted((r["op"], r["pass"]) for r in records
                  if r["backend"] == "ipex") == [("layer_norm", "fwd"), ("rms_norm", "fwd")]
    assert {c[0] for c in calls} == {"rms_norm", "fast_layer_norm"} and all(c[1] == (4, 32) for c in calls)
    assert ("fast_layer_norm", (4, 32), (32,), bench.EPS) in calls
    assert any(n.startswith("ipex: forward only") for n in notes), notes
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", None)  # not installed: import fails
    records, notes = bench.run_bench(ops=("rms_norm",), backends=("ipex",), dtypes=("fp32",),
                                     shapes=("4x32",),
                                     passes=("fwd",), allocs=("alloc",), repeat=1, warmup=1)
    assert [r["backend"] for r in records] == ["torch"]  # the copy alone
    assert any("intel_extension_for_pytorch is not installed" in n and "ipex_peer.sh" in n
               for n in notes), notes


def test_command_line_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    code = main(["bench", "--ops", "rms_norm", "--backends", "normlab,torch", "--dtypes", "fp32", "--shapes",
                 "4x64",
                 "--passes", "fwd", "--repeat", "1", "--json", str(path), "--quiet"])
    assert code == 0
    data = json.loads(path.read_text())
    assert data["environment"]["torch"] == torch.__version__
    assert {r["backend"] for r in data["records"]} == {"torch", "normlab"}
    assert "x copy" in capsys.readouterr().out
    main(["bench", "--ops", "rms_norm,layer_norm", "--backends", "normlab", "--dtypes", "fp32", "--shapes",
          "4x64",
          "--passes", "fwd", "--alloc", "alloc", "--repeat", "1", "--quiet"])
    assert "RMSNorm time / LayerNorm time" in capsys.readouterr().out


@pytest.mark.parametrize("flags, vectors", [
    ("fpu sse2 avx avx2 fma", "AVX2"),
    ("avx2 avx512f avx512bw avx512vl", "AVX-512"),
    ("avx2 avx512f avx512_bf16", "AVX-512 with AVX512-BF16"),
    ("fp asimd evtstrm", "NEON"),
    ("fp asimd sve sve2", "SVE"),
    (None, "unknown"),
])
def test_records_name_the_cpus_vector_instructions(monkeypatch, flags, vectors):
    from normlab import env

    info = {"flags": flags, "Features": flags, "model name": "Some CPU"}
    monkeypatch.setattr(env, "_cpuinfo", lambda *keys: next((info[k] for k in keys if k in info), None))
    assert env.cpu_vectors() == vectors
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    run = {"environment": {**env.environment(), "date": "2026-12-03 00:00:00 UTC"}, "records": [
        {"op": op, "backend": b, "dtype": "fp32", "shape": "4096x4096", "pass": p, "alloc": "alloc", "ms": ms,
         "frac_of_copy": 1.0} for op in ("rms_norm", "layer_norm")
        for b, ms in (("normlab", 1.0), ("torch", 3.0))
        for p in ("fwd", "bwd")]}
    summary = bench_tables.readme_summary(run, "x.json")
    assert summary.startswith(f"On {os.cpu_count()} cores of an Some CPU, {vectors} (2026-12-03")
    # the record page's name for the machine, where "AMD EPYC" alone would not tell Zen 3, 4 and 5 apart
    named = bench_tables.readme_summary(run, "x.json", machine="2 cores of an AMD EPYC (Zen 4)")
    assert named.startswith(f"On 2 cores of an AMD EPYC (Zen 4), {vectors}, 2026-12-03 (torch")
    named = bench_tables.readme_summary(run, "x.json", machine=f"2 cores of an AMD EPYC (Zen 4, {vectors})")
    assert named.startswith(f"On 2 cores of an AMD EPYC (Zen 4, {vectors}), 2026-12-03 (torch")
    assert "`OMP_WAIT_POLICY=PASSIVE normlab bench --json x.json`" in summary


def test_readme_summary_puts_the_peers_with_freed_memory_kept_beside_the_default(tmp_path):
    def run(torch_ms, compile_ms):
        return {"environment": {"date": "2026-12-05 00:00:00 UTC", "cpus": 2, "processor": "Some CPU",
                                "torch": "2", "numba": "0"},
                "records": [{"op": op, "backend": b, "dtype": "fp32", "shape": "4096x4096", "pass": p,
                             "alloc": "alloc", "ms": ms, "frac_of_copy": 1.0}
                            for op in ("rms_norm", "layer_norm") for p in ("fwd", "bwd")
                            for b, ms in (("normlab", 2.0), ("torch", torch_ms[p]),
                                          ("compile", compile_ms[p]))]}

    default = run({"fwd": 40.0, "bwd": 80.0}, {"fwd": 8.0, "bwd": 12.0})
    kept = run({"fwd": 30.0, "bwd": 70.0}, {"fwd": 3.0, "bwd": 5.0})
    plain = bench_tables.readme_summary(default, "r.json")
    assert "keep-freed-memory" not in plain
    both = bench_tables.readme_summary(default, "r.json", kept=(kept, "r-kept.json"))
    assert both.startswith(plain)
    added = both[len(plain):]
    assert "`normlab bench --keep-freed-memory --json r-kept.json`" in added
    assert "[r-kept.md](r-kept.md)" in added
    kept_part, default_part = added.split("by default in the same session")
    assert ("rms_norm takes 15-35x less time than `F.rms_norm` and 1.5-2.5x less than torch.compile"
            in kept_part)
    assert "layer_norm 15.0-35.0x less than `F.layer_norm`" in kept_part
    assert default_part.startswith(": 20-40x, 4.0-6.0x and 20.0-40.0x)")


ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 17\n"
        "flags\t\t: avx2\n")


@pytest.mark.parametrize("cpuinfo, name", [
    (ZEN4, "AMD EPYC (family 25, model 17)"),  # "model" after "model name": read by its whole key
    (ZEN4.replace("25", "26").replace("17", "2"), "AMD EPYC (family 26, model 2)"),
    ("processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\nFeatures\t: fp asimd\n",
     "ARM (part 0xd0c)"),
], ids=["zen4", "zen5", "arm"])
def test_records_tell_cpus_of_one_name_apart(monkeypatch, cpuinfo, name):
    # A VM names Zen 3, 4 and 5 alike "AMD EPYC"; their records and the lab's cached timings
    # (keyed by timing.bench_machine) must not be taken for one another's.
    import io

    from normlab import env
    from normlab.experiments import timing

    monkeypatch.setattr(env, "open", lambda path, *a, **k: io.StringIO(cpuinfo), raising=False)
    assert env.cpu_name() == name and env.environment()["processor"] == name
    assert timing.bench_machine().startswith(name)


def test_command_line_rejects_unknown_names(capsys):
    assert main(["bench", "--ops", "group_norm", "--quiet"]) == 2
    assert "unknown op 'group_norm'" in capsys.readouterr().out


@pytest.mark.parametrize("mode", [[], ["--in-cache"]], ids=["from memory", "in cache"])
def test_cpu_ab_tool_compares_two_source_trees(mode):
    # tools/cpu_ab.py calls the kernels by their signatures: it must keep up with them.
    # The same tree twice, one small case: the output names both speeds and B's speedup.
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    src = str(root / "src")
    done = subprocess.run(
        [sys.executable, str(root / "tools" / "cpu_ab.py"), src, src, "--ops", "rms,dytb",
         "--shapes", "64x256", "--dtype", "fp32", "--threads", "1", "--rounds", "2", *mode],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for op in ("rms", "dytb"):
        line = re.search(op + r"\s+64x256: x copy A ([\d.]+)\s+B ([\d.]+);\s+B speedup ([\d.]+) \(range",
                         done.stdout)
        assert line, done.stdout
        assert all(float(v) > 0 for v in line.groups())


def test_cpu_ab_passes_triples_whose_memory_outlives_the_call(monkeypatch):
    # The tool passes tensors by address, as the launchers do: the arrays behind them (the
    # forward's rstd among them) must live as long as the callable, or the backward reads freed
    # memory. Its output after a garbage collection is the array path's, bit for bit.
    import gc
    import importlib.util
    from pathlib import Path

    import numpy as np

    monkeypatch.setenv("NUMBA_CACHE_DIR", os.environ.get("NUMBA_CACHE_DIR", ""))  # the tool sets its own
    path = Path(__file__).resolve().parents[1] / "tools" / "cpu_ab.py"
    spec = importlib.util.spec_from_file_location("cpu_ab_triples", path)
    cpu_ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_ab)
    kernels = cpu_ab.load(str(Path(__file__).resolve().parents[1] / "src"), "normlab_ab_triples")
    assert kernels.triples
    outputs = {}
    for triples in (False, True):
        kernels.triples = triples
        torch.manual_seed(0)
        run = cpu_ab.runner(kernels, "rmsb", 8, 256, torch.float32, in_cache=True)
        gc.collect()
        litter = [np.full(8, np.nan, np.float32) for _ in range(1000)]  # what freed memory would hold
        run()
        del litter
        outputs[triples] = run.arrays[1].copy()
    assert np.isfinite(outputs[True]).all()
    assert np.array_equal(outputs[False], outputs[True])


@pytest.mark.parametrize("triples", [False, True])
def test_cpu_ab_prefetch_ab_gives_only_a_the_l1_prefetch(monkeypatch, triples):
    # --prefetch-ab measures what memory.prefetch_far's rule buys: A's calls must get far=False
    # where B's get the rule's answer, here True for a row of 64 KiB per input.
    import importlib.util
    import types
    from pathlib import Path

    monkeypatch.setenv("NUMBA_CACHE_DIR", os.environ.get("NUMBA_CACHE_DIR", ""))  # the tool sets its own
    path = Path(__file__).resolve().parents[1] / "tools" / "cpu_ab.py"
    spec = importlib.util.spec_from_file_location("cpu_ab_under_test", path)
    cpu_ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cpu_ab)
    calls = []
    kernels = types.SimpleNamespace(far=True, skip=False, triples=triples,
                                    rms_fwd=lambda *args: calls.append(("fwd", args[-1])),
                                    rms_bwd=lambda *args: calls.append(("bwd", args[-1])))
    d = 16384
    assert cpu_ab.memory.prefetch_far(d * 4 * 2)
    for near, far in ((True, False), (False, True)):
        calls.clear()
        cpu_ab.runner(kernels, "rmsb", 2, d, torch.float32, in_cache=True, near=near)()
        assert calls == [("fwd", far), ("bwd", far)]
    # --ahead-ab: trees that take ``skip`` get it after ``far``: the launchers' choice, or ahead - 1
    kernels.skip = True
    d = 64
    for ahead, skip in ((None, cpu_ab.memory.prefetch_skip(d * 4)), (1, 0), (8, 7)):
        calls.clear()
        cpu_ab.runner(kernels, "rmsb", 2, d, torch.float32, in_cache=True, ahead=ahead)()
        assert calls == [("fwd", skip), ("bwd", skip)], ahead


def test_dyt_ceiling_tool_runs_the_kernels_it_measures():
    # tools/dyt_ceiling.py calls DyT's vector blocks and launchers by their signatures: it must
    # keep up with them. One shape, as large as DYT_TABLE_MIN so that bf16 goes through the
    # tables: a row of the table per dtype and pass, every time > 0.
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "tools" / "dyt_ceiling.py"), "--shape", "1024x1024",
                           "--threads", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(
        r"^(fp32|bf16)\s+(fwd|bwd)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
        done.stdout,
        re.MULTILINE,
    )
    assert sorted((r[0], r[1]) for r in rows) == sorted((d, p) for d in ("fp32", "bf16")
                                                        for p in ("fwd", "bwd")), done.stdout
    assert all(float(v) > 0 for r in rows for v in r[2:])


@pytest.mark.parametrize("fn, end, slope_bound, not_one", [("tanh", 10.5, 3e-7, 0), ("erf", 6.5, 3e-7, 2)])
def test_pointwise_ulp_tool_sweeps_and_reports_the_bound(fn, end, slope_bound, not_one):
    # tools/pointwise_ulp.py backs docs/cpu-kernels.md's accuracy lines (tanh: 1.95 ulp, 2.5e-7
    # relative over every float32): every 1000th float here. Its counts must add up to the values
    # swept, the worst errors lie within the bounds, every saturated value be exactly 1 (erf: but
    # for the 1540 floats in [3.91921, 3.91957], where float32's erf rounds up to 1 and the
    # kernel's is one ulp below) and its gradient 0; a bad --step is refused by name.
    import re
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    tool = Path(__file__).resolve().parents[1] / "tools" / "pointwise_ulp.py"
    done = subprocess.run([sys.executable, str(tool), "--fn", fn, "--step", "1000"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    worst, total = re.search(r"^worst ([\d.]+) ulp at z = \S+; ([\d,]+) values$", done.stdout,
                             re.MULTILINE).groups()
    counts = [int(n.replace(",", ""))
              for n in re.findall(r"^  \[\S+, \S+\) ulp: ([\d,]+)$", done.stdout, re.MULTILINE)]
    expected = len(range(1, int(np.float32(end).view(np.int32)), 1000))
    assert int(total.replace(",", "")) == sum(counts) == expected, done.stdout
    assert 0 < float(worst) <= 2.0, done.stdout
    assert int(re.search(r"came out other than 1: (\d+)$", done.stdout,
                         re.MULTILINE).group(1)) <= not_one, done.stdout
    rel = re.search(rf"^backward: {fn}' worst (\S+) relative at z = \S+; from the cap on, dx not 0: 0$",
                    done.stdout, re.MULTILINE)
    assert rel and 0 < float(rel.group(1)) <= slope_bound, done.stdout
    bad = subprocess.run([sys.executable, str(tool), "--step", "0"], capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode != 0 and "--step must be a whole number >= 1" in bad.stderr


def test_ctrl_c_keeps_the_groups_measured_so_far(tmp_path, monkeypatch):
    # two dtype and shape groups; Ctrl-C in the second: the first group's records are written
    # and shown, the note says what was left out, and the exit status is Ctrl-C's
    measure, calls = bench._measure_group, []

    def interrupted_second(*args, **kwargs):
        calls.append(args[5])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure(*args, **kwargs)

    monkeypatch.setattr(bench, "_measure_group", interrupted_second)
    path = tmp_path / "bench.json"
    code = main(["bench", "--ops", "rms_norm", "--backends", "normlab", "--dtypes", "fp32", "--shapes",
                 "4x64,8x64",
                 "--passes", "fwd", "--repeat", "3", "--quiet", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert code == 130 and calls == [(4, 64), (8, 64)]
    assert {r["shape"] for r in saved["records"]} == {"4x64"} and saved["records"]
    assert any(n.startswith(bench.INTERRUPTED) and "1 of 2" in n for n in saved["notes"])
    # interrupted before any group finished: nothing to keep, so Ctrl-C reaches the caller as ever
    calls[:] = [None]  # the next group counts as the second: interrupted before any group finished
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(ops=("rms_norm",), backends=("normlab",), shapes=("4x64",), passes=("fwd",), repeat=3,
                        keep_on_ctrl_c=True)
    # a caller that judges the records (the lab's speed preset) is never handed a partial set
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(ops=("rms_norm",), backends=("normlab",), shapes=("4x64", "8x64"), passes=("fwd",),
                        repeat=3)
