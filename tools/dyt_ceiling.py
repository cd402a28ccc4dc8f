"""How fast DyT's CPU kernels could be here, if memory cost nothing: the compute ceiling.

    python tools/dyt_ceiling.py [--shape 4096x4096] [--threads 2]

DyT reads and writes each element once, like a copy, but its tanh is some 30 vector operations
per 16 values. This times the kernels' 16-lane blocks on one row that stays in L1 (no memory
traffic: pure compute) and scales that to the shape on ``--threads`` cores: the least time the
kernels could take. A copy of the tensor, and the kernels on it, are timed in the same run, so
the table shows the fraction of copy the kernels reach and the most they could reach here.
"""

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("NUMBA_CACHE_DIR", tempfile.mkdtemp(prefix="normlab-ceiling-"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numba import njit  # noqa: E402

from normlab.bench import rotation  # noqa: E402
from normlab.kernels.cpu import pointwise as K  # noqa: E402
from normlab.kernels.cpu import launch as L  # noqa: E402
from normlab.kernels.cpu.simd import STAGE_WIDTH  # noqa: E402

ROW = 4096  # 8-16 KiB a row, with its outputs and partial rows well inside L1
REPS = 5000
_FWD_BLOCKS, _BWD_BLOCKS = K._y_blocks, K._GRAD_BLOCKS[1]  # plain stores, as below the streaming size


@njit
def _forward(y, x, w, b, stage, a, table, reps):
    use = table.shape[0] > 0
    for _ in range(reps):
        _FWD_BLOCKS(y, 0, x.shape[0], x, w, b, stage, a, None, False, table, use, False, 0)


@njit
def _backward(dx, dy, x, w, dwc, dbc, stage, a, table, reps):
    use = table.shape[0] > 0
    total = 0.0
    for _ in range(reps):
        total += _BWD_BLOCKS(dx, 0, x.shape[0], dy, x, w, dwc, dbc, stage, a, None, False, table, use,
                             False, 0)[0]
    return total


def _row(dtype: str) -> np.ndarray:
    x = (np.random.default_rng(0).standard_normal(ROW)).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bf16" else x


def compute_ns(dtype: str, pass_: str, shape: tuple[int, int]) -> float:
    """Nanoseconds per element on one core, the row in L1 (best of 5), by the path the launcher
    takes at ``shape`` (for bf16 from DYT_TABLE_MIN elements: the table, filled by the kernel)."""
    x = _row(dtype)
    w = np.ones(ROW, np.float32)
    stage = np.zeros(STAGE_WIDTH, np.float32)
    a = np.float32(0.5)
    table = K.table_for(np.empty(shape, x.dtype), pass_ == "bwd")
    if table.size:  # the kernel fills it: one small call
        rows = np.stack([x[:64]] * 2)
        if pass_ == "fwd":
            K.pointwise_fwd(rows, a, None, w[:64], w[:64], rows.copy(),
                            np.zeros((1, STAGE_WIDTH), np.float32), False, table, False, 0)
        else:
            K.pointwise_bwd(rows, rows, a, None, w[:64], rows.copy(), np.zeros((1, 2)), np.zeros((1, 64)),
                            np.zeros((1, 64)),
                      np.zeros((1, STAGE_WIDTH), np.float32), False, table, False, 0)
    if pass_ == "fwd":
        y = x.copy()
        run = lambda reps: _forward(y, x, w, w, stage, a, table, reps)  # noqa: E731
    else:
        dx, dy, dwc, dbc = x.copy(), x.copy(), np.zeros(ROW, np.float32), np.zeros(ROW, np.float32)
        run = lambda reps: _backward(dx, dy, x, w, dwc, dbc, stage, a, table, reps)  # noqa: E731
    run(1)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        run(REPS)
        best = min(best, time.perf_counter() - t)
    return best / REPS / ROW * 1e9


def measured_ms(shape: tuple[int, int], dtype: str, rounds: int = 30) -> dict[str, float]:
    """Medians of a copy and of the forward and backward launchers (the kernels and their setup),
    interleaved round by round on inputs rotated as ``normlab bench`` rotates them."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    k = rotation(shape, torch_dtype)
    xs, dys = ([torch.randn(shape).to(torch_dtype) for _ in range(k)] for _ in range(2))
    alpha, w, b = torch.tensor([0.5]), torch.ones(shape[1],
                                                  dtype=torch_dtype), torch.zeros(shape[1], dtype=torch_dtype)
    out = torch.empty_like(xs[0])
    calls = {"copy": lambda i: out.copy_(xs[i]),
             "fwd": lambda i: L.dyt_fwd_launch(xs[i], alpha, w, b),
             "bwd": lambda i: L.dyt_bwd_launch(dys[i], xs[i], alpha, w, b)}
    times = {name: [] for name in calls}
    for r in range(rounds + 1):
        for name, call in calls.items():
            t = time.perf_counter()
            call(r % k)
            if r:  # the first round compiles
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rows, d = (int(v) for v in args.shape.split("x"))
    torch.set_num_threads(args.threads)
    print(f"{args.shape}, {args.threads} threads; x copy as normlab bench counts it (a backward moves 3 "
          "tensors, a copy 2)")
    print(f"{'dtype':<6} {'pass':<5} {'ns/value/core':>14} {'compute ms':>11} {'kernel ms':>10} "
          f"{'copy ms':>8} {'kernel x copy':>14} {'ceiling x copy':>15}")
    for dtype in ("fp32", "bf16"):
        ms = measured_ms((rows, d), dtype)
        for pass_ in ("fwd", "bwd"):
            ns = compute_ns(dtype, pass_, (rows, d))
            compute = ns * rows * d / args.threads / 1e6
            moved = 1.5 if pass_ == "bwd" else 1.0
            print(f"{dtype:<6} {pass_:<5} {ns:>14.3f} {compute:>11.3f} {ms[pass_]:>10.3f} {ms['copy']:>8.3f} "
                  f"{ms['copy'] * moved / ms[pass_]:>14.2f} {ms['copy'] * moved / compute:>15.2f}")


if __name__ == "__main__":
    main()
