"""Interleaved A/B of two source trees of normlab through autograd: the call users make.

    python tools/autograd_ab.py OLD_SRC NEW_SRC [--ops ln,rms] [--shapes 8192x1024,...]
                                     [--dtype bf16|fp32] [--rounds 12] [--calls 15]

cpu_ab.py compares two kernel files in one process; this compares everything a backward goes
through (the autograd engine, the Function, the launcher, the kernel), where one process cannot
hold two versions of the package. One worker process per tree (PYTHONPATH=OLD_SRC or NEW_SRC)
builds its inputs, then waits; the workers take turns (A, B, then B, A), each timing
``torch.autograd.grad`` of a fresh forward ``--calls`` times, so both meet the same state of a
host whose memory bandwidth drifts. Reports each one's median time and B's speedup over A as
the median of the per-round ratios with their range. Example, the working tree against a commit::

    git worktree add /tmp/old COMMIT
    python tools/autograd_ab.py /tmp/old/src src --ops ln,rms --shapes 8192x1024
"""

import argparse
import os
import statistics
import subprocess
import sys

WORKER = r"""
import sys, time, statistics, torch
import normlab.functional as F
op, n, d, dtype, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
torch.manual_seed(0)
xs = [torch.randn(n, d, dtype=dt).requires_grad_() for _ in range(3)]
dys = [torch.randn(n, d, dtype=dt) for _ in range(3)]
w, b = (torch.randn(d, dtype=dt, requires_grad=True) for _ in range(2))

def backward(i):
    x, dy = xs[i % 3], dys[i % 3]
    if op == "ln":
        y, inputs = F.layer_norm(x, w, b, backend="cpu"), [x, w, b]
    else:
        y, inputs = F.rms_norm(x, w, backend="cpu"), [x, w]
    t0 = time.perf_counter()
    torch.autograd.grad(y, inputs, dy)
    return time.perf_counter() - t0

for i in range(5):
    backward(i)  # compile, first touch
print("ready", flush=True)
for _ in sys.stdin:
    print(statistics.median(backward(i) for i in range(calls)), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--ops", default="ln,rms")
    parser.add_argument("--shapes", default="8192x1024,4096x4096,1024x16384")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    for op in args.ops.split(","):
        if op not in ("ln", "rms"):
            parser.error(f"--ops: unknown op {op!r}; choose from ln, rms")
        for shape in args.shapes.split(","):
            n, d = shape.split("x")
            workers = []
            for src in (args.old, args.new):
                env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
                cmd = [sys.executable, "-c", WORKER, op, n, d, args.dtype, str(args.calls)]
                workers.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                                env=env))
            try:
                for w in workers:
                    if w.stdout.readline().strip() != "ready":
                        raise SystemExit(f"a worker failed to start (PYTHONPATH={args.old} or {args.new})")
                times = ([], [])
                for r in range(args.rounds):
                    for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                        workers[k].stdin.write("go\n")
                        workers[k].stdin.flush()
                        times[k].append(float(workers[k].stdout.readline()))
            finally:
                for w in workers:
                    w.stdin.close()
                    w.wait()
            gain = [a / b for a, b in zip(*times)]
            print(f"{op:3s} {shape:>10s} {args.dtype}: A {statistics.median(times[0]) * 1e3:.3f} ms"
                  f"  B {statistics.median(times[1]) * 1e3:.3f} ms;  B speedup {statistics.median(gain):.3f}"
                  f" (range {min(gain):.2f}-{max(gain):.2f})", flush=True)


if __name__ == "__main__":
    main()
