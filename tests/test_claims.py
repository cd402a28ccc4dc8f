"""Rules turn numbers into verdicts through 95% t intervals: equivalence holds only when the whole
interval lies inside the margin, a gap inside its own noise never gives "does not hold", one
seed gives no interval, thresholds carry their origin, and all/any/given combine."""

import math
import random
import statistics

import pytest

from normlab import claims as C

WHY = C.ours("a test margin")

# Student t 0.975 quantiles from scipy.stats.t.ppf(0.975, df) (scipy 1.16), real df included
# because Welch's interval has real degrees of freedom.
T975 = {1: 12.706204736174694, 2: 4.302652729749462, 3: 3.1824463052837078, 4: 2.7764451051977934,
        5: 2.5705818356363146, 1.5: 6.016663104427929, 2.5: 3.5746548420036817, 7.3: 2.345066736547703}


@pytest.mark.parametrize("df", list(T975))
def test_t_quantile_matches_scipy(df):
    assert C.t_quantile(0.975, df) == pytest.approx(T975[df], rel=1e-7)


def test_t_quantile_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="df >= 1"):
        C.t_quantile(0.975, 0.5)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_one_sample_interval_uses_t_with_n_minus_1_df(n):
    xs = [2.0 + 0.01 * i * i for i in range(n)]
    ci = C.interval(xs, 2.0)
    mean, se = statistics.fmean(xs), statistics.stdev(xs) / math.sqrt(n)
    half = T975[n - 1] * se
    assert ci["df"] == n - 1 and ci["n"] == (n, None)
    assert ci["lo"] == pytest.approx((mean - half - 2.0) / 2.0)
    assert ci["hi"] == pytest.approx((mean + half - 2.0) / 2.0)


def test_welch_interval_and_degrees_of_freedom():
    a, b = [2.20, 2.21, 2.19], [2.18, 2.185, 2.19, 2.18, 2.17]
    ci = C.interval(a, b)
    va, vb = statistics.variance(a) / 3, statistics.variance(b) / 5
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 4)
    assert ci["df"] == pytest.approx(df)
    half = C.t_quantile(0.975, df) * math.sqrt(va + vb)
    d, mb = statistics.fmean(a) - statistics.fmean(b), statistics.fmean(b)
    assert (ci["lo"], ci["gap"], ci["hi"]) == pytest.approx(((d - half) / mb, d / mb, (d + half) / mb))


def test_paired_interval_cancels_what_the_pairs_share():
    drift = [10.0, 14.0, 9.0, 16.0]  # a machine that drifts between processes
    a, b = [0.9 * x for x in drift], drift
    paired = C.interval(a, b, paired=True)
    assert paired["n"] == (4, 4) and paired["df"] == 3
    assert paired["hi"] < -0.05  # the 10% gap is clear side by side ...
    assert C.interval(a, b)["hi"] > 0  # ... and lost in the drift when the pairs are ignored


def test_equivalence_needs_the_whole_interval_inside_the_margin():
    rule = C.within("a", "b", 0.02, origin=WHY)
    inside = {"a": [2.200, 2.201, 2.199], "b": [2.185, 2.186, 2.184]}  # +0.7%, tight
    assert C.judge(rule, inside) == "holds"
    # the demo's case: point estimate +0.7% inside +-2%, but two noisy seeds: the interval is not
    straddles = {"a": [2.189, 2.211], "b": [2.181, 2.189]}
    assert abs(statistics.fmean(straddles["a"]) / statistics.fmean(straddles["b"]) - 1) < 0.02
    assert C.judge(rule, straddles) == "inconclusive"
    outside = {"a": [2.30, 2.31, 2.29], "b": [2.185, 2.186, 2.184]}
    assert C.judge(rule, outside) == "does not hold"


def test_a_gap_inside_its_own_noise_never_fails():
    gen = random.Random(1)
    for kind in ("within", "above", "below", "at_most", "at_least"):
        rule = getattr(C, kind)("a", "b", 0.02, origin=WHY)
        for _ in range(200):
            n = gen.choice([2, 3, 5])
            a = [1.0 + gen.gauss(0, 0.05) for _ in range(n)]
            b = [1.0 + gen.gauss(0, 0.05) for _ in range(n)]
            ci = C.interval(a, b)
            if ci["lo"] <= 0 <= ci["hi"] and ci["lo"] < -0.02 and ci["hi"] > 0.02:  # no effect excluded either way
                assert C.judge(rule, {"a": a, "b": b}) == "inconclusive", (kind, a, b)


@pytest.mark.parametrize("kind", ["within", "above", "below", "at_most", "at_least"])
def test_one_seed_is_inconclusive(kind):
    rule = getattr(C, kind)("a", "b", 0.02, origin=WHY)
    for m in ({"a": [1.5], "b": [1.0]}, {"a": [1.0], "b": [1.5]}, {"a": [1.0, 1.01], "b": [1.5]}, {"a": 1.5, "b": 1.0}):
        verdict, lines = C.evaluate(rule, m)
        assert verdict == "inconclusive"
        assert "no interval" in lines[0]


@pytest.mark.parametrize("a, verdict", [([1.15, 1.16, 1.17], "holds"), ([1.05, 1.06, 1.07], "inconclusive"),
                                        ([0.97, 0.98, 0.96], "does not hold"), ([0.95, 1.2, 1.1], "inconclusive")])
def test_above_holds_beyond_the_margin_and_fails_only_against_the_direction(a, verdict):
    assert C.judge(C.above("a", "b", 0.1, origin=WHY), {"a": a, "b": 1.0}) == verdict


@pytest.mark.parametrize("a, verdict", [([0.90, 0.91, 0.89], "holds"), ([0.95, 0.96, 0.94], "inconclusive"),
                                        ([1.05, 1.06, 1.04], "does not hold")])
def test_below(a, verdict):
    assert C.judge(C.below("a", "b", 0.07, origin=C.source("7% to 64%")), {"a": a, "b": [1.0, 1.001, 0.999]}) == verdict


def test_at_most_and_at_least():
    rule = C.at_most("a", "b", 0.02, origin=WHY)
    assert C.judge(rule, {"a": [1.0, 1.01, 1.005], "b": 1.0}) == "holds"
    assert C.judge(rule, {"a": [1.05, 1.06, 1.055], "b": 1.0}) == "does not hold"
    assert C.judge(rule, {"a": [1.0, 1.05, 1.02], "b": 1.0}) == "inconclusive"
    rule = C.at_least("a", 1e-3, origin=WHY)
    assert C.judge(rule, {"a": [0.1, 0.2, 0.15]}) == "holds"
    assert C.judge(rule, {"a": [1e-5, 2e-5, 1e-5]}) == "does not hold"


def test_point_rules_judge_exact_values_even_alone():
    rule = C.at_least("diverged", 1, point="a count of diverged runs", origin=WHY)
    assert C.judge(rule, {"diverged": 1}) == "holds"
    assert C.judge(rule, {"diverged": 0}) == "does not hold"
    assert C.judge(C.at_most("diverged", 0, point="a count", origin=WHY), {"diverged": 0}) == "holds"
    with pytest.raises(ValueError, match="holds samples"):
        C.judge(rule, {"diverged": [1, 0]})


@pytest.mark.parametrize("missing", [None, math.nan, math.inf])
def test_missing_values_are_inconclusive(missing):
    assert C.judge(C.within("a", "b", 0.02, origin=WHY), {"a": missing, "b": [1.0, 1.1]}) == "inconclusive"
    assert C.judge(C.above("a", "b"), {"b": [1.0, 1.1]}) == "inconclusive"
    assert C.judge(C.at_least("a", 1, point="a count", origin=WHY), {"a": missing}) == "inconclusive"
    # a diverged seed drops out of the samples; the rest still give an interval
    assert C.interval([1.0, missing, 1.1, 1.05], 1.0)["n"] == (3, None)


def test_all_and_any():
    yes, no = C.at_least("one", 1, point="a count", origin=WHY), C.at_least("zero", 1, point="a count", origin=WHY)
    unsure = C.at_least("none", 1, point="a count", origin=WHY)
    m = {"one": 1, "zero": 0, "none": None}
    assert C.judge(C.all_of(yes, yes), m) == "holds"
    assert C.judge(C.all_of(yes, no, unsure), m) == "does not hold"
    assert C.judge(C.all_of(yes, unsure), m) == "inconclusive"
    assert C.judge(C.any_of(no, yes, unsure), m) == "holds"
    assert C.judge(C.any_of(no, no), m) == "does not hold"
    assert C.judge(C.any_of(no, unsure), m) == "inconclusive"


def test_given_is_inconclusive_unless_its_condition_holds():
    rule = C.given(C.at_most("warm", "base", -0.1, origin=WHY), C.above("cold", "warm", 0.02, origin=WHY))
    m = {"base": 3.4, "warm": [2.0, 2.01, 1.99], "cold": [2.5, 2.51, 2.49]}
    assert C.judge(rule, m) == "holds"
    assert C.judge(rule, {**m, "cold": [1.9, 1.91, 1.89]}) == "does not hold"
    verdict, lines = C.evaluate(rule, {**m, "warm": [3.39, 3.4, 3.38], "cold": [3.39, 3.4, 3.38]})
    assert verdict == "inconclusive" and lines[0].startswith("precondition does not hold")  # nothing trained: untestable


def test_the_evidence_states_the_interval_and_the_seeds():
    c = C.claim("x.y", "a is like b", "somebody (2020)", {"a": [2.2, 2.21, 2.19], "b": [2.185, 2.19, 2.18]},
                C.within("a", "b", 0.02, origin=C.ours("the seed-to-seed spread of this size is about 1%")))
    line = c["evidence"][0]
    assert "gap +0.7% (95% CI" in line and "3 and 3 seeds" in line and "Welch t" in line
    assert line.endswith(f"must be within +-2%: {c['verdict']}")
    assert c["origins"] == ["a within +-2% b: normlab's choice (the seed-to-seed spread of this size is about 1%)"]
    assert "a within +-2% b [95% t interval over seeds]" == c["rule_text"]


def test_every_threshold_needs_an_origin():
    with pytest.raises(ValueError, match="needs an origin"):
        C.within("a", "b", 0.02)
    with pytest.raises(ValueError, match="needs an origin"):
        C.at_most("a", 2.0)
    with pytest.raises(ValueError, match="C.source"):
        C.at_most("a", 2.0, origin={"by": "me", "text": "why not"})
    assert "origin" not in C.below("a", "b")  # no threshold: a plain direction


def test_unknown_rule_kind_is_an_error():
    with pytest.raises(ValueError, match="unknown rule kind 'between'"):
        C.judge({"kind": "between", "a": "a", "b": 1}, {"a": 1})


def test_absolute_rules_compare_differences():
    rule = C.within("slope", -0.5, 0.25, origin=WHY, absolute=True)
    assert C.judge(rule, {"slope": [-0.45, -0.5, -0.55]}) == "holds"
    assert C.judge(rule, {"slope": [-0.05, 0.0, 0.05]}) == "does not hold"
    verdict, (line,) = C.evaluate(rule, {"slope": [-0.45, -0.5, -0.55]})
    assert "gap 0 (95% CI -0.1242 to 0.1242" in line and "must be within +-0.25 of" in line
