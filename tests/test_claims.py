"""Rules turn numbers into verdicts: each rule kind flips when the numbers cross its threshold,
noise turns a decision resting on a small gap into "inconclusive", missing values are
inconclusive, and all/any combine."""

import math

import pytest

from normlab import claims as C


@pytest.mark.parametrize("a, verdict", [(1.01, "holds"), (0.99, "holds"), (1.03, "does not hold"), (0.97, "does not hold")])
def test_within(a, verdict):
    assert C.judge(C.within("a", "b", 0.02), {"a": a, "b": 1.0}) == verdict


@pytest.mark.parametrize("a, verdict", [(1.11, "holds"), (1.05, "inconclusive"), (1.0, "does not hold"), (0.9, "does not hold")])
def test_above_has_a_grey_band(a, verdict):
    assert C.judge(C.above("a", "b", 0.1), {"a": a, "b": 1.0}) == verdict


@pytest.mark.parametrize("a, verdict", [(0.9, "holds"), (0.95, "inconclusive"), (1.0, "does not hold"), (1.2, "does not hold")])
def test_below_has_a_grey_band(a, verdict):
    assert C.judge(C.below("a", "b", 0.07), {"a": a, "b": 1.0}) == verdict


def test_at_most_and_at_least_with_literals():
    assert C.judge(C.at_most("a", 2.0), {"a": 1.9}) == "holds"
    assert C.judge(C.at_most("a", 2.0), {"a": 2.1}) == "does not hold"
    assert C.judge(C.at_least("a", 1), {"a": 1}) == "holds"
    assert C.judge(C.at_least("a", 1), {"a": 0}) == "does not hold"
    assert C.judge(C.at_most("a", "b", 0.02), {"a": 1.019, "b": 1.0}) == "holds"
    assert C.judge(C.at_most("a", "b", 0.02), {"a": 1.021, "b": 1.0}) == "does not hold"


def test_noise_makes_small_gaps_inconclusive():
    rule = C.within("a", "b", 0.02, noise=["sa", "sb"])
    m = {"a": 1.05, "b": 1.0, "sa": 0.03, "sb": 0.03}  # gap 0.05 <= 2 * sqrt(2) * 0.03
    assert C.judge(rule, m) == "inconclusive"
    m.update(sa=0.01, sb=0.01)
    assert C.judge(rule, m) == "does not hold"
    m.update(a=1.01)
    assert C.judge(rule, m) == "holds"  # a pass of "within" does not rest on the gap
    rule = C.above("a", "b", 0.02, noise=["sa"])
    assert C.judge(rule, {"a": 1.1, "b": 1.0, "sa": 0.06}) == "inconclusive"
    assert C.judge(rule, {"a": 1.1, "b": 1.0, "sa": 0.04}) == "holds"
    assert C.judge(rule, {"a": 1.1, "b": 1.0, "sa": None}) == "holds"  # one seed: no noise estimate


@pytest.mark.parametrize("missing", [None, math.nan, math.inf])
def test_missing_values_are_inconclusive(missing):
    assert C.judge(C.within("a", "b", 0.02), {"a": missing, "b": 1.0}) == "inconclusive"
    assert C.judge(C.above("a", "b"), {"b": 1.0}) == "inconclusive"


def test_all_and_any():
    yes, no, unsure = C.at_least("one", 1), C.at_least("zero", 1), C.at_least("none", 1)
    m = {"one": 1, "zero": 0, "none": None}
    assert C.judge(C.all_of(yes, yes), m) == "holds"
    assert C.judge(C.all_of(yes, no, unsure), m) == "does not hold"
    assert C.judge(C.all_of(yes, unsure), m) == "inconclusive"
    assert C.judge(C.any_of(no, yes, unsure), m) == "holds"
    assert C.judge(C.any_of(no, no), m) == "does not hold"
    assert C.judge(C.any_of(no, unsure), m) == "inconclusive"


def test_claim_records_verdict_and_rule_in_words():
    c = C.claim("x.y", "a is like b", "somebody (2020)", {"a": 1.0, "b": 1.5}, C.within("a", "b", 0.02))
    assert c["verdict"] == "does not hold"
    assert "a within 2% of b" in c["rule_text"]
    assert C.describe(C.all_of(C.at_most("a", 2), C.at_least("b", 1))) == "(a <= 2 and b >= 1)"


def test_unknown_rule_kind_is_an_error():
    with pytest.raises(ValueError, match="unknown rule kind 'between'"):
        C.judge({"kind": "between", "a": "a", "b": 1}, {"a": 1})


def test_given_is_inconclusive_unless_its_condition_holds():
    rule = C.given(C.at_most("warm", "base", -0.1), C.above("cold", "warm", 0.02))
    m = {"base": 3.4, "warm": 2.0, "cold": 2.5}
    assert C.judge(rule, m) == "holds"
    assert C.judge(rule, {**m, "cold": 1.9}) == "does not hold"
    assert C.judge(rule, {**m, "warm": 3.39, "cold": 3.39}) == "inconclusive"  # nothing trained: untestable
    assert C.describe(rule) == "if warm <= base x 0.9 then cold at least 2% above warm (not above it: does not hold; in between: inconclusive), else inconclusive"
