"""The polynomials of the CPU kernels' erf (kernels/cpu/tanh_erf.py), fitted again.

    python tools/erf_fit.py

erf z = z + z P(z^2) below |z| = 0.921875 and 1 - exp(-(t + t Q(t))) above it (t = |z| <= 4): P
and Q are least-squares fits at 4000 Chebyshev nodes, weighted to bound relative error (P) and
the error in erf (Q: by erfc t, the size of exp(-r)), rounded to float32. Prints each
polynomial's coefficients (highest degree first), whether they are those in tanh_erf.py, and
the worst error in ulp of its half evaluated in float32 (numpy, without fmas: a little worse than
the kernels, whose whole-range figure tools/pointwise_ulp.py --fn erf measures).
"""

import numpy as np
from scipy.special import erf, erfc

from normlab.kernels.cpu import tanh_erf as TE

NODES = 4000


def fit(f, a: float, b: float, degree: int, weight) -> np.ndarray:
    k = np.arange(NODES)
    x = (a + b) / 2 + (b - a) / 2 * np.cos((2 * k + 1) * np.pi / (2 * NODES))
    w = weight(x)
    coefs, *_ = np.linalg.lstsq(np.vander(x, degree + 1) * w[:, None], f(x) * w, rcond=None)
    return coefs.astype(np.float32)


def horner(coefs: np.ndarray, v: np.ndarray) -> np.ndarray:
    out = np.full_like(v, coefs[0])
    for c in coefs[1:]:
        out = (out * v + c).astype(np.float32)
    return out


def ulp_error(got: np.ndarray, z: np.ndarray) -> float:
    exact = erf(z.astype(np.float64))
    return float(np.max(np.abs(got - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)))


def main() -> None:
    split, cap = TE.ERF_SPLIT, TE.ERF_CAP
    p = fit(lambda s: erf(np.sqrt(s)) / np.sqrt(s) - 1, 1e-12, split**2, 6,
            lambda s: 1 / np.maximum(np.sqrt(s), 1e-3))
    q = fit(lambda t: (-np.log(erfc(t)) - t) / t, split, cap, 6, lambda t: erfc(t) / erfc(split))
    z = np.linspace(1e-6, split, 200001, dtype=np.float32)
    small = (z + z * horner(p, (z * z).astype(np.float32))).astype(np.float32)
    t = np.linspace(split, cap, 200001, dtype=np.float32)
    r = (t + t * horner(q, t)).astype(np.float32)
    large = (1 - np.exp(-r.astype(np.float64)).astype(np.float32)).astype(np.float32)
    for name, coefs, mine, err in (("P", p, TE.ERF_P, ulp_error(small, z)),
                                   ("Q", q, TE.ERF_Q, ulp_error(large, t))):
        same = np.array_equal(coefs, np.array(mine, np.float32))
        print(f"{name} = ({', '.join(repr(float(c)) for c in coefs)})")
        print(f"  as in tanh_erf.py: {same}; worst {err:.2f} ulp in float32 without fmas")


if __name__ == "__main__":
    main()
