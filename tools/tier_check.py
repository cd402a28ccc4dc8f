"""Does a fresh process load the shipped kernels (tiers) instead of compiling them?

    python tools/tier_check.py [--ops rms_norm,layer_norm] [--dtypes fp32,bf16] [--as-cpu NAME]
    bash tools/qemu_arm.sh python tools/tier_check.py --as-cpu neoverse-n1    # ARM64, emulated

With an empty numba cache, makes `normlab warmup`'s calls for the ops and dtypes (every signature
a model meets), checks rms_norm and layer_norm, forward and input gradient, against the float64
reference within the bound of normlab.testing, then prints the level and how many kernels were
loaded and compiled. Exit status 1 if any kernel was compiled (or none loaded) or a result is out
of bound. tools/check_wheel.sh runs it on the installed release wheel.

Under emulation LLVM sees a CPU named "generic" with no features, whose own cache key is the
aarch64 level's: ``--as-cpu NAME`` makes LLVM report a real CPU instead (numba's key then names
it, as on that machine), so what the process finds must come from the level.
"""

import argparse
import functools
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

if importlib.util.find_spec("normlab") is None:  # an installed normlab (a wheel's) first, else the checkout's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="rms_norm,layer_norm", help="as `normlab warmup --ops`")
    parser.add_argument("--dtypes", default="fp32,bf16", help="as `normlab warmup --dtypes`")
    parser.add_argument("--as-cpu", help="the CPU name LLVM reports (features: NEON's on ARM64)")
    args = parser.parse_args()
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="normlab-tier-check-")
    if args.as_cpu:
        from llvmlite import binding as llvm

        host = llvm.get_host_cpu_features()
        if llvm.get_process_triple().startswith("aarch64"):
            host.update({"neon": True, "fp-armv8": True})
        llvm.get_host_cpu_name = lambda: args.as_cpu
        llvm.get_host_cpu_features = lambda: host

    import torch

    from normlab import commands, reference
    from normlab.bench import DTYPES
    from normlab import functional as F
    from normlab.kernels import cpu
    from normlab.testing import assert_close

    ops, dtypes = args.ops.split(","), args.dtypes.split(",")
    levels = ", ".join(level for level, _ in cpu.cache.host_tiers()) or "none"
    print(f"normlab from {Path(cpu.__file__).parents[2]}; levels, best first: {levels}; numba's key for "
          f"this CPU: {cpu.cache.llvm.get_host_cpu_name()!r}")
    t0 = time.perf_counter()
    for _, call in commands.warmup_calls(ops, dtypes):
        call()
    seconds = time.perf_counter() - t0

    torch.manual_seed(0)
    checked = 0
    for name in dtypes:
        dtype = DTYPES[name]
        for op in (o for o in ("rms_norm", "layer_norm") if o in ops):
            x = (torch.randn(6, 1000, dtype=torch.float64) * 3 + 1).to(dtype)
            w = torch.randn(1000, dtype=torch.float64).to(dtype)
            dy = torch.randn(6, 1000, dtype=torch.float64).to(dtype)
            args_of = (lambda t, u: (t, u)) if op == "rms_norm" else (lambda t, u: (t, u, u))
            results = []
            fused, plain = functools.partial(getattr(F, op), backend="cpu"), getattr(reference, op)
            for fn, d in ((fused, dtype), (plain, dtype), (plain, torch.float64)):
                xi = x.to(d).clone().requires_grad_()
                y = fn(*args_of(xi, w.to(d)))
                y.backward(dy.to(d))
                results.append((y, xi.grad))
            (y, dx), (ly, ldx), (ty, tdx) = results
            assert_close(y, ty, lowp=ly, name=f"{op} {name} output")
            assert_close(dx, tdx, lowp=ldx, name=f"{op} {name} dx", rule="row")
            checked += 1
    print(f"{checked} op and dtype pairs within normlab.testing's bound of the float64 reference")
    compiled, loaded = cpu.compiled_and_loaded()
    print(f"{loaded} kernels loaded, {compiled} compiled (warmup's calls took {seconds:.1f} s)")
    return 1 if compiled or not loaded else 0


if __name__ == "__main__":
    sys.exit(main())
