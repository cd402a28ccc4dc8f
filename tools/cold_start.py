"""First-call latency of the cpu backend in a new process (numba's on-disk cache warm or cold).

    python tools/cold_start.py [--cold]

Runs a child process that imports normlab and times its first rms_norm call (a 64x1024 fp32
tensor), three times. ``--cold`` points numba at an empty cache directory for the first run,
so that run shows the compile cost and the next two the cache.
"""

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import normlab
t2 = time.perf_counter()
normlab.rms_norm(torch.randn(64, 1024))
t3 = time.perf_counter()
print(f"{t1 - t0:.2f} {t2 - t1:.2f} {t3 - t2:.2f}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true", help="start from an empty numba cache")
    args = parser.parse_args()
    env = dict(os.environ)
    cache = tempfile.mkdtemp(prefix="normlab-numba-") if args.cold else None
    if cache:
        env["NUMBA_CACHE_DIR"] = cache
    print(f"{'run':<5} {'import torch':>12} {'import normlab':>14} {'first rms_norm call':>20}")
    for run in range(3):
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
        a, b, c = out.stdout.split()
        print(f"{run + 1:<5} {a + ' s':>12} {b + ' s':>14} {c + ' s':>20}")


if __name__ == "__main__":
    main()
