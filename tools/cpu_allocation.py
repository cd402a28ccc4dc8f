"""How should the cpu backend allocate its outputs? Measures one fused rms_norm forward into
outputs from each allocator, interleaved round-robin, median of many rounds.

    python tools/cpu_allocation.py [--shape 8192x1024] [--dtype fp32] [--rounds 30]

prealloc: into one preallocated tensor (the floor); torch: torch.empty each call; numpy:
np.empty each call (numpy asks for transparent huge pages); pool: normlab's BufferPool (the
default); copy: y.copy_(x) into a preallocated y, for scale.
"""

import argparse
import math
import statistics
import time

import numpy as np
import torch

from normlab.bench import DTYPES, parse_shape
from normlab.env import environment
from normlab.kernels.cpu import launch, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8192x1024")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    shape, dtype = parse_shape(args.shape), DTYPES[args.dtype]
    k = max(2, math.ceil((128 << 20) / (math.prod(shape) * (torch.finfo(dtype).bits // 8))))
    xs = [torch.randn(shape).to(dtype) for _ in range(k)]
    out = torch.empty(shape, dtype=dtype)
    d = shape[-1]

    def kernel(i, y):
        return launch.rms_fwd_launch(xs[i % k], None, 1e-6, True, True, 0.0, d, y=y)

    def with_allocator(name):
        def run(i):
            previous = memory.ALLOCATOR
            memory.ALLOCATOR = name
            try:
                return kernel(i, None)
            finally:
                memory.ALLOCATOR = previous

        return run

    cases = {
        "copy": lambda i: out.copy_(xs[i % k]),
        "prealloc": lambda i: kernel(i, out),
        "torch": with_allocator("torch"),
        "numpy": with_allocator("numpy"),
        "pool": with_allocator("pool"),
    }
    times = {name: [] for name in cases}
    for i in range(2):
        for fn in cases.values():
            fn(i)
    for i in range(args.rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            result = fn(i)
            times[name].append(time.perf_counter() - t0)
            del result  # a freed output goes back to the pool before the next round
    env = environment()
    print(f"{env['date']}  {env['processor']}, {env['torch_threads']} threads, torch {env['torch']}, numba "
          f"{env.get('numba')}")
    print(f"rms_norm forward, {args.dtype} {args.shape}, median of {args.rounds} interleaved rounds")
    floor = statistics.median(times["prealloc"])
    print(f"{'allocator':<10} {'ms':>8} {'x prealloc':>11}")
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"{name:<10} {ms:8.3f} {ms / (floor * 1e3):11.2f}")


if __name__ == "__main__":
    np.random.seed(0)
    main()
