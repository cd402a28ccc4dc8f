"""How far DyT's CPU tanh is from float64's, over every float32 from the least subnormal to 10.5.

    python tools/dyt_ulp.py [--step 1]

The forward kernel runs on each value (a = w = 1, b = 0: y is its tanh); the error is in units in
the last place of float32's rounding of the true tanh. Prints the worst error and where, a
histogram, and whether every value that float32's tanh rounds to 1 came out as exactly 1. tanh is
odd and the kernel takes the sign last, so the positive half covers the negative one. Every
value (--step 1) takes about a minute and a half here; tests/test_dyt.py sweeps every 97th.
"""

import argparse

import numpy as np

from normlab.kernels.cpu import dynamic_tanh as K
from normlab.kernels.cpu.simd import STAGE_WIDTH

CHUNK = 1 << 24
BINS = [0, 0.5, 1, 1.5, 2, 2.5, 3, 4, np.inf]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", type=int, default=1, help="every step-th float32 (1: all of them)")
    args = parser.parse_args()
    if args.step < 1:
        parser.error(f"--step must be a whole number >= 1, got {args.step}")
    end = int(np.float32(10.5).view(np.int32))
    one, zero = np.ones(CHUNK, np.float32), np.zeros(CHUNK, np.float32)
    stages, no_table = np.zeros((1, STAGE_WIDTH), np.float32), np.empty(0, np.float32)
    worst, at, not_one, hist = 0.0, 0.0, 0, np.zeros(len(BINS) - 1, np.int64)
    for start in range(1, end, CHUNK * args.step):
        z = np.arange(start, min(start + CHUNK * args.step, end), args.step, dtype=np.int32).view(np.float32)[None]
        y = np.empty_like(z)
        K.dyt_fwd(z, 1.0, one[: z.size], zero[: z.size], y, stages, False, no_table)
        exact = np.tanh(z[0].astype(np.float64))
        err = np.abs(y[0] - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
        if err.max() > worst:
            worst, at = float(err.max()), float(z[0, err.argmax()])
        not_one += int(((exact.astype(np.float32) == 1) & (y[0] != 1)).sum())
        hist += np.histogram(err, BINS)[0]
    print(f"worst {worst:.3f} ulp at z = {at!r}; {hist.sum():,} values")
    for lo, hi, n in zip(BINS, BINS[1:], hist):
        print(f"  [{lo}, {hi}) ulp: {n:,}")
    print(f"values float32's tanh rounds to 1 that came out other than 1: {not_one}")


if __name__ == "__main__":
    main()
