"""Compile every Triton kernel specialization normlab can launch, for real GPUs, without one.

    python tools/triton_compile.py [--targets 80,90] [--hidden 64,4096,16384,262144] [--jobs 2]
                                   [--json OUT.json]

TRITON_INTERPRET runs the kernels' Python with numpy semantics and never calls Triton's compiler,
so a kernel can pass every interpreter test and still fail to compile, spill registers or need
more shared memory than a GPU has. Triton compiles for a target GPU on a CPU-only machine with the
ptxas its wheel ships: this tool does that for every spec ``normlab.kernels.triton.reachable_specs``
returns (the launchers' own choice functions), down to the cubin, and reports per spec and target
the registers and spill bytes ptxas printed, the shared memory, and whether the PTX declares
``.local`` memory. Compiled kernels land in Triton's cache (keyed by source and options), and
ptxas's figures in normlab-ptxas.json beside it, so a second run only reads them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import re
import sys
import time
import warnings

# The compiler, not the interpreter: this must be unset before triton is imported.
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from normlab.kernels import _triton as K  # noqa: E402
from normlab.kernels import triton as T  # noqa: E402

# Shared memory a block may use (the opt-in maximum): A100 (sm_80) 163 KiB, H100/H200 (sm_90) 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
FP_FUSION_UNSET = "TRITON_DEFAULT_FP_FUSION is unset"


def signature(spec: T.Spec) -> tuple[dict, dict]:
    """(Triton signature, constexprs) of a spec: pointers by their element dtype, strides i64,
    eps and offset fp32, the other integers i32."""
    fn = getattr(K, spec.kernel)
    pointers, flags = dict(spec.pointers), dict(spec.constexprs)
    sig = {}
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + TYPES[pointers[name]]
        else:
            sig[name] = "i64" if name.startswith("stride") else "fp32" if name in ("eps", "offset") else "i32"
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in flags]
    if missing:
        raise ValueError(f"{spec.kernel}'s spec sets no value for constexpr {', '.join(missing)}")
    return sig, flags


def _ptxas_figures(log: str) -> dict:
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    return {"spill_bytes": max(spills, default=0), "registers": max(regs, default=0)} if regs else {}


def compile_one(job: tuple[int, T.Spec, int]) -> dict:
    index, spec, capability = job
    sig, flags = signature(spec)
    out = io.StringIO()
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
        warnings.simplefilter("always")
        try:
            kernel = triton.compile(ASTSource(fn=getattr(K, spec.kernel), signature=sig, constexprs=flags),
                                    target=GPUTarget("cuda", capability, 32), options=spec.options())
        except Exception as e:  # a compile error is a result to report, not a crash of the run
            return {"index": index, "target": capability, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}
    result = {
        "index": index, "target": capability, "seconds": round(time.perf_counter() - t0, 3), "hash": kernel.hash,
        "cubin_bytes": len(kernel.asm.get("cubin", b"")), "shared": kernel.metadata.shared,
        "ptx_local": bool(re.search(r"^\s*\.local\b", kernel.asm["ptx"], re.M)),
        "fp_fusion_warning": any(FP_FUSION_UNSET in str(w.message) for w in caught),
        **_ptxas_figures(out.getvalue()),
    }
    return result


def _figures_file() -> str:
    return os.path.join(triton.knobs.cache.dir, "normlab-ptxas.json")


def run(targets: list[int], hidden: tuple[int, ...], jobs: int, progress=None) -> dict:
    specs = T.reachable_specs(hidden)
    work = [(i, spec, cap) for cap in targets for i, spec in enumerate(specs)]
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    results = []
    with ctx.Pool(jobs) as pool:
        for r in pool.imap_unordered(compile_one, work, chunksize=4):
            results.append(r)
            if progress:
                progress(len(results), len(work))
    # ptxas prints its figures only when it runs: keep them by kernel hash for runs that hit the cache
    path = _figures_file()
    known = json.loads(open(path).read()) if os.path.exists(path) else {}
    for r in results:
        if "registers" in r:
            known[r["hash"]] = {"spill_bytes": r["spill_bytes"], "registers": r["registers"]}
        elif r.get("hash") in known:
            r.update(known[r["hash"]], ptxas="cached")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(known, f)
    os.replace(path + ".tmp", path)
    results.sort(key=lambda r: (r["target"], r["index"]))
    return {"specs": [{"kernel": s.kernel, "pointers": {k: TYPES[v] for k, v in s.pointers}, "constexprs": dict(s.constexprs),
                       "num_warps": s.num_warps} for s in specs],
            "results": results, "seconds": round(time.perf_counter() - t0, 1), "triton": triton.__version__,
            "shared_limit": {str(k): v for k, v in SHARED_LIMIT.items()}}


def problems(report: dict) -> list[str]:
    """Every failure in a run's report, one line each."""
    out = []
    for r in report["results"]:
        spec = report["specs"][r["index"]]
        where = f"sm_{r['target']} {spec['kernel']} {spec['constexprs']} {spec['num_warps']} warps"
        if "error" in r:
            out.append(f"{where}: does not compile: {r['error'][-300:]}")
            continue
        if not r["cubin_bytes"]:
            out.append(f"{where}: no cubin")
        if r["ptx_local"]:
            out.append(f"{where}: the PTX declares .local memory")
        if "registers" not in r:
            out.append(f"{where}: no ptxas figures (cached kernel, figures file lost: clear Triton's cache)")
        elif r["spill_bytes"]:
            out.append(f"{where}: ptxas spills {r['spill_bytes']} bytes ({r['registers']} registers)")
        if r["shared"] > SHARED_LIMIT[r["target"]]:
            out.append(f"{where}: {r['shared']} bytes of shared memory, over sm_{r['target']}'s {SHARED_LIMIT[r['target']]}")
        if r["fp_fusion_warning"]:
            out.append(f"{where}: floating-point fusion left to Triton's default")
    return out


def _progress(done: int, total: int) -> None:
    if done % 50 == 0 or done == total:
        print(f"{done}/{total} compiled", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="80,90", help="compute capabilities, comma-separated")
    parser.add_argument("--hidden", default="64,4096,16384,262144", help="hidden sizes whose block choices to compile")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    targets = [int(t) for t in args.targets.split(",")]
    hidden = tuple(int(h) for h in args.hidden.split(","))
    report = run(targets, hidden, args.jobs, progress=_progress)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    found = problems(report)
    for line in found:
        print(line)
    regs = [r.get("registers", 0) for r in report["results"]]
    print(f"{len(report['results'])} compiles ({len(report['specs'])} specs x {len(targets)} targets) in {report['seconds']} s; "
          f"{len(found)} problems; at most {max(regs, default=0)} registers")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
