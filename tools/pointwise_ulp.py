"""How far the CPU kernels' tanh (DyT) or erf (Derf) and its derivative are from float64's, over
every float32 from the least subnormal to past saturation (10.5 for tanh, 6.5 for erf).

    python tools/pointwise_ulp.py [--fn tanh|erf] [--step 1]

The forward kernel runs on each value (a = w = 1, b = 0, shift 0: y is f(z)); its error is in
units in the last place of float32's rounding of the true f. Prints the worst error and where, a
histogram, and how many values that float32's f rounds to 1 came out other than 1. The backward
kernel runs on the same values (dy = 1: dx is f'(z)), and its worst error relative to the true
f' below the cap (10 for tanh, 6 for erf) is printed, with a count of values from the cap on whose
dx is not 0. tanh and erf are odd and the kernels take the sign last, so the positive half covers
the negative one. Every value (--step 1) takes about 75 s here; tests/test_pointwise.py sweeps
every 97th.
"""

import argparse

import numpy as np
from scipy.special import erf

from normlab.kernels.cpu import pointwise as K
from normlab.kernels.cpu import tanh_erf as TE
from normlab.kernels.cpu.simd import STAGE_WIDTH

CHUNK = 1 << 24
BINS = [0, 0.5, 1, 1.5, 2, 2.5, 3, 4, np.inf]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", type=int, default=1, help="every step-th float32 (1: all of them)")
    parser.add_argument("--fn", choices=("tanh", "erf"), default="tanh", help="DyT's tanh or Derf's erf")
    args = parser.parse_args()
    if args.step < 1:
        parser.error(f"--step must be a whole number >= 1, got {args.step}")
    shift, f, cap = (None, np.tanh, TE.TANH_CAP) if args.fn == "tanh" else (np.float32(0.0), erf,
                                                                            TE.SLOPE_CAP)
    slope = (
        (lambda z: 1 / np.cosh(z) ** 2)
        if args.fn == "tanh"
        else (lambda z: 2 / np.sqrt(np.pi) * np.exp(-z * z))
    )
    end = int(np.float32(cap + 0.5).view(np.int32))
    one, zero = np.ones(CHUNK, np.float32), np.zeros(CHUNK, np.float32)
    stages, no_table = np.zeros((1, STAGE_WIDTH), np.float32), np.empty(0, np.float32)
    worst, at, not_one, hist = 0.0, 0.0, 0, np.zeros(len(BINS) - 1, np.int64)
    worst_rel, rel_at, not_zero = 0.0, 0.0, 0
    for start in range(1, end, CHUNK * args.step):
        z = np.arange(start, min(start + CHUNK * args.step, end), args.step,
                      dtype=np.int32).view(np.float32)[None]
        n, z64 = z.size, z[0].astype(np.float64)
        y, dx = np.empty_like(z), np.empty_like(z)
        K.pointwise_fwd(z, 1.0, shift, one[:n], zero[:n], y, stages, False, no_table, False, 0)
        exact = f(z64)
        err = np.abs(y[0] - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
        if err.max() > worst:
            worst, at = float(err.max()), float(z[0, err.argmax()])
        not_one += int(((exact.astype(np.float32) == 1) & (y[0] != 1)).sum())
        hist += np.histogram(err, BINS)[0]
        K.pointwise_bwd(one[None, :n], z, 1.0, shift, one[:n], dx, np.zeros((1, 2)), np.zeros((1, n)),
                        np.zeros((1, n)), stages, False,
                        no_table, False, 0)
        inside = z64 < cap  # the backward zeroes dx from the cap on
        true = slope(z64[inside])
        rel = np.abs(dx[0, inside] - true) / true
        if rel.size and rel.max() > worst_rel:
            worst_rel, rel_at = float(rel.max()), float(z64[inside][rel.argmax()])
        not_zero += int((dx[0, ~inside] != 0).sum())
    print(f"worst {worst:.3f} ulp at z = {at!r}; {hist.sum():,} values")
    for lo, hi, n in zip(BINS, BINS[1:], hist):
        print(f"  [{lo}, {hi}) ulp: {n:,}")
    print(f"values float32's {args.fn} rounds to 1 that came out other than 1: {not_one}")
    print(f"backward: {args.fn}' worst {worst_rel:.3g} relative at z = {rel_at!r}; from the cap on, dx not "
          f"0: {not_zero}")


if __name__ == "__main__":
    main()
