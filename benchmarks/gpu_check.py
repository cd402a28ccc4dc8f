"""GPU check of the Triton backend: correctness at real sizes, the copy ceiling, and normlab bench
against peers, in one run that fits a short GPU window (run through gpu_check.sh).

    python benchmarks/gpu_check.py OUTDIR [--quick]

1. Correctness, every op and dtype, hidden 512 to 262144 (and odd 3000, 65537), outputs and
   gradients against float64 with DESIGN.md's bound (normlab.testing); one bf16 tensor of more
   than 2^31 elements (int64 addressing); dw bitwise reproducible across runs.
2. A device-to-device copy as the bandwidth ceiling (read + write bytes).
3. normlab bench on CUDA: normlab, torch eager (F.*), torch modules, Liger-Kernel when importable,
   and torch.compile of the reference on two shapes (compilation is slow).
Writes OUTDIR/correctness.json, OUTDIR/bench.json and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from normlab import bench
from normlab.env import environment
from normlab import functional as F
from normlab.testing import assert_close

OPS = ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _call(op, x, r, w, b, backend):
    if op == "rms_norm":
        return (F.rms_norm(x, w, backend=backend),)
    if op == "layer_norm":
        return (F.layer_norm(x, w, b, backend=backend),)
    if op == "add_rms_norm":
        return F.add_rms_norm(x, r, w, backend=backend)
    return F.add_layer_norm(x, r, w, b, backend=backend)


def check_case(op, dtype, rows, d, gen, dev="cuda") -> dict:
    x = torch.randn(rows, d, generator=gen, device=dev, dtype=torch.float32).to(dtype)
    r = torch.randn(rows, d, generator=gen, device=dev, dtype=torch.float32).to(dtype)
    w = (1 + 0.3 * torch.randn(d, generator=gen, device=dev)).to(dtype)
    b = (0.3 * torch.randn(d, generator=gen, device=dev)).to(dtype)
    leaves = [t.requires_grad_() for t in (x, r, w, b)]
    outs = _call(op, *leaves, "triton")
    grads = [torch.randn_like(o) for o in outs]
    g_fast = torch.autograd.grad(outs, leaves, grads, allow_unused=True)
    lowp = _call(op, *[t.detach().requires_grad_() for t in leaves], "reference")
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    truth = _call(op, *l64, "reference")
    assert_close(outs[0].detach(), truth[0].detach(), lowp=lowp[0].detach(), dtype=dtype, name=f"{op} output")
    g_truth = torch.autograd.grad(truth, l64, [g.double() for g in grads], allow_unused=True)
    rel = {}
    for name, gf, gt in zip(("x", "residual", "weight", "bias"), g_fast, g_truth):
        if gf is not None and gt is not None:
            rel[name] = ((gf.double() - gt).norm() / gt.norm().clamp_min(1e-30)).item()
    limit = 1e-3 if dtype == torch.float32 else 3e-2
    bad = {k: v for k, v in rel.items() if not v <= limit}
    if bad:
        raise AssertionError(f"gradient relative error over {limit}: {bad}")
    return {"grad_rel_err": rel}


def correctness(quick: bool) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [512, 3000, 4096, 16384, 65536, 65537, 262144] if not quick else [512, 65537, 262144]
    results = []
    for op in OPS:
        for name, dtype in DTYPES.items():
            for d in sizes:
                rows = max(2, (1 << 22) // d)
                rec = {"check": "op", "op": op, "dtype": name, "shape": f"{rows}x{d}"}
                try:
                    rec.update(check_case(op, dtype, rows, d, gen), ok=True)
                except Exception as err:  # keep going: one table of every case
                    rec.update(ok=False, error=f"{type(err).__name__}: {err}"[:500])
                results.append(rec)
    # int64 addressing: a bf16 tensor of more than 2^31 elements, forward checked on its last rows
    rows, d = 32769, 65536  # 2,147,549,184 elements
    rec = {"check": "over 2^31 elements", "op": "rms_norm", "dtype": "bf16", "shape": f"{rows}x{d}"}
    try:
        x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
        y = F.rms_norm(x, None, backend="triton")
        tail = slice(rows - 4, rows)
        ref = F.rms_norm(x[tail].double(), None, backend="reference")
        assert_close(y[tail], ref, lowp=F.rms_norm(x[tail], None, backend="reference"), dtype=torch.bfloat16)
        rec["ok"] = True
        del x, y
    except Exception as err:
        rec.update(ok=False, error=f"{type(err).__name__}: {err}"[:500])
    results.append(rec)
    torch.cuda.empty_cache()
    # determinism of dw
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    dws = []
    for _ in range(3):
        w.grad = None
        F.rms_norm(x, w, backend="triton").backward(dy)
        dws.append(w.grad.clone())
    results.append({"check": "dw bitwise reproducible", "op": "rms_norm", "dtype": "bf16", "shape": "8192x4096",
                    "ok": all(torch.equal(dws[0], d) for d in dws[1:])})
    return results


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    t0 = time.time()
    env = environment()
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; triton {env.get('triton')}", flush=True)
    try:
        checks = correctness(args.quick)
    except Exception:
        traceback.print_exc()
        checks = [{"check": "correctness", "ok": False, "error": traceback.format_exc()[-500:]}]
    (out / "correctness.json").write_text(json.dumps({"environment": env, "checks": checks}, indent=1))
    failed = [c for c in checks if not c.get("ok")]
    print(f"correctness: {len(checks) - len(failed)}/{len(checks)} ok ({time.time() - t0:.0f} s)", flush=True)
    for c in failed[:10]:
        print("  FAILED", c.get("op"), c.get("dtype"), c.get("shape"), c.get("error", "")[:200])
    shapes = ("4096x4096", "16384x1024", "1024x16384", "256x65536", "64x262144")
    records, notes = bench.run_bench(ops=("rms_norm", "layer_norm", "add_rms_norm"), backends=("normlab", "torch", "torch-module", "liger"),
                                     dtypes=("bf16", "fp32"), shapes=shapes if not args.quick else shapes[:2],
                                     passes=("fwd", "bwd"), allocs=("prealloc", "alloc"), repeat=20, device="cuda",
                                     case_seconds=0.5)
    more, notes2 = bench.run_bench(ops=("rms_norm", "layer_norm"), backends=("normlab", "compile"), dtypes=("bf16",),
                                   shapes=("4096x4096", "256x65536"), passes=("fwd", "bwd"), allocs=("alloc",), repeat=10,
                                   device="cuda", case_seconds=0.5)
    records += [r for r in more if r["backend"] == "compile"]
    bench.write_json(str(out / "bench.json"), records, {**env, "notes": notes + notes2})
    print(f"bench done ({time.time() - t0:.0f} s); notes: {'; '.join(notes + notes2)[:300]}")
    # the short table: fraction of copy per backend, forward and backward, prealloc for normlab
    print(f"{'op':<13}{'pass':<5}{'dtype':<6}{'shape':<12}" + "".join(f"{b:>14}" for b in ("normlab", "torch", "liger", "compile")))
    key = lambda r: (r["op"], r["pass"], r["dtype"], r["shape"])  # noqa: E731
    for k in sorted({key(r) for r in records if r["op"] != "copy"}):
        cells = []
        for b in ("normlab", "torch", "liger", "compile"):
            alloc = "prealloc" if b == "normlab" else "alloc"
            v = [r["frac_of_copy"] for r in records if key(r) == k and r["backend"] == b and r["alloc"] in (alloc, "alloc")]
            cells.append(f"{v[0]:>14.2f}" if v else f"{'-':>14}")
        print(f"{k[0]:<13}{k[1]:<5}{k[2]:<6}{k[3]:<12}" + "".join(cells))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
