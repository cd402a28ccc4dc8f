"""Compile every Triton kernel specialization normlab can launch, for real GPUs, without one.

    python tools/triton_compile.py [--targets 80,90] [--hidden 64,4096,16384,262144] [--jobs 2]
                                   [--kernels norm_fwd,...] [--cache DIR] [--json OUT.json]

TRITON_INTERPRET runs the kernels' Python with numpy semantics and never calls Triton's compiler,
so a kernel can pass every interpreter test and still fail to compile, spill registers or need
more shared memory than a GPU has. Triton compiles for a target GPU on a CPU-only machine with the
ptxas its wheel ships: this tool does that for every spec ``normlab.kernels.triton.launch.reachable_specs``
returns (the launchers' own choice functions), down to the cubin, and reports per spec and target
the registers and spill bytes ptxas printed, the shared memory, and whether the PTX declares
``.local`` memory.

ptxas prints its figures only when it runs, so each compile runs in a fresh Triton cache of its own
(never Triton's shared one, which other processes may have left without figures), and its result is
kept in this tool's cache (``--cache``, default ~/.cache/normlab/triton-compile), one file per
compile keyed by Triton's version, the kernels' source, the spec and the target: a second run
reads them, and two runs at once each write whole files.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
import warnings

# The compiler, not the interpreter: this must be unset before triton is imported.
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from normlab import env  # noqa: E402
from normlab.kernels.triton import kernels as K  # noqa: E402
from normlab.kernels.triton import launch as T  # noqa: E402

# Shared memory a block may use (the opt-in maximum): A100 (sm_80) 163 KiB, H100/H200 (sm_90) 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
FP_FUSION_UNSET = "TRITON_DEFAULT_FP_FUSION is unset"
KERNEL_SOURCE = open(K.__file__, "rb").read()


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
    spills = [int(a) + int(b)
              for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    return {"spill_bytes": max(spills, default=0), "registers": max(regs, default=0)} if regs else {}


def _key(spec: T.Spec, capability: int) -> str:
    """What a compile's result depends on: Triton, the kernels' source, the spec, the target."""
    sig, flags = signature(spec)
    text = repr((triton.__version__, sorted(sig.items()), sorted(flags.items()),
                 sorted(spec.options().items()), capability,
                 spec.kernel, os.environ.get("TRITON_DEFAULT_FP_FUSION")))
    return hashlib.sha256(KERNEL_SOURCE + text.encode()).hexdigest()[:32]


def _compile(spec: T.Spec, capability: int) -> dict:
    sig, flags = signature(spec)
    out = io.StringIO()
    t0 = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="normlab-triton-") as fresh,
        warnings.catch_warnings(record=True) as caught,
        contextlib.redirect_stdout(out),
    ):
        warnings.simplefilter("always")
        triton.knobs.cache.dir = fresh  # a cache hit would skip ptxas and its figures
        try:
            kernel = triton.compile(ASTSource(fn=getattr(K, spec.kernel), signature=sig, constexprs=flags),
                                    target=GPUTarget("cuda", capability, 32), options=spec.options())
        except Exception as e:  # a compile error is a result to report, not a crash of the run
            return {"target": capability, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}
        return {
            "target": capability, "seconds": round(time.perf_counter() - t0, 3), "hash": kernel.hash,
            "cubin_bytes": len(kernel.asm.get("cubin", b"")), "shared": kernel.metadata.shared,
            "ptx_local": bool(re.search(r"^\s*\.local\b", kernel.asm["ptx"], re.M)),
            "fp_fusion_warning": any(FP_FUSION_UNSET in str(w.message) for w in caught),
            **_ptxas_figures(out.getvalue()),
        }


def _read_kept(path: str) -> dict | None:
    """A kept result, or None when there is none or it cannot be read whole (then it is redone)."""
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and "registers" in result else None


def _kept(job: tuple[int, T.Spec, int], cache: str | None) -> dict | None:
    index, spec, capability = job
    result = _read_kept(os.path.join(cache, _key(spec, capability) + ".json")) if cache else None
    return None if result is None else {**result, "index": index, "kept": True}


def compile_one(job: tuple[int, T.Spec, int], cache: str | None = None) -> dict:
    """One spec compiled for one target, or its kept result."""
    kept = _kept(job, cache)
    if kept is not None:
        return kept
    index, spec, capability = job
    result = _compile(spec, capability)
    if cache and "registers" in result:
        os.makedirs(cache, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cache, suffix=".tmp", delete=False) as f:
            json.dump(result, f)
        os.replace(f.name, os.path.join(cache, _key(spec, capability) + ".json"))
    return {**result, "index": index}


def run(targets: list[int], hidden: tuple[int, ...], jobs: int, progress=None, cache: str | None = None,
        kernels: tuple[str, ...] | None = None) -> dict:
    specs = [s for s in T.reachable_specs(hidden) if not kernels or s.kernel in kernels]
    jobs_all = [(i, spec, cap) for cap in targets for i, spec in enumerate(specs)]
    t0 = time.perf_counter()
    results = [r for r in (_kept(job, cache) for job in jobs_all) if r is not None]
    done = {(r["index"], r["target"]) for r in results}
    work = [job for job in jobs_all if (job[0], job[2]) not in done]
    if work:  # workers only for what is not kept: each one imports torch and Triton
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for r in pool.imap_unordered(functools.partial(compile_one, cache=cache), work, chunksize=4):
                results.append(r)
                if progress:
                    progress(len(results), len(jobs_all))
    results.sort(key=lambda r: (r["target"], r["index"]))
    return {"specs": [{"kernel": s.kernel, "pointers": {k: TYPES[v] for k, v in s.pointers},
                       "constexprs": dict(s.constexprs),
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
            out.append(f"{where}: ptxas printed no register figures")
        elif r["spill_bytes"]:
            out.append(f"{where}: ptxas spills {r['spill_bytes']} bytes ({r['registers']} registers)")
        if r["shared"] > SHARED_LIMIT[r["target"]]:
            out.append(f"{where}: {r['shared']} bytes of shared memory, over sm_{r['target']}'s "
                       f"{SHARED_LIMIT[r['target']]}")
        if r["fp_fusion_warning"]:
            out.append(f"{where}: floating-point fusion left to Triton's default")
    return out


def _progress(done: int, total: int) -> None:
    if done % 50 == 0 or done == total:
        print(f"{done}/{total} compiled", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="80,90", help="compute capabilities, comma-separated")
    parser.add_argument("--hidden", default="64,4096,16384,262144",
                        help="hidden sizes whose block choices to compile")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--kernels", help="only these kernels (comma-separated, e.g. dyt_fwd,dyt_bwd)")
    parser.add_argument("--cache", default=env.user_cache("triton-compile"),
                        help="where results are kept between runs ('' for none)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    targets = [int(t) for t in args.targets.split(",")]
    hidden = tuple(int(h) for h in args.hidden.split(","))
    kernels = tuple(args.kernels.split(",")) if args.kernels else None
    report = run(targets, hidden, args.jobs, progress=_progress, cache=args.cache or None, kernels=kernels)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    found = problems(report)
    for line in found:
        print(line)
    regs = [r.get("registers", 0) for r in report["results"]]
    kept = sum(1 for r in report["results"] if r.get("kept"))
    print(f"{len(report['results'])} compiles ({len(report['specs'])} specs x {len(targets)} targets, {kept} "
          f"kept from {args.cache or 'no cache'}) in {report['seconds']} s; {len(found)} problems; at most "
          f"{max(regs, default=0)} registers")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
