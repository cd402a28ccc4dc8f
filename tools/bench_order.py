"""Does what ran before a timed call change it, even after the bench's cache read?

    python tools/bench_order.py [--before peers|tiny|alloc64|write64|readop] [--rounds 40]
                                [--shape 8192x1024] [--dtype bf16]

`normlab bench` reads 128 MiB before each timed call so that no call starts with its data in the
cache, and rotates the cases' order each round. This checks what that read leaves: each round
times every call twice, in alternating order, (A) read then call, and (B) ``--before`` untimed,
read, call. It prints the medians and the median of the per-round ratios B / A with their
quartiles, for normlab's rms_norm kernel alone, its allocating call, its call into ``out=``, and
the bench's copy. ``--before``:

- ``peers``: one call of each CPU peer of the bench (torch, torch-module, hf, compile) on the same shape;
- ``tiny``: the same peers' code on a 4-row tensor (their Python, no large memory);
- ``alloc64``: a fresh 64 MiB float32 tensor written and freed;
- ``write64``: the same 64 MiB written, allocated once (no fresh pages, no free);
- ``readop``: a sum over one input (a multithreaded read, no allocation).

docs/cpu-kernels.md, "How the bench clears the cache", has what it found on the Zen 5.
"""

import argparse
import statistics
import time

import numpy as np
import torch

import normlab
from normlab.bench import DTYPES, make_peer, parse_shape, scrubber
from normlab.kernels.cpu import launch as L
from normlab.kernels.cpu import memory, rmsnorm

BEFORE = ("peers", "tiny", "alloc64", "write64", "readop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="peers", choices=BEFORE)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--shape", default="8192x1024")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    n, d = parse_shape(args.shape)
    dt = DTYPES[args.dtype]
    cpu = torch.device("cpu")
    xs = [torch.randn(n, d).to(dt) for _ in range(8)]
    w, out = torch.randn(d).to(dt), torch.empty(n, d, dtype=dt)
    scrub = scrubber(cpu)
    peers = [make_peer(p, "rms_norm", d, dt, cpu) for p in ("torch", "torch-module", "hf", "compile")]
    tiny, keep = [torch.randn(4, d).to(dt) for _ in range(2)], torch.empty(1 << 24)
    for p in peers:  # compiled and warm for both shapes before any timing
        p.fn(xs[0], None)
        p.fn(tiny[0], None)

    def before(i: int) -> None:
        if args.before in ("peers", "tiny"):
            for p in peers:
                p.fn(xs[(i + 3) % 8] if args.before == "peers" else tiny[i % 2], None)
        elif args.before == "alloc64":
            torch.empty(1 << 24).fill_(1.0)
        elif args.before == "write64":
            keep.fill_(1.0)
        else:
            xs[(i + 3) % 8].sum()

    rows = (n, d)
    yn, rn = L._at(out, rows), np.empty(n, np.float32)
    wn, rnd = L._at(w, (d,)), L._round_to(dt, True)
    calls = {
        "kernel": lambda i: rmsnorm.rms_fwd(L._at(xs[i % 8], rows), wn, yn, rn, 1e-6, True, d, rnd,
                                            *L._stages(out.nbytes, n),
                                            memory.prefetch_far(d * xs[0].itemsize),
                                            memory.prefetch_skip(d * xs[0].itemsize)),
        "alloc": lambda i: normlab.rms_norm(xs[i % 8], w, 1e-6),
        "out=": lambda i: normlab.rms_norm(xs[i % 8], w, 1e-6, out=out),
        "copy": lambda i: out.copy_(xs[i % 8]),
    }
    print(f"before each B call: {args.before}; {args.shape} {args.dtype}, {args.rounds} rounds")
    for name, call in calls.items():
        call(0)
        times = {"A": [], "B": []}
        for r in range(args.rounds):
            for mode in ("A", "B") if r % 2 else ("B", "A"):
                if mode == "B":
                    before(r)
                scrub()
                t0 = time.perf_counter()
                call(r)
                times[mode].append(time.perf_counter() - t0)
        ratios = [b / a for a, b in zip(times["A"], times["B"])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"{name:7s} A {1e3 * statistics.median(times['A']):.3f} ms  B "
              f"{1e3 * statistics.median(times['B']):.3f} ms  B/A {statistics.median(ratios):.3f} (quartiles "
              f"{q1:.3f}-{q3:.3f})")


if __name__ == "__main__":
    main()
