"""The machine and the software versions, in one place: every record, summary and `normlab info`
reports them from here."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata

def user_cache(*parts: str) -> str:
    """A folder in normlab's per-user cache: $XDG_CACHE_HOME/normlab, else ~/.cache/normlab."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "normlab", *parts)


# The packages whose versions a result depends on (distribution names), in the order shown.
PACKAGES = ("torch", "numpy", "numba", "triton", "transformers", "tokenizers", "liger-kernel")


def versions(missing: str | None = None) -> dict[str, str]:
    """normlab's, Python's and each of PACKAGES' version; a package that is not installed is left
    out, or given as ``missing`` when that is set. Read from the installed metadata: nothing is
    imported (importing transformers or triton takes seconds). torch's, once imported, is its own
    ``__version__``, which names the build (+cpu, +cu124) that a wheel's metadata may leave out."""
    out = {"python": platform.python_version()}
    for name in ("normlab", *PACKAGES):
        try:
            out[name] = metadata.version(name)
            if name == "torch" and "torch" in sys.modules:  # with its build (2.6.0+cu124, metadata: 2.6.0)
                out[name] = str(sys.modules["torch"].__version__)
        except metadata.PackageNotFoundError:
            if name == "normlab":  # run from a source tree that was never installed, as __init__ says too
                out[name] = "0.0.0+unknown"
            elif missing is not None:
                out[name] = missing
    return {"normlab": out.pop("normlab"), **out}


def _cpuinfo(*keys: str) -> str | None:
    """The value of the /proc/cpuinfo line whose key is one of ``keys``, in the first processor's
    block (Linux only; every key asked for is there, and a many-core machine's file is long)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, sep, value = line.partition(":")
                if sep and key.strip() in keys:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name with its x86 family and model numbers (or its ARM part number). A cloud
    VM may name a Zen 3, a Zen 4 and a Zen 5 alike "AMD EPYC", and the kernels' speeds differ
    between them: records, and the lab's timings cached per machine, must tell them apart."""
    family, model, part = _cpuinfo("cpu family"), _cpuinfo("model"), _cpuinfo("CPU part")
    name = _cpuinfo("model name") or ("ARM" if part else platform.processor()) or "unknown"
    if family and model:
        name += f" (family {family}, model {model})"
    elif part:
        name += f" (part {part})"
    return name


def cpu_vectors() -> str:
    """The widest vector instructions the CPU has, as a bench record names them: the CPU kernels'
    speed depends on them (x86 AVX2 or AVX-512, with or without AVX512-BF16; ARM NEON or SVE)."""
    flags = set((_cpuinfo("flags", "Features") or "").split())  # x86, ARM
    if "avx512f" in flags:
        return "AVX-512 with AVX512-BF16" if "avx512_bf16" in flags else "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    if "asimd" in flags:
        return "SVE" if "sve" in flags else "NEON"
    return "unknown"


def git_commit() -> str | None:
    """The checkout's short commit, when normlab runs from one."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def clock() -> dict:
    """What a time measured in this process depends on: the CPU, torch's thread count, the GPU."""
    import torch

    out = {"processor": cpu_name(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def environment() -> dict:
    """Machine and versions, recorded with every result."""
    import torch

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": platform.machine(), "processor": cpu_name(), "vectors": cpu_vectors(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), **versions(),
    }
    if os.environ.get("OMP_WAIT_POLICY"):  # how idle OpenMP threads wait moves a bench's interleaved cases
        env["omp_wait_policy"] = os.environ["OMP_WAIT_POLICY"]
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    commit = git_commit()
    if commit:
        env["git"] = commit
    return env
