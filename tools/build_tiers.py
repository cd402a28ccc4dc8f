"""Compile the fused CPU kernels ahead of time for portable CPU levels, for a platform wheel.

    python tools/build_tiers.py [--tiers x86-64-v4-bf16,x86-64-v4,x86-64-v3] [--ops ...] [--dtypes ...]
        [--out DIR]
    python tools/build_tiers.py --tiers aarch64      # on x86-64: under tools/qemu_arm.sh (its setup first)

Each level is compiled in its own process whose numba targets that level (NUMBA_CPU_NAME=<level>,
no extra features; x86-64-v4-bf16 is x86-64-v4 with +avx512bf16, built for the bf16 kernels only)
and writes its cache to DIR/<level>/ (default: the package's kernels/cpu/tiers/, which the wheel
ships). That process makes `normlab warmup`'s calls with every kernel replaced by its compilation
for the arguments it gets: code for a level this machine lacks (AVX-512 on an AVX2 CPU) is
compiled, never run, so any x86-64 machine can build every x86-64 level. numba cannot compile
for another machine, so on x86-64 the ARM64 level is compiled by an ARM64 Python under emulation
(tools/qemu_arm.sh: slow, 10-50x, but the code is the same). The result is tied to this numba and
Python version: build a wheel per Python version, as platform wheels are anyway. Without --tiers,
the levels of this machine."""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from normlab.kernels.cpu.cache import (EXTENDED, TIERS, TIERS_DIR, level_arch, llvm_target,  # noqa: E402
                                       process_arch)


def levels_for(arch: str) -> list[str]:
    """The levels whose code runs on ``arch`` ("x86_64", "aarch64"), best first."""
    return [level for level in TIERS if level_arch(level) == arch]


def build(level: str, out: Path, ops: str | None = None, dtypes: str | None = None) -> float | None:
    """Compile the warmup signatures for ``level`` into out/<level>/; returns the seconds it took.
    A level that extends another (cache.EXTENDED) gets only the dtypes its features change (None:
    ``dtypes`` holds none of them)."""
    if level not in TIERS:
        raise ValueError(f"--tiers takes levels from {', '.join(TIERS)}; got {level!r}")
    if level in EXTENDED:
        only = EXTENDED[level][2].split(",")
        dtypes = ",".join(d for d in (dtypes.split(",") if dtypes else only) if d in only)
        if not dtypes:
            return None
    cpu_name, features = llvm_target(level)
    env = {**os.environ, "NUMBA_CPU_NAME": cpu_name, "NUMBA_CPU_FEATURES": features,
           "NUMBA_CACHE_DIR": str(out / level),
           "NORMLAB_CPU_TIERS": "off",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    python = [sys.executable]
    if level_arch(level) != process_arch():
        if level_arch(level) != "aarch64":
            raise ValueError(f"{level} can only be built on an x86-64 machine: numba compiles for the "
                             "machine it runs on")
        python = ["bash", str(ROOT / "tools" / "qemu_arm.sh"), "python"]
    cmd = [*python, __file__, "--compile-only", "--ops", ops or "", "--dtypes", dtypes or ""]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    # numba puts a NUMBA_CACHE_DIR entry under a folder named after the source tree's path; the
    # tier is read from out/<level>/normlab-<sources hash>/ wherever the package is installed
    for folder in list((out / level).glob("*/normlab-*")):
        target = out / level / folder.name
        if target.exists():
            shutil.rmtree(target)
        folder.rename(target)
        folder.parent.rmdir()
    return time.perf_counter() - t0


def compile_only(ops: str, dtypes: str) -> None:
    """In the level's process: warmup's calls, each kernel compiled for its arguments, not run."""
    import numba

    from normlab import commands
    from normlab.kernels.cpu import KERNELS, launch

    def compiler(dispatcher):
        return lambda *args: dispatcher.compile(tuple(numba.typeof(a) for a in args))

    for name in [k.__name__ for k in KERNELS] + ["start_threads"]:
        setattr(launch, name, compiler(getattr(launch, name)))
    defaults = ((ops, commands.WARMUP_OPS), (dtypes, commands.WARMUP_DTYPES))
    calls = commands.warmup_calls(*[v.split(",") if v else default for v, default in defaults])
    for _, call in calls:
        call()  # outputs are left unwritten: nothing reads them but the next compile-only call
    print(f"{sum(len(k.signatures) for k in KERNELS)} kernel signatures compiled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default=",".join(levels_for(process_arch())),
                        help="comma-separated levels (default: this machine's)")
    parser.add_argument("--ops", help="as `normlab warmup --ops` (default: every op)")
    parser.add_argument("--dtypes", help="as `normlab warmup --dtypes` (default: every dtype)")
    parser.add_argument("--out", default=TIERS_DIR, help="the tiers folder (default: the package's)")
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)  # the level's process
    args = parser.parse_args()
    if args.compile_only:
        return compile_only(args.ops, args.dtypes)
    for level in args.tiers.split(","):
        seconds = build(level.strip(), Path(args.out), args.ops, args.dtypes)
        print(f"{level}: compiled in {seconds:.0f} s into {Path(args.out) / level}" if seconds is not None
              else
              f"{level}: nothing to build (it holds only {EXTENDED[level.strip()][2]} kernels)")


if __name__ == "__main__":
    main()
