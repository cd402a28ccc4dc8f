"""Every Triton kernel specialization normlab can launch, compiled for real GPUs on this CPU-only
machine, and the GPU check script run end to end.

The interpreter tests (test_kernels_triton.py) run the kernels' Python with numpy semantics and
never reach Triton's compiler; these tests do (tools/triton_compile.py: A100 sm_80 and H100/H200
sm_90, down to the cubin, with the ptxas Triton's wheel ships). A cold run of the grid takes 100 to
300 s on 2 cores; the tool keeps each compile's result in its own cache (keyed by Triton's version,
the kernels' source, the spec and the target), so a warm run takes seconds.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normlab import functional as F
from opcheck import OPS, RMS_OPTIONS, call_op, op_leaves

pytest.importorskip("triton", reason="the triton backend needs triton (pip install normlab[gpu])")
from normlab.kernels.triton import launch as T  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = "64,3000,4096,16384,262144"  # 3000: a size that is not a power of two takes a rounded block


def _compiler_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_every_reachable_specialization_compiles_for_a100_and_h100(tmp_path):
    report = tmp_path / "compile.json"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "triton_compile.py"), "--targets", "80,90",
                           "--hidden", HIDDEN,
                           "--json", str(report)], env=_compiler_env(), capture_output=True, text=True,
                          timeout=1200)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-3000:]
    # e.g. "1176 compiles (588 specs x 2 targets) in 99.4 s; 0 problems; at most 146 registers"
    print(summary)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(report.read_text())
    specs = len(T.reachable_specs(tuple(int(h) for h in HIDDEN.split(","))))
    assert len(result["specs"]) == specs and len(result["results"]) == 2 * specs
    assert {r["target"] for r in result["results"]} == {80, 90}
    for r in result["results"]:
        assert r["cubin_bytes"] > 0 and not r["ptx_local"] and r["spill_bytes"] == 0, r
        assert r["shared"] <= result["shared_limit"][str(r["target"])], r
        assert not r["fp_fusion_warning"], r


PLANT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import triton, triton_compile as TC
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for spec in TC.T.reachable_specs((64,)):
    if spec.kernel == "dyt_bwd":
        sig, flags = TC.signature(spec)
        triton.compile(ASTSource(fn=getattr(TC.K, spec.kernel), signature=sig, constexprs=flags),
                       target=GPUTarget("cuda", 90, 32), options=spec.options())
"""


def test_the_check_ignores_what_others_left_in_tritons_cache_and_survives_a_second_run(tmp_path):
    # Triton's shared cache holding these kernels already (an earlier, interrupted run) meant
    # ptxas never ran and the check found no figures; two runs on one kept cache must not collide
    shared, kept = tmp_path / "triton-shared", tmp_path / "kept"
    env = {**_compiler_env(), "TRITON_CACHE_DIR": str(shared)}
    planted = subprocess.run([sys.executable, "-c", PLANT, str(ROOT / "tools")], env=env, capture_output=True,
                             text=True,
                             timeout=600)
    assert planted.returncode == 0, planted.stderr[-3000:]
    assert any(shared.rglob("*.cubin")), "nothing planted in Triton's cache"
    args = [sys.executable, str(ROOT / "tools" / "triton_compile.py"), "--targets", "90", "--hidden", "64",
            "--kernels", "dyt_bwd",
            "--jobs", "1", "--cache", str(kept)]

    def check(json_path, proc=None):
        proc = proc or subprocess.Popen(args + ["--json", str(json_path)], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE,
                                        text=True)
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        results = json.loads(json_path.read_text())["results"]
        assert len(results) == 6 and all(r["registers"] > 0 and r["cubin_bytes"] > 0
                                         for r in results), results
        return results

    first = check(tmp_path / "first.json")
    assert not any(r.get("kept") for r in first)
    files = sorted(kept.glob("*.json"))
    assert len(files) == 6
    files[0].write_text(files[0].read_text()[:20])  # a result cut short, as a kill mid-write would leave it
    both = [subprocess.Popen(args + ["--json", str(tmp_path / f"run{i}.json")], env=env,
                             stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]
    for i, proc in enumerate(both):
        again = check(tmp_path / f"run{i}.json", proc)
        assert sum(1 for r in again if r.get("kept")) >= 5  # the cut one is compiled again, the rest read
        assert [r["registers"] for r in again] == [r["registers"] for r in first]
    assert not list(kept.glob("*.tmp"))


def test_the_grid_holds_every_spec_the_launchers_launch(monkeypatch):
    # reachable_specs enumerates the public options by hand: a call that launches a spec outside
    # it (a new option, a new dtype path) would go uncompiled, so record what the launchers ask for
    launched = set()
    for name in ("fwd_spec", "bwd_spec", "dyt_spec"):
        real = getattr(T, name)

        def record(*args, _real=real, **kwargs):
            spec = _real(*args, **kwargs)
            launched.add(spec)
            return spec

        monkeypatch.setattr(T, name, record)
    gen = torch.Generator().manual_seed(0)
    d = 96
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for op in OPS:
            for opts in [{}] + (RMS_OPTIONS if "rms" in op else []) + ([{"residual_in_fp32": True}]
                                                                       if "add" in op else []):
                call_op(op, op_leaves(gen, op, (3, d), dtype),
                        {k: v for k, v in opts.items() if k != "partial"}, "triton")
        x = torch.randn(3, d, dtype=dtype, requires_grad=True)
        F.layer_norm(x, None, None, backend="triton").sum().backward()  # no weight, no bias
        F.rms_norm(x, None, backend="triton").sum().backward()
        y, s = F.add_rms_norm(x, torch.randn(3, d, dtype=dtype), backend="triton")
        y.sum().backward()  # the sum's gradient unused: no ds
        alpha = torch.tensor([0.5], requires_grad=True)
        for affine in (torch.ones(d, dtype=dtype, requires_grad=True), None):
            F.dyt(x, alpha, affine, affine, backend="triton").sum().backward()
    assert launched, "the launchers did not go through fwd_spec / bwd_spec"
    missing = launched - set(T.reachable_specs((d,)))
    assert not missing, f"launched but not in reachable_specs: {sorted(map(str, missing))[:3]}"


DETECT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch, triton_compile as TC
from normlab.kernels.triton import launch as T
spec = T.fwd_spec(4096, torch.bfloat16, weight=torch.bfloat16, bias=None, residual=None, sum_dtype=None,
                  is_rms=True, llama=True, inside=True)
if sys.argv[2] == "default":  # what a launch without the choice would compile
    object.__setattr__(spec, "options", lambda: {"num_warps": spec.num_warps})
r = TC.compile_one((0, spec, 90))
print(r["fp_fusion_warning"], r.get("spill_bytes"), r["cubin_bytes"] > 0)
"""


@pytest.mark.parametrize("how", ["chosen", "default"])
def test_fp_fusion_left_to_the_default_is_caught(how, tmp_path):
    # Triton 3.9 warns when fusion is left to its default, which flips in 3.10: the grid reports
    # that warning as a problem, so a kernel launched without OPTIONS fails the compile test
    env = {**_compiler_env(), "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", DETECT, str(ROOT / "tools"), how], env=env,
                          capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    warned, spills, cubin = done.stdout.split()
    assert warned == ("True" if how == "default" else "False") and spills == "0" and cubin == "True"


def test_gpu_check_dry_run_writes_what_a_gpu_run_writes(tmp_path):
    out = tmp_path / "gpu-check"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", str(out)],
                          capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("summary.md", "summary.json", "correctness.json", "bench.json", "check-model.json",
                 "log.txt"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["sections"]] == ["correctness", "bench", "copy", "check-model"]
    assert summary["dry_run"] and summary["failures"] == []
    checks = json.loads((out / "correctness.json").read_text())["checks"]
    ops = ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm", "dyt")
    # ops x dtypes x sizes, 2 more
    assert len(checks) == len(ops) * 3 * 2 + 2 and all(c["ok"] for c in checks)
    assert {c["op"] for c in checks} == set(ops)
    assert "## Failures" in (out / "summary.md").read_text()
