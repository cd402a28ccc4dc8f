"""First-call latency of the cpu backend in a new process (numba's on-disk cache warm or cold).

    python tools/cold_start.py [--cold] [--dtype bf16] [--shape 64x4096]

Runs a child process that imports normlab and times its first rms_norm forward and backward
(by default a bf16 (64, 4096) tensor with a weight), three times. ``--cold`` points numba at an
empty cache directory for the first run, so that run shows the compile cost and the next two
the cache.
"""

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import normlab
t2 = time.perf_counter()
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[sys.argv[1]]
rows, d = (int(v) for v in sys.argv[2].split("x"))
x = torch.randn(rows, d, dtype=dtype, requires_grad=True)
w = torch.randn(d, dtype=dtype, requires_grad=True)
y = normlab.rms_norm(x, w)
t3 = time.perf_counter()
y.backward(torch.randn_like(y))
t4 = time.perf_counter()
print(f"{t1 - t0:.2f} {t2 - t1:.2f} {t3 - t2:.2f} {t4 - t3:.2f}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true", help="start from an empty numba cache")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--shape", default="64x4096", help="ROWSxHIDDEN")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.cold:
        env["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="normlab-numba-")
    print(f"rms_norm {args.dtype} {args.shape}, with a weight")
    print(f"{'run':<5} {'import torch':>12} {'import normlab':>14} {'first forward':>14} "
          f"{'first backward':>15} {'both':>6}")
    for run in range(3):
        out = subprocess.run([sys.executable, "-c", CHILD, args.dtype, args.shape], env=env,
                             capture_output=True, text=True,
                             check=True)
        a, b, c, d = out.stdout.split()
        print(f"{run + 1:<5} {a + ' s':>12} {b + ' s':>14} {c + ' s':>14} {d + ' s':>15} "
              f"{float(c) + float(d):>4.1f} s")


if __name__ == "__main__":
    main()
