"""How far DyT's CPU tanh and its derivative are from float64's, over every float32 from the
least subnormal to 10.5.

    python tools/dyt_ulp.py [--step 1]

The forward kernel runs on each value (a = w = 1, b = 0: y is its tanh); its error is in units in
the last place of float32's rounding of the true tanh. Prints the worst error and where, a
histogram, and whether every value that float32's tanh rounds to 1 came out as exactly 1. The
backward kernel runs on the same values (dy = 1: dx is its 1 - tanh^2), and its worst error
relative to sech^2 below the cap of 10 is printed, with a count of values from the cap on whose dx
is not 0. tanh is odd and the kernels take the sign last, so the positive half covers the negative
one. Every value (--step 1) takes about 75 s here; tests/test_dyt.py sweeps every 97th.
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
    worst_rel, rel_at, not_zero = 0.0, 0.0, 0
    for start in range(1, end, CHUNK * args.step):
        z = np.arange(start, min(start + CHUNK * args.step, end), args.step, dtype=np.int32).view(np.float32)[None]
        n, z64 = z.size, z[0].astype(np.float64)
        y, dx = np.empty_like(z), np.empty_like(z)
        K.dyt_fwd(z, 1.0, one[:n], zero[:n], y, stages, False, no_table)
        exact = np.tanh(z64)
        err = np.abs(y[0] - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
        if err.max() > worst:
            worst, at = float(err.max()), float(z[0, err.argmax()])
        not_one += int(((exact.astype(np.float32) == 1) & (y[0] != 1)).sum())
        hist += np.histogram(err, BINS)[0]
        K.dyt_bwd(one[None, :n], z, 1.0, one[:n], dx, np.zeros(1), np.zeros((1, n)), np.zeros((1, n)), stages, False, no_table)
        inside = z64 < K._CAP  # the backward zeroes dx from the cap on
        sech2 = 1 / np.cosh(z64[inside]) ** 2
        rel = np.abs(dx[0, inside] - sech2) / sech2
        if rel.size and rel.max() > worst_rel:
            worst_rel, rel_at = float(rel.max()), float(z64[inside][rel.argmax()])
        not_zero += int((dx[0, ~inside] != 0).sum())
    print(f"worst {worst:.3f} ulp at z = {at!r}; {hist.sum():,} values")
    for lo, hi, n in zip(BINS, BINS[1:], hist):
        print(f"  [{lo}, {hi}) ulp: {n:,}")
    print(f"values float32's tanh rounds to 1 that came out other than 1: {not_one}")
    print(f"backward: 1 - tanh^2 worst {worst_rel:.3g} relative at z = {rel_at!r}; from the cap on, dx not 0: {not_zero}")


if __name__ == "__main__":
    main()
