"""Claims and the rules that judge them.

A claim is a published statement, the numbers measured to test it, and a rule that turns those
numbers into a verdict: ``holds``, ``does not hold`` or ``inconclusive``. Rules are plain data
(so results.json shows exactly how each verdict was reached and a reader can recompute it) and
:func:`evaluate` is the only place verdicts come from; nothing writes a verdict by hand.

Measured values are either samples (a list: one value per seed, or per timing process) or exact
numbers (a count, a constant such as the unigram loss, or a worst case over everything measured).

**The gap.** A leaf rule compares ``a`` (a key) with ``b`` (a key or a number). A relative gap is
a log ratio, so that the noise of the denominator counts and no interval passes -100%: log(a/b)
per pair when the rule is ``paired`` (samples taken side by side: seeds that share data order and
init, step times from the same process), mean log a minus mean log b (Welch) for independent
samples, mean log a minus log b (one-sample) for an exact b. The report shows exp(.) - 1. An
``absolute`` gap (slopes, differences of shares), or any gap against an exact 0, is a - b itself.
Intervals and p-values come from scipy.stats (ttest_rel, ttest_ind(equal_var=False),
ttest_1samp). Fewer than two samples, or samples without spread, give no t interval.

**The decision.** With margin m each leaf asks one of three things of the gap g:

- ``within``:  -m <= g <= m (equivalence: two one-sided tests) against |g| > m;
- ``above``:   g > m against g < m (``at_least`` is the same test against -m); with m = 0 a
               plain direction;
- ``below``:   g < -m against g > -m (``at_most``: g < m against g > m).

Each side has a one-sided p-value; the leaf's p is twice the smaller one (a two-sided test of
"which side is it on"), and the leaf concludes that side when p <= alpha. At alpha = 0.05 this is
exactly the reading of the 95% interval: ``holds`` when it lies beyond (or, for within, inside)
the margin, ``does not hold`` when it lies wholly on the other side (so "at least 7% faster" is
rejected by an interval of 6.1% to 7.0%), ``inconclusive`` only when it straddles the margin.

**Family-wise.** One ``normlab compare`` invocation tests many leaves. :func:`familywise` adjusts
their p-values by Holm's step-down (uniformly more powerful than Bonferroni and, like it, valid
under any dependence between the tests, which the presets' shared runs create) so that the
chance of any wrong conclusive verdict in the family is at most 5%. Each claim keeps its plain
per-claim verdict beside the family-wise one.

**Exact leaves.** ``point`` leaves are judged on exact numbers (a divergence count, a non-finite
output, a worst case over everything measured): there is nothing to sample, so they are outside
the family. ``test="sign"`` judges a discrete outcome (a best learning rate on a grid) by the
exact sign test over pairs, never by a t interval of zero width. A missing value (None or
non-finite: a run diverged, nothing was measured) is dropped from the samples.

Every threshold (a non-zero margin, or a literal ``b``) carries its ``origin``: ``source`` with the
sentence or number from the paper, or ``normlab`` with a line saying why the lab chose it.

``given`` judges its ``then`` rule only when its ``if`` rule holds, and is inconclusive otherwise:
a claim about what warmup changes cannot be tested where nothing trained in the first place.
``all`` and ``any`` combine rules.
"""

from __future__ import annotations

import bisect
import math

from scipy import stats as S

# holm and holm_adjust are part of this module's API too (the ladder and the tests adjust through it)
from normlab.intervals import finite, holm, holm_adjust, holm_of, interval, pairs  # noqa: F401

HOLDS, FAILS, UNSURE = "holds", "does not hold", "inconclusive"
VERDICTS = (HOLDS, FAILS, UNSURE)
LEAVES = ("within", "above", "below", "at_most", "at_least")
ALPHA = 0.05  # the family-wise error of one invocation's verdicts (and the plain per-claim error)
TESTS = ("t", "sign")


# ---------------------------------------------------------------------------------- judging


def _exact(measured: dict, ref):
    """An exact number, or None when missing; samples are an error for a point rule."""
    v = _samples(measured, ref)
    if isinstance(v, list):
        raise ValueError(f"{ref} holds samples, but the rule compares exact values (point); use a sampled "
                         "rule")
    return v


def _samples(measured: dict, ref):
    """Samples as a list, an exact number, or None when missing."""
    if isinstance(ref, (int, float)) and not isinstance(ref, bool):
        return float(ref)
    v = measured.get(ref)
    if isinstance(v, list):
        return v
    if v is None or not math.isfinite(v):
        return None
    return float(v)


def _sides(rule: dict) -> tuple[str, float, float]:
    """The leaf's question as thresholds on the gap in its shown units: ("within", lo, hi), or
    ("greater" / "less", threshold, threshold) for what ``holds`` asks."""
    kind, m = rule["kind"], rule.get("rel", 0.0)
    if kind == "within":
        return "within", -m, m
    c = {"above": m, "at_least": -m, "below": -m, "at_most": m}[kind]
    return ("greater" if kind in ("above", "at_least") else "less"), c, c


def _to_test_units(g: float, relative: bool) -> float:
    if not relative:
        return g
    return math.log1p(g) if g > -1 else -math.inf


def _p_sides(rule: dict, ci: dict) -> tuple[float, float]:
    """One-sided p-values (for ``holds``, for ``does not hold``) of a t leaf."""
    shape, lo, hi = _sides(rule)
    lo, hi = _to_test_units(lo, ci["relative"]), _to_test_units(hi, ci["relative"])

    def gt(c):  # p of concluding gap > c
        return float(S.t.sf((ci["est"] - c) / ci["se"], ci["df"])) if math.isfinite(c) else 0.0

    def lt(c):  # p of concluding gap < c
        return float(S.t.cdf((ci["est"] - c) / ci["se"], ci["df"])) if math.isfinite(c) else 1.0

    if shape == "within":
        return max(gt(lo), lt(hi)), min(gt(hi), lt(lo))
    return (gt(lo), lt(lo)) if shape == "greater" else (lt(lo), gt(lo))


def _sign_counts(rule: dict, va, vb) -> tuple[int, int, int]:
    """(pairs above the threshold, below it, ties) for a sign-test leaf."""
    _, c, _ = _sides(rule)
    d = [x - y for x, y in pairs(va, vb)] if isinstance(vb, list) else [x - vb for x in finite(va)]
    above, below = sum(x > c for x in d), sum(x < c for x in d)
    return above, below, len(d) - above - below


def _p_sign(rule: dict, above: int, below: int) -> tuple[float, float]:
    n = above + below
    if n == 0:
        return 1.0, 1.0
    p_gt = float(S.binomtest(above, n, 0.5, alternative="greater").pvalue)
    p_lt = float(S.binomtest(below, n, 0.5, alternative="greater").pvalue)
    return (p_gt, p_lt) if _sides(rule)[0] == "greater" else (p_lt, p_gt)


def _decided(p_hold: float, p_fail: float, alpha: float) -> tuple[str, float]:
    """The leaf's p (twice the smaller side) and the side it concludes at ``alpha``."""
    p = min(1.0, 2 * min(p_hold, p_fail))
    return (HOLDS if p_hold <= p_fail else FAILS) if p <= alpha else UNSURE, p


def _judge_leaf(rule: dict, measured: dict, adjust) -> tuple[str, str, float | None]:
    """(verdict, evidence line, p) of one leaf; p is None for exact leaves."""
    kind, a, b, m = rule["kind"], rule["a"], rule["b"], rule.get("rel", 0.0)
    if rule.get("point"):
        va, vb = _exact(measured, a), _exact(measured, b)
        if va is None or vb is None:
            return UNSURE, (f"{a} vs {_b_text(b)}: not measured (a run diverged or nothing was measured): "
                            "inconclusive"), None
        gap = (va - vb) / abs(vb) if vb and not rule.get("absolute") else va - vb
        shape, lo, hi = _sides(rule)
        strict = kind in ("above", "below") and not m  # "above b" excludes b itself; "at least b" does not
        if shape == "within":
            verdict = HOLDS if lo <= gap <= hi else FAILS
        elif shape == "greater":
            verdict = HOLDS if (gap > lo if strict else gap >= lo) else FAILS
        else:
            verdict = HOLDS if (gap < lo if strict else gap <= lo) else FAILS
        what = f"{_num(va)}" + (f" vs {b} = {_num(vb)}" if isinstance(b, str) else "")
        return verdict, (f"{a}: {what}, must be {_requirement(rule)} (exact; {rule['point']}; not a sampled "
                         f"test): {verdict}"), None
    va, vb = _samples(measured, a), _samples(measured, b)
    if va is None or vb is None:
        return UNSURE, f"{a} vs {_b_text(b)}: not measured: inconclusive", 1.0
    if not isinstance(va, list):
        va = [va]
    over = rule.get("over", "seeds")
    if rule.get("test") == "sign":
        up, down, ties = _sign_counts(rule, va, vb)
        p_hold, p_fail = _p_sign(rule, up, down)
        verdict, p = _decided(p_hold, p_fail, ALPHA)
        line = (f"{a} vs {_b_text(b)}: {up} of {up + down + ties} {over} above {_sides(rule)[1] + 0:g}, "
                f"{down} below, {ties} tied (exact sign test), must be {_target_text(rule)}")
        return _finish(line, verdict, p, p_hold <= p_fail, adjust)
    ci = interval(va, vb, paired=rule.get("paired", False), absolute=rule.get("absolute", False))
    if ci is None or "none" in ci:
        n = len(finite(va))
        unit = over if n != 1 else over.rstrip("s")
        verb = "give" if n != 1 else "gives"
        why = (f"{n} {unit}: " + ci["none"] if ci
               else f"{n} {unit} {verb} no interval (at least 2 needed on each side)")
        return UNSURE, f"{a} vs {_b_text(b)}: {why}: inconclusive", 1.0
    p_hold, p_fail = _p_sides(rule, ci)
    verdict, p = _decided(p_hold, p_fail, ALPHA)
    fmt = _pct if ci["relative"] else _num
    na, nb = ci["n"]
    ns = f"{na} {over}" if nb is None else (f"{na} pairs of {over}" if rule.get("paired")
                                            else f"{na} and {nb} {over}")
    test = ci["test"] + (" on log ratios" if ci["relative"] else "")
    line = (f"{a} vs {_b_text(b)}: gap {fmt(ci['gap'])} (95% CI {fmt(ci['gap_lo'])} to {fmt(ci['gap_hi'])}, "
            f"{ns}, {test}, df {ci['df']:.3g}), must be {_gap_rule(rule)}")
    supports = _supports(rule, ci)
    return _finish(line + (f"; {supports}" if supports else ""), verdict, p, p_hold <= p_fail, adjust)


def _finish(line: str, verdict: str, p: float, leans_holds: bool, adjust) -> tuple[str, str, float]:
    """The evidence line's ending: the plain p and verdict, and the family-wise ones when adjusted."""
    if adjust is None:
        return verdict, f"{line}; p {_p(p)}: {verdict}", p
    q = adjust(p)
    family = (HOLDS if leans_holds else FAILS) if q <= ALPHA else UNSURE
    return family, f"{line}; p {_p(p)} ({verdict} alone), Holm-adjusted p {_p(q)}: {family}", p


def _supports(rule: dict, ci: dict) -> str:
    """What the interval supports, in words, where the claim states a size or an equivalence."""
    fmt = (lambda v: f"{abs(v):.1%}") if ci["relative"] else (lambda v: f"{abs(v):.4g}")
    signed = _pct if ci["relative"] else _num
    lo, hi = ci["gap_lo"], ci["gap_hi"]
    kind, (shape, c, _) = rule["kind"], _sides(rule)
    if shape == "within":
        return f"equivalent within +-{fmt(max(abs(lo), abs(hi)))} at 95%"
    if not rule.get("rel"):
        return ""
    if kind == "at_least":
        return f"the interval supports a gap of at least {signed(lo)}"
    if kind == "at_most":
        return f"the interval supports a gap of at most {signed(hi)}"
    if kind == "above":
        if lo > 0:
            return f"above by {fmt(lo)} to {fmt(hi)}" + (": the direction holds, the claimed size does not"
                                                         if hi < c else "")
        return "the interval does not exclude no gap" if hi > 0 else "below, not above"
    if hi < 0:
        return f"below by {fmt(hi)} to {fmt(lo)}" + (": the direction holds, the claimed size does not"
                                                     if lo > c else "")
    return "the interval does not exclude no gap" if lo < 0 else "above, not below"


ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")


def evaluate(rule: dict, measured: dict, adjust=None) -> tuple[str, list[str]]:
    """The verdict of ``rule`` on ``measured`` and the evidence: one line per leaf judged, with
    its interval, sample count, p and outcome (see the module docstring). ``adjust`` maps a
    leaf's p to its family-wise adjusted p (see :func:`familywise`); None: the plain verdict."""
    kind = rule["kind"]
    if kind == "given":
        cond, lines = evaluate(rule["if"], measured, adjust)
        if cond != HOLDS:
            return UNSURE, [f"precondition {cond}: " + line for line in lines]
        then, more = evaluate(rule["then"], measured, adjust)
        return then, ["precondition holds: " + line for line in lines] + more
    if kind in ("all", "any"):
        results = [evaluate(r, measured, adjust) for r in rule["rules"]]
        verdicts = [v for v, _ in results]
        decisive, other = (FAILS, HOLDS) if kind == "all" else (HOLDS, FAILS)
        verdict = decisive if decisive in verdicts else other if all(v == other for v in verdicts) else UNSURE
        lines = [line for _, lines in results for line in lines]
        if kind == "any" and len(results) > 1:  # an OR: each alternative says so where it is read
            which = [ORDINALS[i] for i, v in enumerate(verdicts) if v == HOLDS]
            verb = "hold" if len(which) > 1 else "holds"
            held = f"the {' and the '.join(which)} {verb}" if which else "none holds"
            lines = [f"one of {len(results)} alternatives suffices ({held}: {verdict}):"] + [
                f"{'either' if i == 0 else 'or'}: {line}" for i, (_, ls) in enumerate(results) for line in ls]
        return verdict, lines
    if kind not in LEAVES:
        raise ValueError(f"unknown rule kind {kind!r}; expected one of "
                         f"{', '.join(LEAVES + ('all', 'any', 'given'))}")
    verdict, line, _ = _judge_leaf(rule, measured, adjust)
    return verdict, [line]


def judge(rule: dict, measured: dict, adjust=None) -> str:
    """The verdict of ``rule`` on ``measured``."""
    return evaluate(rule, measured, adjust)[0]


def leaf_pvalues(rule: dict, measured: dict) -> list[float]:
    """The p of every sampled leaf of the rule, judged or not (a ``then`` whose precondition
    failed included): the tests a claim adds to its family, fixed by the rule, not by the data."""
    kind = rule["kind"]
    if kind == "given":
        return leaf_pvalues(rule["if"], measured) + leaf_pvalues(rule["then"], measured)
    if kind in ("all", "any"):
        return [p for r in rule["rules"] for p in leaf_pvalues(r, measured)]
    p = _judge_leaf(rule, measured, None)[2]
    return [] if p is None else [p]


def leaf_rows(rule: dict, measured: dict, family: dict | None = None) -> list[dict]:
    """One row per leaf of the rule, for claims.csv: what it compares, its test, the plain 95%
    interval of the gap (as the report shows it), n, p, the family-wise adjusted p and the leaf's
    verdicts. Exact leaves have no interval and no p."""
    kind = rule["kind"]
    if kind == "given":
        return leaf_rows(rule["if"], measured, family) + leaf_rows(rule["then"], measured, family)
    if kind in ("all", "any"):
        return [row for r in rule["rules"] for row in leaf_rows(r, measured, family)]
    adjust = _adjuster(family)
    plain, _, p = _judge_leaf(rule, measured, None)
    row = {"a": rule["a"], "b": rule["b"], "kind": kind, "margin": rule.get("rel", 0.0),
           "test": "exact" if rule.get("point") else rule.get("test", "t"), "gap": None, "ci_lo": None,
           "ci_hi": None,
           "n": None, "p": p, "p_adjusted": None if p is None or adjust is None else adjust(p),
           "verdict_plain": plain,
           "verdict": _judge_leaf(rule, measured, adjust)[0]}
    if rule.get("point") or rule.get("test") == "sign":
        return [row]
    va, vb = _samples(measured, rule["a"]), _samples(measured, rule["b"])
    ci = None if va is None or vb is None else interval(va if isinstance(va, list) else [va], vb,
                                                         paired=rule.get("paired", False),
                                                        absolute=rule.get("absolute", False))
    if ci and "none" not in ci:
        row.update(gap=ci["gap"], ci_lo=ci["gap_lo"], ci_hi=ci["gap_hi"], n=ci["n"][0], test=ci["test"] + (
            " (log ratio)" if ci["relative"] else ""))
    return [row]


def familywise(sections: list[dict], per_claim: bool = False) -> dict:
    """Judge the claims of one invocation's ``sections`` as one family: Holm's step-down over the
    p of every sampled leaf, so that the family-wise error is at most ALPHA. Sets each claim's
    ``verdict`` and ``evidence`` to the family-wise ones (the plain ones stay in ``verdict_plain``
    and ``evidence_plain``) and each section's ``family``; with ``per_claim`` the verdicts stay
    unadjusted and the family says so. Returns the family."""
    ps = [p for s in sections for c in s["claims"] for p in leaf_pvalues(c["rule"], c["measured"])]
    family = {"method": "none" if per_claim else "holm", "alpha": ALPHA, "size": len(ps), "p_values": ps}
    for s in sections:
        s["family"] = family
        for c in s["claims"]:
            c["verdict"], c["evidence"] = evaluate(c["rule"], c["measured"], _adjuster(family))
    return family


def _adjuster(family: dict | None):
    if not family or family.get("method") != "holm":
        return None
    return holm_of(sorted(family["p_values"]))


def recheck(results: dict) -> list[str]:
    """The claims of a results.json whose recorded verdicts (plain and family-wise) do not follow
    from their numbers by their rule and their section's family, or whose p-values are missing from
    that family ("preset: claim id"); an honest file has none."""
    bad = []
    for name, section in results.get("presets", {}).items():
        family = section.get("family")
        listed = sorted(family["p_values"]) if family else []
        for c in section.get("claims", []):
            ok = judge(c["rule"], c["measured"]) == c.get("verdict_plain", c["verdict"])
            if family:  # every p of the claim is one of its family's
                for p in leaf_pvalues(c["rule"], c["measured"]):
                    i = bisect.bisect_left(listed, p * (1 - 1e-9))
                    ok = ok and i < len(listed) and abs(listed[i] - p) <= 1e-9 * p + 1e-300
            ok = ok and judge(c["rule"], c["measured"], _adjuster(family)) == c["verdict"]
            if not ok:
                bad.append(f"{name}: {c['id']}")
    return bad


# ------------------------------------------------------------------------------------- text


def _num(v: float) -> str:
    return f"{v:.4g}"


def _pct(v: float) -> str:
    return f"{v:+.1%}"


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


def _b_text(b) -> str:
    return f"{b:g}" if isinstance(b, (int, float)) else b


def _gap_rule(rule: dict) -> str:
    """What the rule asks of the gap itself ("within +-2%", "at least 0.5 above")."""
    if rule.get("rel"):
        return _target_text(rule).removesuffix(" of")
    return {"within": "0", "above": "> 0", "below": "< 0", "at_most": "<= 0",
            "at_least": ">= 0"}[rule["kind"]]


def _target_text(rule: dict) -> str:
    kind, b, m = rule["kind"], rule["b"], rule.get("rel", 0.0)
    if rule.get("absolute") or (isinstance(b, (int, float)) and b == 0):
        of = "" if isinstance(b, (int, float)) and b == 0 and not rule.get("absolute") else " of"
        if not m:
            return {"within": "equal to", "above": "above", "below": "below", "at_most": "at most",
                    "at_least": "at least"}[kind]
        return {"within": f"within +-{m:g}{of}", "above": f"at least {m:g} above",
                "below": f"at least {m:g} below",
                "at_most": f"at most {m:g} above" if m > 0 else f"at least {-m:g} below",
                "at_least": f"at most {m:g} below" if m > 0 else f"at least {-m:g} above"}[kind]
    pct = f"{abs(m) * 100:.3g}%"
    if kind == "at_most" and m:
        return f"at most {pct} above" if m > 0 else f"at least {pct} below"
    if kind == "at_least" and m:
        return f"at most {pct} below" if m > 0 else f"at least {pct} above"
    return {"within": f"within +-{pct} of", "above": f"at least {pct} above" if m else "above",
            "below": f"at least {pct} below" if m else "below", "at_most": "at most",
            "at_least": "at least"}[kind]


def _requirement(rule: dict) -> str:
    """What the rule asks of a, in words, b included (an exact 0 is named too: "within +-0.25 of 0")."""
    return f"{_target_text(rule)} {_b_text(rule['b'])}"


def describe(rule: dict) -> str:
    """The rule in words, as the report prints it."""
    kind = rule["kind"]
    if kind == "given":
        return f"if {describe(rule['if'])} then {describe(rule['then'])}, else inconclusive"
    if kind in ("all", "any"):
        joiner = " and " if kind == "all" else " or "
        parts, said = [], set()
        for r in rule["rules"]:  # a bracket that a sibling already gave is not repeated in full
            text, how = describe(r), _how(r) if r["kind"] not in ("given", "all", "any") else ""
            parts.append(text.removesuffix(how) + "[as above]" if how and how in said else text)
            said.add(how)
        return "(" + joiner.join(parts) + ")"
    return f"{rule['a']} {_requirement(rule)} {_how(rule)}"


def _how(rule: dict) -> str:
    """How a leaf is judged, in brackets: exact, a sign test, or a t interval of what over what."""
    if rule.get("point"):
        return f"[exact: {rule['point']}]"
    if rule.get("test") == "sign":
        return f"[exact sign test over {rule.get('over', 'seeds')}]"
    gap = "difference" if rule.get("absolute") else "log ratio"
    return (
        f"[95% t interval of the {gap} over {rule.get('over', 'seeds')}"
        + (", paired" if rule.get("paired") else "")
        + "]"
    )


def origins(rule: dict) -> list[str]:
    """Each threshold of the rule with where it comes from."""
    if rule["kind"] == "given":
        return origins(rule["if"]) + origins(rule["then"])
    if rule["kind"] in ("all", "any"):
        return list(dict.fromkeys(o for r in rule["rules"] for o in origins(r)))
    o = rule.get("origin")
    if not o:
        return []
    what = f"{rule['a']} {_requirement(rule)}"
    return [f"{what}: from the source ({o['text']})" if o["by"] == "source"
            else f"{what}: normlab's choice ({o['text']})"]


def claim(cid: str, text: str, source: str, measured: dict, rule: dict,
          conditions: list[str] | None = None, parameters: float | None = None) -> dict:
    """A claim record with its verdict and evidence computed from ``measured`` by ``rule``: the
    plain per-claim ones, until :func:`familywise` judges the invocation's claims together.
    ``parameters``: the non-embedding size of the runs its measurements come from, where a preset
    trains models of more than one size (a ladder's trend places the claim there, not at the
    preset's median run)."""
    verdict, evidence = evaluate(rule, measured)
    record = {"id": cid, "claim": text, "source": source, "measured": measured, "rule": rule,
              "rule_text": describe(rule), "origins": origins(rule), "evidence": evidence, "verdict": verdict,
              "evidence_plain": evidence, "verdict_plain": verdict}
    if conditions:
        record["conditions"] = conditions
    if parameters:
        record["parameters"] = parameters
    return record


# ----------------------------------------------------------------------------- rule builders


def source(text: str) -> dict:
    """A threshold taken from the paper: ``text`` quotes the sentence or number."""
    return {"by": "source", "text": text}


def ours(text: str) -> dict:
    """A threshold the lab chose: ``text`` says why in one line."""
    return {"by": "normlab", "text": text}


def within(a, b, rel, **kw) -> dict:
    return _leaf("within", a, b, rel, **kw)


def above(a, b, rel=0.0, **kw) -> dict:
    return _leaf("above", a, b, rel, **kw)


def below(a, b, rel=0.0, **kw) -> dict:
    return _leaf("below", a, b, rel, **kw)


def at_most(a, b, rel=0.0, **kw) -> dict:
    return _leaf("at_most", a, b, rel, **kw)


def at_least(a, b, rel=0.0, **kw) -> dict:
    return _leaf("at_least", a, b, rel, **kw)


def all_of(*rules) -> dict:
    return {"kind": "all", "rules": list(rules)}


def any_of(*rules) -> dict:
    return {"kind": "any", "rules": list(rules)}


def given(condition: dict, then: dict) -> dict:
    return {"kind": "given", "if": condition, "then": then}


def _leaf(kind, a, b, rel, *, origin: dict | None = None, point: str | None = None, paired: bool = False,
          over: str = "seeds", absolute: bool = False, test: str = "t") -> dict:
    """``point``: why this leaf is judged on exact values (e.g. "a count of diverged runs");
    ``over``: what the samples are drawn over (seeds, processes, rounds, input draws);
    ``absolute``: the gap and the margin ``rel`` are a - b itself, not a ratio (slopes);
    ``test``: "t" (intervals) or "sign" (the exact sign test, for discrete outcomes: absolute)."""
    literal = isinstance(b, (int, float)) and not isinstance(b, bool)
    if (rel or literal) and not origin:
        raise ValueError(f"the threshold of {kind}({a!r}, {b!r}, {rel}) needs an origin: C.source(...) or "
                         "C.ours(...)")
    if origin and origin.get("by") not in ("source", "normlab"):
        raise ValueError(f"origin must come from C.source(...) or C.ours(...), got {origin!r}")
    if test not in TESTS:
        raise ValueError(f"test must be one of {', '.join(TESTS)}; got {test!r}")
    relative = not absolute and not (literal and b == 0)
    if relative and (kind == "within" or kind == "below") and rel >= 1:
        raise ValueError(f"{kind}({a!r}, {b!r}, {rel}): a relative margin of 100% or more cannot be "
                         "reached below b (a gap cannot pass -100%); use an absolute rule")
    if test == "sign" and (kind == "within" or relative or point):
        raise ValueError(f"the sign test judges a direction of differences: {kind}({a!r}, {b!r}) must be "
                         "above/below/at_most/at_least, absolute, and sampled")
    rule = {"kind": kind, "a": a, "b": b}
    if rel:
        rule["rel"] = rel
    if origin:
        rule["origin"] = origin
    if absolute:
        rule["absolute"] = True
    if point:
        rule["point"] = point
    else:
        rule["over"] = over
        if paired:
            rule["paired"] = True
        if test != "t":
            rule["test"] = test
    return rule
