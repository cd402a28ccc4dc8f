"""GPU check of the Triton backend, in one run that fits a short GPU window (run through gpu_check.sh).

    python benchmarks/gpu_check.py OUTDIR [--dry-run] [--quick]

Sections, each recorded with every failure it met (a failure never stops the run):

1. correctness: every op and dtype at hidden 1024 to 262144 (and the odd 3000 and 65537),
   outputs and gradients against float64 with DESIGN.md's bound (normlab.testing); one bf16
   tensor of more than 2^31 elements (int64 addressing); dw bitwise reproducible across runs.
2. copy: a device-to-device copy of each bench shape, the bandwidth ceiling (read + write bytes).
3. bench: normlab against torch (F.* and the nn modules), torch.compile of the reference,
   Liger-Kernel and quack when installed; forward and backward, bf16 and fp32, hidden 1024 to
   262144 (normlab bench's cases, every one timed round-robin with a copy of the same bytes).
4. check-model: ``normlab check-model llama --dtype bf16`` on the device, the triton backend.

Writes OUTDIR/summary.json and OUTDIR/summary.md (the sections, every failure, the short table),
OUTDIR/correctness.json, OUTDIR/bench.json and OUTDIR/check-model.json. Exit status 1 when
anything failed, 2 when there is no CUDA device (and no --dry-run).

--dry-run: the same sections and files on CPU under Triton's interpreter (TRITON_INTERPRET=1, set
by gpu_check.sh) at tiny sizes, so CI proves the script end to end; what only a GPU can run
(the 2^31-element tensor, the GPU-only peers, torch.compile) is recorded as skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from normlab import bench, kernels
from normlab import functional as F
from normlab.env import environment
from normlab.testing import assert_close

OPS = ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm", "dyt")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PEERS = ("normlab", "torch", "torch-module", "liger", "quack")


def _call(op, x, r, w, b, backend):
    if op == "dyt":  # r stands in for nothing; alpha is fixed (its gradient is checked on CPU)
        return (F.dyt(x, torch.full((1,), 0.5, device=x.device, dtype=torch.float32), w, b, backend=backend),)
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


def _attempt(record: dict, fn) -> dict:
    """Run fn, recording ok, or the error, in ``record``."""
    try:
        record.update(fn() or {}, ok=True)
    except Exception as err:  # keep going: one table of every case
        record.update(ok=False, error=f"{type(err).__name__}: {err}"[:500])
    return record


def correctness(dev: str, dry: bool, quick: bool) -> list[dict]:
    gen = torch.Generator(device=dev).manual_seed(0)
    sizes = [96, 300] if dry else [1024, 65537, 262144] if quick else [1024, 3000, 4096, 16384, 65536, 65537,
                                                                       262144]
    results = []
    for op in OPS:
        for name, dtype in DTYPES.items():
            for d in sizes:
                rows = 4 if dry else max(2, (1 << 22) // d)
                rec = {"check": "op", "op": op, "dtype": name, "shape": f"{rows}x{d}"}
                results.append(_attempt(rec, lambda: check_case(op, dtype, rows, d, gen, dev)))
    rec = {"check": "over 2^31 elements", "op": "rms_norm", "dtype": "bf16", "shape": "32769x65536"}
    if dry:
        results.append({**rec, "ok": True, "skipped": "dry run: needs about 8 GB of GPU memory"})
    else:
        def huge():  # int64 addressing: 2,147,549,184 elements, the last rows checked
            rows, d = 32769, 65536
            x = torch.randn(rows, d, device=dev, dtype=torch.bfloat16)
            y = F.rms_norm(x, None, backend="triton")
            tail = slice(rows - 4, rows)
            ref = F.rms_norm(x[tail].double(), None, backend="reference")
            assert_close(y[tail], ref, lowp=F.rms_norm(x[tail], None, backend="reference"),
                         dtype=torch.bfloat16)
        results.append(_attempt(rec, huge))
        torch.cuda.empty_cache()
    rows, d = (16, 128) if dry else (8192, 4096)

    def reproducible():
        x = torch.randn(rows, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(d, device=dev, requires_grad=True)
        dy = torch.randn_like(x)
        dws = []
        for _ in range(3):
            w.grad = None
            F.rms_norm(x, w, backend="triton").backward(dy)
            dws.append(w.grad.clone())
        if not all(torch.equal(dws[0], other) for other in dws[1:]):
            raise AssertionError("dw differs between runs")

    results.append(_attempt({"check": "dw bitwise reproducible", "op": "rms_norm", "dtype": "bf16",
                             "shape": f"{rows}x{d}"},
                            reproducible))
    return results


def run_bench(dev: str, dry: bool, quick: bool) -> tuple[list[dict], list[str]]:
    shapes = ("8x64",) if dry else ("16384x1024", "4096x4096") if quick else (
        "16384x1024", "4096x4096", "1024x16384", "256x65536", "64x262144")
    repeat = 3 if dry else 20
    with kernels.use_backend("triton"):  # normlab's own cases on the triton backend, also on CPU
        records, notes = bench.run_bench(ops=("rms_norm", "layer_norm", "add_rms_norm", "dyt"),
                                         backends=PEERS,
                                         dtypes=("bf16", "fp32"), shapes=shapes, passes=("fwd", "bwd"),
                                         allocs=("prealloc", "alloc"), repeat=repeat, device=dev,
                                         case_seconds=0.5)
        if dry:
            notes.append("torch.compile skipped in the dry run (minutes of C++ compiles on CPU)")
        else:  # compilation is slow: two shapes
            more, more_notes = bench.run_bench(ops=("rms_norm", "layer_norm"),
                                               backends=("normlab", "compile"), dtypes=("bf16",),
                                               shapes=("4096x4096", "256x65536"), passes=("fwd", "bwd"),
                                               allocs=("alloc",),
                                               repeat=10, device=dev, case_seconds=0.5)
            records += [r for r in more if r["backend"] == "compile"]
            notes += more_notes
    return records, notes


def check_model(dev: str, dry: bool) -> dict:
    from normlab import hf

    size = dict(batch=1, seq=8) if dry else dict(batch=2, seq=64)
    r = hf.check_model(hf.tiny_model("llama"), dtype="bf16", backend="triton", device=dev, **size)
    r["report"] = str(r["report"])
    if not r["ok"]:
        worst = r["tensors"][0]
        raise AssertionError(f"patched llama exceeds the bound ({r['bound']}) at {worst['tensor']}: error "
                             f"{worst['err_patched']:.3g} against the unpatched model's "
                             f"{worst['err_unpatched']:.3g}")
    return r


def short_table(records: list[dict]) -> list[str]:
    """Markdown: each case's GB/s as a fraction of a copy of the same bytes, per backend."""
    backends = [b for b in ("normlab", "torch", "liger", "quack", "compile")
                if any(r["backend"] == b for r in records)]
    lines = ["| op | pass | dtype | shape | " + " | ".join(backends) + " |", "|---" * (4 + len(backends))
             + "|"]
    key = lambda r: (r["op"], r["pass"], r["dtype"], r["shape"])  # noqa: E731
    for k in sorted({key(r) for r in records if r["op"] != "copy"}):
        cells = []
        for b in backends:
            v = [r["frac_of_copy"] for r in records if key(r) == k and r["backend"] == b
                 and r["alloc"] == "alloc"]
            cells.append(f"{v[0]:.2f}" if v else "-")
        lines.append(f"| {' | '.join(map(str, k))} | " + " | ".join(cells) + " |")
    return lines


def write_summary(out: Path, env: dict, sections: list[dict], records: list[dict], dry: bool) -> None:
    failures = [f"{s['name']}: {f}" for s in sections for f in s["failures"]]
    (out / "summary.json").write_text(json.dumps({"environment": env, "dry_run": dry, "sections": sections,
                                                  "failures": failures}, indent=1))
    lines = [f"# GPU check{' (dry run: CPU, Triton interpreter, tiny sizes)' if dry else ''}", "",
             f"{env.get('gpu', env['processor'])}; torch {env['torch']}, triton {env.get('triton')}, normlab "
             f"{env['normlab']} at git {env.get('git', '?')}; {env['date']}.", "",
             "| section | result | failures | seconds |", "|---|---|---|---|"]
    lines += [f"| {s['name']} | {'ok' if not s['failures'] else 'FAILED'} | {len(s['failures'])} | "
              f"{s['seconds']} |" for s in sections]
    lines += ["", "## Failures", ""] + ([f"- {f}" for f in failures] or ["None."])
    lines += ["", "## Speed as a fraction of a copy of the same bytes (allocating calls)",
              ""] + short_table(records)
    copies = [r for r in records if r["op"] == "copy"]
    lines += ["", "Copy ceiling: "
              + ", ".join(f"{r['dtype']} {r['shape']} {r['gbps']:.0f} GB/s" for r in copies) + "."]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny sizes")
    p.add_argument("--quick", action="store_true", help="fewer sizes")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device (use --dry-run to exercise the script on CPU)")
        return 2
    dev = "cpu" if args.dry_run else "cuda"
    env = environment()
    print(f"device: {env.get('gpu', 'cpu (dry run)')}; torch {env['torch']}; triton {env.get('triton')}",
          flush=True)
    sections, records = [], []

    def section(name: str, fn):
        t0 = time.time()
        try:
            failures = fn()
        except Exception:
            failures = [traceback.format_exc()[-800:]]
        sections.append({"name": name, "failures": failures, "seconds": round(time.time() - t0, 1)})
        print(f"{name}: {'ok' if not failures else f'{len(failures)} FAILED'} ({sections[-1]['seconds']} s)",
              flush=True)

    def do_correctness():
        checks = correctness(dev, args.dry_run, args.quick)
        (out / "correctness.json").write_text(json.dumps({"environment": env, "checks": checks}, indent=1))
        return [f"{c['op']} {c['dtype']} {c['shape']} ({c['check']}): {c['error']}" for c in checks
                if not c["ok"]]

    def do_bench():
        found, notes = run_bench(dev, args.dry_run, args.quick)
        records.extend(found)
        bench.write_json(str(out / "bench.json"), found, env, notes=notes)
        return [] if any(r["backend"] == "normlab" for r in found) else ["no normlab case was measured"]

    def do_copy():
        copies = [r for r in records if r["op"] == "copy"]
        return [] if copies and all(r["gbps"] > 0 for r in copies) else ["no copy was measured"]

    def do_check_model():
        record = {}
        try:
            record = check_model(dev, args.dry_run)
            return []
        except Exception as err:
            record = {"error": f"{type(err).__name__}: {err}"[:800]}
            return [record["error"]]
        finally:
            (out / "check-model.json").write_text(json.dumps(record, indent=1, default=str))

    section("correctness", do_correctness)
    section("bench", do_bench)
    section("copy", do_copy)
    section("check-model", do_check_model)
    write_summary(out, env, sections, records, args.dry_run)
    print((out / "summary.md").read_text())
    return 1 if any(s["failures"] for s in sections) else 0


if __name__ == "__main__":
    sys.exit(main())
