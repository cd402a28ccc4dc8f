"""Rules turn numbers into verdicts: relative gaps are log ratios with scipy's t intervals,
equivalence holds only when the whole interval lies inside the margin, a claimed size is rejected
by an interval that falls short of it, one seed or zero spread gives no interval, discrete
outcomes get the exact sign test, and one invocation's verdicts are family-wise (Holm)."""

import math
import random
import statistics

import pytest
from scipy import stats

from normlab import claims as C

WHY = C.ours("a test margin")


def _draw(gen, n, mean, sd):
    return [mean * math.exp(gen.gauss(0, sd)) for _ in range(n)]


# ------------------------------------------------------------------------------- intervals


def test_a_paired_log_ratio_interval_is_the_t_interval_of_the_log_ratios():
    gen = random.Random(3)
    b = _draw(gen, 5, 2.0, 0.05)
    a = [x * math.exp(0.02 + gen.gauss(0, 0.01)) for x in b]
    ci = C.interval(a, b, paired=True)
    d = [math.log(x / y) for x, y in zip(a, b)]
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(5)
    half = stats.t.ppf(0.975, 4) * se
    assert ci["df"] == 4 and ci["test"] == "paired t" and ci["relative"]
    assert (ci["lo"], ci["est"], ci["hi"]) == pytest.approx((mean - half, mean, mean + half), rel=1e-12)
    assert ci["se"] == pytest.approx(se, rel=1e-12)
    assert (ci["gap_lo"], ci["gap"],
            ci["gap_hi"]) == pytest.approx((math.expm1(mean - half), math.expm1(mean),
                                             math.expm1(mean + half)), rel=1e-12)


def test_welch_and_one_sample_intervals_on_logs_match_a_direct_computation():
    a, b = [2.20, 2.21, 2.19], [2.18, 2.185, 2.19, 2.18, 2.17]
    la, lb = [math.log(x) for x in a], [math.log(x) for x in b]
    va, vb = statistics.variance(la) / 3, statistics.variance(lb) / 5
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 4)  # Welch-Satterthwaite
    half = stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    d = statistics.fmean(la) - statistics.fmean(lb)
    ci = C.interval(a, b)
    assert ci["test"] == "Welch t" and ci["df"] == pytest.approx(df, rel=1e-12)
    assert (ci["lo"], ci["hi"]) == pytest.approx((d - half, d + half), rel=1e-12)
    one = C.interval(a, 2.0)
    m, se = statistics.fmean(la) - math.log(2.0), statistics.stdev(la) / math.sqrt(3)
    assert one["test"] == "one-sample t" and one["n"] == (3, None)
    assert (one["lo"], one["hi"]) == pytest.approx((m - stats.t.ppf(0.975, 2) * se,
                                                    m + stats.t.ppf(0.975, 2) * se), rel=1e-12)


def test_an_absolute_gap_is_the_difference_itself():
    a = [-0.45, -0.5, -0.56]
    ci = C.interval(a, -0.5, absolute=True)
    assert not ci["relative"] and ci["gap"] == pytest.approx(statistics.fmean(a) + 0.5)
    # against an exact 0 a ratio means nothing: the difference again
    assert not C.interval(a, 0)["relative"]


def test_no_relative_interval_passes_minus_100_percent():
    # a denominator this noisy gave -132% to +437% as (mean a - mean b) / mean b
    a, b = [0.01, 0.2, 0.05], [0.02, 0.01, 0.4]
    ci = C.interval(a, b)
    assert ci["gap_lo"] > -1
    naive = (statistics.fmean(a) - statistics.fmean(b)) / statistics.fmean(b)
    assert ci["gap"] != pytest.approx(naive)


def test_zero_spread_gives_no_t_interval():
    for a, b, kw in (([-1.0, -1.0, -1.0], 0, {}), ([2.0, 2.0], [1.0, 1.0], {}),
                     ([2.0, 3.0], [1.0, 2.0], {"paired": True})):
        ci = C.interval(a, b, absolute=True, **kw)
        assert "no spread" in ci["none"]
        verdict, (line,) = C.evaluate(C.below("a", "b", absolute=True, **kw), {"a": a, "b": b})
        assert verdict == "inconclusive" and "no spread" in line


def test_a_relative_gap_of_non_positive_values_is_refused_with_the_reason():
    verdict, (line,) = C.evaluate(C.above("a", "b"), {"a": [-1.0, 0.5], "b": [1.0, 1.1]})
    assert verdict == "inconclusive" and "positive values" in line


# -------------------------------------------------------------------------------- verdicts


def test_equivalence_needs_the_whole_interval_inside_the_margin():
    rule = C.within("a", "b", 0.02, origin=WHY)
    inside = {"a": [2.200, 2.201, 2.199], "b": [2.185, 2.186, 2.184]}  # +0.7%, tight
    assert C.judge(rule, inside) == "holds"
    straddles = {"a": [2.189, 2.211], "b": [2.181, 2.189]}  # +0.7% but two noisy seeds
    assert C.judge(rule, straddles) == "inconclusive"
    outside = {"a": [2.30, 2.31, 2.29], "b": [2.185, 2.186, 2.184]}
    assert C.judge(rule, outside) == "does not hold"


def test_equivalence_states_the_smallest_margin_at_which_it_would_hold():
    c = C.claim("x.y", "a is like b", "somebody", {"a": [2.200, 2.201, 2.199], "b": [2.185, 2.186, 2.184]},
                C.within("a", "b", 0.02, origin=WHY))
    ci = C.interval([2.200, 2.201, 2.199], [2.185, 2.186, 2.184])
    assert f"equivalent within +-{max(abs(ci['gap_lo']), abs(ci['gap_hi'])):.1%} at 95%" in c["evidence"][0]


@pytest.mark.parametrize("kind, a, verdict", [
    ("above", [1.15, 1.16, 1.17], "holds"),
    # above b, but the whole interval short of the claimed 10%
    ("above", [1.05, 1.06, 1.07], "does not hold"),
    ("above", [0.97, 0.98, 0.96], "does not hold"),
    ("above", [1.02, 1.2, 1.1], "inconclusive"),  # straddles 10%
    ("below", [0.90, 0.91, 0.89], "holds"),
    ("below", [0.95, 0.955, 0.945], "does not hold"),  # below b, but short of the claimed 7%
    ("below", [0.85, 1.0, 0.93], "inconclusive"),
])
def test_a_claimed_size_holds_beyond_the_margin_and_is_rejected_short_of_it(kind, a, verdict):
    m = 0.1 if kind == "above" else 0.07
    assert C.judge(getattr(C, kind)("a", "b", m, origin=WHY), {"a": a, "b": [1.0, 1.001, 0.999]}) == verdict


def test_the_evidence_says_what_a_rejected_size_still_supports():
    # the all-quick record's rms_speed: faster by 6.1% to 7.0% against a claimed 7%
    b = [100.0, 120.0, 90.0, 110.0]
    a = [x * f for x, f in zip(b, (0.935, 0.934, 0.936, 0.9345))]
    verdict, (line,) = C.evaluate(C.below("a", "b", 0.07, origin=WHY, paired=True, over="processes"),
                                  {"a": a, "b": b})
    assert verdict == "does not hold"
    assert "the direction holds, the claimed size does not" in line and "below by 6.4% to 6.6%" in line


def test_interval_and_p_value_give_the_same_verdict():
    # the leaf decides on its p (so that Holm can adjust it); at 5% that must be the interval's reading
    gen = random.Random(11)
    for _ in range(300):
        kind = gen.choice(C.LEAVES)
        m = gen.choice([0.0, 0.02, 0.05]) if kind != "within" else gen.choice([0.02, 0.05])
        rule = getattr(C, kind)("a", "b", m, origin=WHY, paired=gen.random() < 0.5)
        n = gen.choice([2, 3, 5])
        b = _draw(gen, n, 1.0, 0.03)
        a = [x * math.exp(gen.gauss(gen.choice([-0.05, 0, 0.05]), 0.03)) for x in b]
        ci = C.interval(a, b, paired=rule.get("paired", False))
        lo, hi = ci["gap_lo"], ci["gap_hi"]
        expected = {"within": ("holds" if -m <= lo and hi <= m else "does not hold" if lo > m or hi < -m
                               else "inconclusive"),
                    "above": ("holds" if lo > m else "does not hold" if hi < m else "inconclusive"),
                    "at_least": ("holds" if lo > -m else "does not hold" if hi < -m else "inconclusive"),
                    "below": ("holds" if hi < -m else "does not hold" if lo > -m else "inconclusive"),
                    "at_most": ("holds" if hi < m else "does not hold" if lo > m else "inconclusive")}[kind]
        assert C.judge(rule, {"a": a, "b": b}) == expected, (kind, m, a, b)


@pytest.mark.parametrize("kind", ["within", "above", "below", "at_most", "at_least"])
def test_one_seed_is_inconclusive(kind):
    rule = getattr(C, kind)("a", "b", 0.02, origin=WHY)
    for m in ({"a": [1.5], "b": [1.0]}, {"a": [1.0], "b": [1.5]}, {"a": [1.0, 1.01], "b": [1.5]},
              {"a": 1.5, "b": 1.0}):
        verdict, lines = C.evaluate(rule, m)
        assert verdict == "inconclusive"
        assert "no interval" in lines[0]


def test_at_most_and_at_least():
    rule = C.at_most("a", "b", 0.02, origin=WHY)
    assert C.judge(rule, {"a": [1.0, 1.01, 1.005], "b": 1.0}) == "holds"
    assert C.judge(rule, {"a": [1.05, 1.06, 1.055], "b": 1.0}) == "does not hold"
    assert C.judge(rule, {"a": [1.0, 1.05, 1.02], "b": 1.0}) == "inconclusive"
    rule = C.at_least("a", 1e-3, origin=WHY)
    assert C.judge(rule, {"a": [0.1, 0.2, 0.15]}) == "holds"
    assert C.judge(rule, {"a": [1e-5, 2e-5, 1e-5]}) == "does not hold"


def test_point_rules_judge_exact_values_even_alone_and_stay_out_of_the_family():
    rule = C.at_least("diverged", 1, point="a count of diverged runs", origin=WHY)
    assert C.judge(rule, {"diverged": 1}) == "holds"
    assert C.judge(rule, {"diverged": 0}) == "does not hold"
    assert C.judge(C.at_most("diverged", 0, point="a count", origin=WHY), {"diverged": 0}) == "holds"
    # "above 0" excludes 0
    assert C.judge(C.above("x", 0, point="a count", origin=WHY), {"x": 0}) == "does not hold"
    assert C.leaf_pvalues(rule, {"diverged": 1}) == []
    with pytest.raises(ValueError, match="holds samples"):
        C.judge(rule, {"diverged": [1, 0]})


@pytest.mark.parametrize("missing", [None, math.nan, math.inf])
def test_missing_values_are_inconclusive(missing):
    assert C.judge(C.within("a", "b", 0.02, origin=WHY), {"a": missing, "b": [1.0, 1.1]}) == "inconclusive"
    assert C.judge(C.above("a", "b"), {"b": [1.0, 1.1]}) == "inconclusive"
    assert C.judge(C.at_least("a", 1, point="a count", origin=WHY), {"a": missing}) == "inconclusive"
    # a diverged seed drops out of the samples; the rest still give an interval
    assert C.interval([1.0, missing, 1.1, 1.05], 1.0)["n"] == (3, None)


# ---------------------------------------------------------------------- discrete outcomes


def test_a_discrete_outcome_is_judged_by_the_exact_sign_test():
    # best learning rate on a grid (log10), per seed: Post-LN's lower than Pre-LN's in every seed
    rule = C.below("post", "pre", test="sign", paired=True, absolute=True)
    three = {"post": [-3.0, -3.0, -3.0], "pre": [-2.0, -2.0, -2.0]}
    verdict, (line,) = C.evaluate(rule, three)
    # a t interval of zero width would call this "holds"; 3 of 3 signs give p = 2 * 1/8
    assert verdict == "inconclusive" and "0 of 3 seeds above 0, 3 below" in line and "p 0.25" in line
    six = {"post": [-3.0] * 6, "pre": [-2.0] * 6}
    assert C.leaf_pvalues(rule, six) == [pytest.approx(2 * 0.5**6)]
    assert C.judge(rule, six) == "holds"
    assert C.judge(rule, {"post": [-1.0] * 6, "pre": [-2.0] * 6}) == "does not hold"
    ties = {"post": [-2.0] * 5 + [-3.0], "pre": [-2.0] * 6}  # ties carry no sign
    assert C.leaf_pvalues(rule, ties) == [pytest.approx(1.0)]
    assert C.leaf_pvalues(rule, six)[0] == pytest.approx(
        2 * stats.binomtest(6, 6, 0.5, alternative="greater").pvalue)


def test_the_sign_test_refuses_what_it_cannot_judge():
    with pytest.raises(ValueError, match="sign test"):
        C.within("a", "b", 0.1, origin=WHY, test="sign", absolute=True)
    with pytest.raises(ValueError, match="sign test"):
        C.below("a", "b", test="sign")  # a ratio


# ------------------------------------------------------------------------------ family-wise


def test_holm_matches_statsmodels():
    # statsmodels 0.15.0: multipletests(p, alpha=0.05, method="holm")
    p = [0.001, 0.012, 0.03, 0.04, 0.2, 0.0005, 0.5, 0.025]
    expected = [0.007, 0.072, 0.125, 0.125, 0.4, 0.004, 0.5, 0.125]
    assert C.holm(p) == pytest.approx(expected, rel=1e-12)
    assert [C.holm_adjust(x, p) for x in p] == pytest.approx(expected, rel=1e-12)
    assert C.holm([0.01, 0.01]) == [0.02, 0.02]  # ties


def _claims_of_family(n_noise: int) -> list[dict]:
    gen = random.Random(5)
    # p = 0.005 alone: below 0.05, not below 0.05 / 61
    tight = C.claim("q.equal", "a is like b", "src",
                    {"a": [2.20, 2.215, 2.19, 2.205], "b": [2.185, 2.19, 2.18, 2.195]},
                    C.within("a", "b", 0.02, origin=WHY))
    noise = [C.claim(f"n.{i}", "noise", "src", {"a": _draw(gen, 3, 1.0, 0.05), "b": _draw(gen, 3, 1.0, 0.05)},
                     C.above("a", "b")) for i in range(n_noise)]
    return [{"claims": [tight]}, {"claims": noise}]


def test_a_verdict_that_holds_alone_can_be_inconclusive_in_a_large_family():
    alone = _claims_of_family(0)
    C.familywise(alone)
    assert alone[0]["claims"][0]["verdict"] == "holds"
    crowd = _claims_of_family(60)
    family = C.familywise(crowd)
    c = crowd[0]["claims"][0]
    assert family["size"] == 61 and family["method"] == "holm" and crowd[1]["family"] is family
    assert c["verdict_plain"] == "holds" and c["verdict"] == "inconclusive"
    assert "(holds alone), Holm-adjusted p" in c["evidence"][0]
    # the per-claim reading keeps the plain verdicts and says so
    plain = _claims_of_family(60)
    assert C.familywise(plain, per_claim=True)["method"] == "none"
    assert plain[0]["claims"][0]["verdict"] == "holds"


def test_family_wise_error_is_controlled_where_per_claim_error_is_not():
    # 20 true nulls ("a above b" when a and b are the same): judged one by one, 64% of such
    # families hold a wrong conclusive verdict; Holm keeps that at most 5%
    gen = random.Random(7)
    wrong_plain = wrong_holm = 0
    for _ in range(100):
        sections = [{"claims": [C.claim(f"n.{i}", "x", "s",
                                        {"a": _draw(gen, 4, 1.0, 0.05), "b": _draw(gen, 4, 1.0, 0.05)},
                                        C.above("a", "b")) for i in range(20)]}]
        C.familywise(sections)
        wrong_plain += any(c["verdict_plain"] != "inconclusive" for c in sections[0]["claims"])
        wrong_holm += any(c["verdict"] != "inconclusive" for c in sections[0]["claims"])
    assert wrong_plain > 45 and wrong_holm <= 12


def test_recheck_catches_a_verdict_or_a_family_that_does_not_follow():
    sections = _claims_of_family(10)
    C.familywise(sections)
    results = {"presets": {"q": sections[0], "n": sections[1]}}
    assert C.recheck(results) == []
    sections[0]["claims"][0]["verdict"] = "holds"  # the plain verdict written over the family-wise one
    assert C.recheck(results) == ["q: q.equal"]
    sections[0]["claims"][0]["verdict"] = C.judge(sections[0]["claims"][0]["rule"],
                                                  sections[0]["claims"][0]["measured"],
                                                  C._adjuster(sections[0]["family"]))
    # a smaller family
    sections[0]["family"] = {**sections[0]["family"], "p_values": sections[0]["family"]["p_values"][1:]}
    assert "q: q.equal" in C.recheck(results)


# ------------------------------------------------------------------------- combining rules


def test_all_and_any():
    yes, no = C.at_least("one", 1, point="a count", origin=WHY), C.at_least("zero", 1, point="a count",
                                                                            origin=WHY)
    unsure = C.at_least("none", 1, point="a count", origin=WHY)
    m = {"one": 1, "zero": 0, "none": None}
    assert C.judge(C.all_of(yes, yes), m) == "holds"
    assert C.judge(C.all_of(yes, no, unsure), m) == "does not hold"
    assert C.judge(C.all_of(yes, unsure), m) == "inconclusive"
    assert C.judge(C.any_of(no, yes, unsure), m) == "holds"
    assert C.judge(C.any_of(no, no), m) == "does not hold"
    assert C.judge(C.any_of(no, unsure), m) == "inconclusive"


def test_the_evidence_of_an_or_says_which_part_decided():
    rule = C.any_of(C.at_least("zero", 1, point="a count", origin=WHY),
                    C.at_least("one", 1, point="a count", origin=WHY))
    verdict, lines = C.evaluate(rule, {"zero": 0, "one": 1})
    assert verdict == "holds" and lines[0] == "one of 2 alternatives suffices (the second holds: holds):"
    assert lines[1].startswith("either: zero") and lines[1].endswith("does not hold")
    assert lines[2].startswith("or: one") and lines[2].endswith("holds")
    verdict, lines = C.evaluate(rule, {"zero": 0, "one": 0})
    assert (
        verdict == "does not hold"
        and lines[0] == "one of 2 alternatives suffices (none holds: does not hold):"
    )


def test_given_is_inconclusive_unless_its_condition_holds():
    rule = C.given(C.at_most("warm", "base", -0.1, origin=WHY), C.above("cold", "warm", 0.02, origin=WHY))
    m = {"base": 3.4, "warm": [2.0, 2.01, 1.99], "cold": [2.5, 2.51, 2.49]}
    assert C.judge(rule, m) == "holds"
    assert C.judge(rule, {**m, "cold": [1.9, 1.91, 1.89]}) == "does not hold"
    verdict, lines = C.evaluate(rule, {**m, "warm": [3.39, 3.4, 3.38], "cold": [3.39, 3.4, 3.38]})
    # nothing trained: untestable
    assert verdict == "inconclusive" and lines[0].startswith("precondition does not hold")
    # the then-rule is part of the family whether or not its precondition held
    assert len(C.leaf_pvalues(rule, {**m, "warm": [3.39, 3.4, 3.38]})) == 2


def test_the_evidence_states_the_interval_and_the_seeds():
    c = C.claim("x.y", "a is like b", "somebody (2020)", {"a": [2.2, 2.21, 2.19], "b": [2.185, 2.19, 2.18]},
                C.within("a", "b", 0.02, origin=C.ours("the seed-to-seed spread of this size is about 1%")))
    line = c["evidence"][0]
    assert "gap +0.7% (95% CI" in line and "3 and 3 seeds" in line and "Welch t on log ratios" in line
    assert "must be within +-2%;" in line and line.endswith(f": {c['verdict']}")
    assert c["origins"] == ["a within +-2% of b: normlab's choice (the seed-to-seed spread of this size is "
                            "about 1%)"]
    assert c["rule_text"] == "a within +-2% of b [95% t interval of the log ratio over seeds]"


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


def test_absolute_rules_compare_differences_and_name_their_target():
    rule = C.within("slope", -0.5, 0.25, origin=WHY, absolute=True)
    assert C.judge(rule, {"slope": [-0.45, -0.5, -0.55]}) == "holds"
    assert C.judge(rule, {"slope": [-0.05, 0.0, 0.05]}) == "does not hold"
    verdict, (line,) = C.evaluate(rule, {"slope": [-0.45, -0.5, -0.55]})
    assert "gap 0 (95% CI -0.1242 to 0.1242" in line and "must be within +-0.25;" in line
    # a target of 0 is named, not dropped
    assert C.describe(C.within("slope", 0, 0.25, origin=WHY,
                               absolute=True)).startswith("slope within +-0.25 of 0 [")


def test_a_rule_gives_a_shared_bracket_once():
    # issue 42: one bracketed phrase repeated six times in batchnorm.mates' rule
    moves = C.at_least("a", 1e-3, point="the largest change", origin=WHY)
    still = [C.at_most(k, 1e-5, point="no output may move", origin=WHY) for k in ("b", "c", "d")]
    text = C.describe(C.all_of(moves, *still))
    assert text.count("[exact: no output may move]") == 1 and text.count("[as above]") == 2
    assert text.count("[exact: the largest change]") == 1
