"""The statistics the claims stand on: the t interval of a gap between two sets of samples (or
samples and an exact number), and Holm's step-down adjustment of a family of p-values. The gap's
definitions (log ratio, paired or Welch or one-sample) are in normlab.claims' docstring; scipy.stats
does the t distributions.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
import warnings

from scipy import stats as S

LEVEL = 0.95  # two-sided confidence of every plain interval (so each one-sided test is at 2.5%)


def finite(values) -> list[float]:
    """The values that are numbers (None and non-finite ones dropped)."""
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def pairs(a: list, b: list) -> list[tuple[float, float]]:
    """The pairs (a[i], b[i]) whose both values are numbers."""
    return [(float(x), float(y)) for x, y in zip(a, b)
            if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]


def interval(a: list, b, *, paired: bool = False, absolute: bool = False,
             level: float = LEVEL) -> dict | None:
    """The ``level`` t interval of the gap between a and b (see the module docstring): a log
    ratio (``relative``), or a - b when ``absolute`` or b is 0. ``b`` is a list of samples or an
    exact number. Returns the estimate, bounds and standard error in the test's own units
    (``est``, ``lo``, ``hi``, ``se``: logs for a relative gap), the gap as the report shows it
    (``gap``, ``gap_lo``, ``gap_hi``), ``df``, ``n`` and ``test``; or ``{"none": why}`` when there
    is no t interval, and None with fewer than two samples on a side."""
    relative = not absolute and not (not isinstance(b, list) and b == 0)
    if paired:
        kept = pairs(a, b)
        xa, xb = [x for x, _ in kept], [y for _, y in kept]
    else:
        xa = finite(a)
        xb = finite(b) if isinstance(b, list) else None
    if len(xa) < 2 or (xb is not None and len(xb) < 2):
        return None
    if relative and (min(xa) <= 0 or (min(xb) <= 0 if xb is not None else b <= 0)):
        return {"none": "a relative gap is a log ratio and needs positive values (use an absolute rule)"}
    f = math.log if relative else float
    la = [f(x) for x in xa]
    lb = [f(y) for y in xb] if xb is not None else f(b)
    if paired:
        d = [x - y for x, y in zip(la, lb)]
        spread, test, n = statistics.pstdev(d), "paired t", (len(d), len(d))
    elif xb is not None:
        spread, test, n = statistics.pstdev(la) + statistics.pstdev(lb), "Welch t", (len(la), len(lb))
    else:
        spread, test, n = statistics.pstdev(la), "one-sample t", (len(la), None)
    if spread == 0:
        return {"none": "the samples have no spread, so they give no t interval"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # scipy's precision notes on near-equal samples
        if paired:
            r = S.ttest_rel(la, lb)
            est = statistics.fmean(d)
        elif xb is not None:
            r = S.ttest_ind(la, lb, equal_var=False)
            est = statistics.fmean(la) - statistics.fmean(lb)
        else:
            r = S.ttest_1samp(la, lb)
            est = statistics.fmean(la) - lb
        ci = r.confidence_interval(level)
    shift = 0.0 if paired or xb is not None else lb  # ttest_1samp's interval is of the mean itself
    lo, hi, df = float(ci.low) - shift, float(ci.high) - shift, float(r.df)
    se = float((hi - lo) / (2 * S.t.ppf(0.5 + level / 2, df)))
    est = float(est)
    show = math.expm1 if relative else float
    return {"est": est, "lo": lo, "hi": hi, "se": se, "df": df, "n": n, "test": test, "relative": relative,
            "gap": show(est), "gap_lo": show(lo), "gap_hi": show(hi)}


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given (statsmodels' multipletests with
    method="holm" gives the same): the k-th smallest p is multiplied by the number of tests not
    yet rejected before it, and an adjusted p never falls below the one before it."""
    k = len(p_values)
    adjusted = [1.0] * k
    running = 0.0
    for rank, i in enumerate(sorted(range(k), key=p_values.__getitem__)):
        running = max(running, min(1.0, (k - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def holm_adjust(p: float, family: list[float]) -> float:
    """Holm's adjusted value of ``p`` (one of ``family``'s p-values, up to float rounding)."""
    return holm_of(sorted(family))(p)


def holm_of(ranked: list[float]):
    """Holm's adjustment as a function of p, for a family's sorted p-values."""
    k = len(ranked)
    steps = list(itertools.accumulate((min(1.0, (k - j) * q) for j, q in enumerate(ranked)), max))

    def adjusted(p: float) -> float:
        top = bisect.bisect_right(ranked, p * (1 + 1e-9) + 1e-300)
        if top == 0:
            raise ValueError(f"p = {p:g} is not one of the family's p-values")
        return steps[top - 1]

    return adjusted
