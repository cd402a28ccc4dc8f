"""Claims and the rules that judge them.

A claim is a published statement, the numbers measured to test it, and a rule that turns those
numbers into a verdict: ``holds``, ``does not hold`` or ``inconclusive``. Rules are plain data
(so results.json shows exactly how each verdict was reached and a reader can recompute it) and
:func:`evaluate` is the only place verdicts come from; nothing writes a verdict by hand.

Measured values are either samples (a list: one value per seed, or per timing process) or exact
numbers (a count, a constant such as the unigram loss, or a worst case over everything measured).

A leaf rule compares ``a`` (a key) with ``b`` (a key or a number) through the relative gap
g = (mean a - mean b) / |mean b| (for b = 0: the difference itself). On samples, g gets a 95%
Student t interval [lo, hi]: Welch's for two independent sets of samples, a one-sample interval
when b is exact, or the interval of the mean pairwise difference when the rule is ``paired``
(samples taken side by side, such as step times measured in the same process). With margin m:

- ``within``:   holds when [lo, hi] lies inside [-m, m] (two one-sided tests); does not hold when it
                lies wholly outside; otherwise inconclusive.
- ``above``:    holds when lo >= m ("a at least m above b"); does not hold when hi <= 0 (the interval
                excludes the claimed direction); otherwise inconclusive. ``below`` mirrors it.
- ``at_most``:  holds when hi <= m; does not hold when lo > m. ``at_least``: holds when lo >= -m;
                does not hold when hi < -m. Otherwise inconclusive.

Fewer than two samples give no interval, so such a leaf is inconclusive. ``point`` leaves are judged
on exact numbers, with lo = hi = g: they are for gross outcomes (divergence counts, non-finite
outputs) and worst cases, where one observation decides. A missing value (None or non-finite: a
run diverged, nothing was measured) is dropped from the samples, and makes an exact value missing.

Every threshold (a non-zero margin, or a literal ``b``) carries its ``origin``: ``source`` with the
sentence or number from the paper, or ``normlab`` with a line saying why the lab chose it.

``given`` judges its ``then`` rule only when its ``if`` rule holds, and is inconclusive otherwise:
a claim about what warmup changes cannot be tested where nothing trained in the first place.
``all`` and ``any`` combine rules.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

HOLDS, FAILS, UNSURE = "holds", "does not hold", "inconclusive"
VERDICTS = (HOLDS, FAILS, UNSURE)
LEAVES = ("within", "above", "below", "at_most", "at_least")
LEVEL = 0.95  # two-sided confidence of every interval (so each one-sided test is at 2.5%)


# ------------------------------------------------------------------------------ statistics

_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(96)


def t_quantile(p: float, df: float) -> float:
    """The p-quantile (p > 0.5) of Student's t with ``df`` >= 1 degrees of freedom (real df, as
    Welch's interval needs): bisection on the CDF, whose density is integrated by Gauss-Legendre."""
    if not 0.5 < p < 1 or not df >= 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(t: float) -> float:
        x = 0.5 * t * (_NODES + 1)
        return 0.5 + 0.5 * t * float(np.dot(_WEIGHTS, c * (1 + x * x / df) ** (-(df + 1) / 2)))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return 0.5 * (lo + hi)


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def interval(a: list, b, *, paired: bool = False, absolute: bool = False) -> dict | None:
    """The 95% interval of the relative gap (mean a - mean b) / |mean b| (of mean a - mean b
    itself when ``absolute`` or when b is 0).

    ``b`` is a list of samples (Welch, or pairwise differences when ``paired``) or an exact number
    (one-sample interval). None when there is no interval: fewer than two samples on a side."""
    if paired:
        pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None and math.isfinite(x) and math.isfinite(y)]
        if len(pairs) < 2:
            return None
        d = [x - y for x, y in pairs]
        scale = abs(statistics.fmean(y for _, y in pairs))
        est, se, df = statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d)), len(d) - 1
        n = (len(pairs), len(pairs))
    else:
        xa = _finite(a)
        if len(xa) < 2:
            return None
        if isinstance(b, list):
            xb = _finite(b)
            if len(xb) < 2:
                return None
            va, vb = statistics.variance(xa) / len(xa), statistics.variance(xb) / len(xb)
            scale = abs(statistics.fmean(xb))
            est, se = statistics.fmean(xa) - statistics.fmean(xb), math.sqrt(va + vb)
            # Welch-Satterthwaite degrees of freedom
            df = (va + vb) ** 2 / (va**2 / (len(xa) - 1) + vb**2 / (len(xb) - 1)) if va + vb > 0 else len(xa) + len(xb) - 2
            n = (len(xa), len(xb))
        else:
            scale = abs(b)
            est, se, df = statistics.fmean(xa) - b, statistics.stdev(xa) / math.sqrt(len(xa)), len(xa) - 1
            n = (len(xa), None)
    relative = scale > 0 and not absolute
    scale = scale if relative else 1.0  # b = 0: the gap is the difference itself
    half = t_quantile(0.5 + LEVEL / 2, df) * se
    return {"gap": est / scale, "lo": (est - half) / scale, "hi": (est + half) / scale, "df": df, "n": n,
            "relative": relative}


# ---------------------------------------------------------------------------------- judging


def _exact(measured: dict, ref):
    """An exact number, or None when missing; samples are an error for a point rule."""
    v = _samples(measured, ref)
    if isinstance(v, list):
        raise ValueError(f"{ref} holds samples, but the rule compares exact values (point); use a sampled rule")
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


def _decide(kind: str, lo: float, hi: float, m: float) -> str:
    if kind == "within":
        return HOLDS if -m <= lo and hi <= m else FAILS if lo > m or hi < -m else UNSURE
    if kind == "above":
        return HOLDS if (lo >= m if m else lo > 0) else FAILS if hi <= 0 else UNSURE
    if kind == "below":
        return HOLDS if (hi <= -m if m else hi < 0) else FAILS if lo >= 0 else UNSURE
    if kind == "at_most":
        return HOLDS if hi <= m else FAILS if lo > m else UNSURE
    return HOLDS if lo >= -m else FAILS if hi < -m else UNSURE  # at_least


def _judge_leaf(rule: dict, measured: dict) -> tuple[str, str]:
    kind, a, b, m = rule["kind"], rule["a"], rule["b"], rule.get("rel", 0.0)
    if rule.get("point"):
        va, vb = _exact(measured, a), _exact(measured, b)
        if va is None or vb is None:
            return UNSURE, f"{a} vs {_b_text(b)}: not measured (a run diverged or nothing was measured): inconclusive"
        gap = (va - vb) / abs(vb) if vb and not rule.get("absolute") else va - vb
        verdict = _decide(kind, gap, gap, m)
        what = f"{_num(va)}" + (f" vs {b} = {_num(vb)}" if isinstance(b, str) else "")
        return verdict, f"{a}: {what}, must be {_requirement(rule)} (exact; {rule['point']}): {verdict}"
    va, vb = _samples(measured, a), _samples(measured, b)
    if va is None or vb is None:
        return UNSURE, f"{a} vs {_b_text(b)}: not measured: inconclusive"
    if not isinstance(va, list):
        va = [va]
    over = rule.get("over", "seeds")
    ci = interval(va, vb, paired=rule.get("paired", False), absolute=rule.get("absolute", False))
    if ci is None:
        n = len(_finite(va))
        return UNSURE, (f"{a} vs {_b_text(b)}: {n} {over if n != 1 else over.rstrip('s')} {'give' if n != 1 else 'gives'} no interval "
                        f"(at least 2 needed on each side): inconclusive")
    verdict = _decide(kind, ci["lo"], ci["hi"], m)
    fmt = _pct if ci["relative"] else _num
    na, nb = ci["n"]
    ns = f"{na} {over}" if nb is None else (f"{na} pairs of {over}" if rule.get("paired") else f"{na} and {nb} {over}")
    test = "paired t" if rule.get("paired") else "one-sample t" if nb is None else "Welch t"
    gap_rule = _target_text(rule) if m else {"within": "0", "above": "> 0", "below": "< 0", "at_most": "<= 0",
                                              "at_least": ">= 0"}[kind]
    return verdict, (f"{a} vs {_b_text(b)}: gap {fmt(ci['gap'])} (95% CI {fmt(ci['lo'])} to {fmt(ci['hi'])}, {ns}, "
                     f"{test}, df {ci['df']:.3g}), must be {gap_rule}: {verdict}")


def evaluate(rule: dict, measured: dict) -> tuple[str, list[str]]:
    """The verdict of ``rule`` on ``measured`` and the evidence: one line per leaf judged, with
    its interval, sample count and outcome (see the module docstring)."""
    kind = rule["kind"]
    if kind == "given":
        cond, lines = evaluate(rule["if"], measured)
        if cond != HOLDS:
            return UNSURE, [f"precondition {cond}: " + line for line in lines]
        then, more = evaluate(rule["then"], measured)
        return then, ["precondition holds: " + line for line in lines] + more
    if kind in ("all", "any"):
        results = [evaluate(r, measured) for r in rule["rules"]]
        verdicts = [v for v, _ in results]
        decisive, other = (FAILS, HOLDS) if kind == "all" else (HOLDS, FAILS)
        verdict = decisive if decisive in verdicts else other if all(v == other for v in verdicts) else UNSURE
        return verdict, [line for _, lines in results for line in lines]
    if kind not in LEAVES:
        raise ValueError(f"unknown rule kind {kind!r}; expected one of {', '.join(LEAVES + ('all', 'any', 'given'))}")
    verdict, line = _judge_leaf(rule, measured)
    return verdict, [line]


def judge(rule: dict, measured: dict) -> str:
    """The verdict of ``rule`` on ``measured``."""
    return evaluate(rule, measured)[0]


# ------------------------------------------------------------------------------------- text


def _num(v: float) -> str:
    return f"{v:.4g}"


def _pct(v: float) -> str:
    return f"{v:+.1%}"


def _b_text(b) -> str:
    return f"{b:g}" if isinstance(b, (int, float)) else b


def _target_text(rule: dict) -> str:
    kind, b, m = rule["kind"], rule["b"], rule.get("rel", 0.0)
    if rule.get("absolute") and m:
        return {"within": f"within +-{m:g} of", "above": f"at least {m:g} above", "below": f"at least {m:g} below",
                "at_most": f"at most {m:g} above" if m > 0 else f"at least {-m:g} below",
                "at_least": f"at most {m:g} below" if m > 0 else f"at least {-m:g} above"}[kind]
    if isinstance(b, (int, float)) and b == 0:
        return {"within": f"within +-{m:g} of 0", "above": "above 0", "below": "below 0", "at_most": f"at most {m:g}",
                "at_least": f"at least {-m:g}"}[kind]
    pct = f"{abs(m) * 100:.3g}%"
    if kind == "at_most" and m:
        return f"at most {pct} above" if m > 0 else f"at least {pct} below"
    if kind == "at_least" and m:
        return f"at most {pct} below" if m > 0 else f"at least {pct} above"
    return {"within": f"within +-{pct}", "above": f"at least {pct} above" if m else "above",
            "below": f"at least {pct} below" if m else "below", "at_most": "at most", "at_least": "at least"}[kind]


def _requirement(rule: dict) -> str:
    """What the rule asks of a, in words, b included."""
    b = rule["b"]
    if isinstance(b, (int, float)) and b == 0:
        return _target_text(rule)
    return f"{_target_text(rule)} {_b_text(b)}"


def describe(rule: dict) -> str:
    """The rule in words, as the report prints it."""
    kind = rule["kind"]
    if kind == "given":
        return f"if {describe(rule['if'])} then {describe(rule['then'])}, else inconclusive"
    if kind in ("all", "any"):
        joiner = " and " if kind == "all" else " or "
        return "(" + joiner.join(describe(r) for r in rule["rules"]) + ")"
    text = f"{rule['a']} {_requirement(rule)}"
    if kind in ("above", "below") and rule.get("rel"):
        text += f" (not {kind} it: does not hold; in between: inconclusive)"
    if rule.get("point"):
        text += f" [exact: {rule['point']}]"
    else:
        text += f" [95% t interval over {rule.get('over', 'seeds')}" + (", paired" if rule.get("paired") else "") + "]"
    return text


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
    return [f"{what}: from the source ({o['text']})" if o["by"] == "source" else f"{what}: normlab's choice ({o['text']})"]


def claim(cid: str, text: str, source: str, measured: dict, rule: dict, conditions: list[str] | None = None) -> dict:
    """A claim record with its verdict and evidence computed from ``measured`` by ``rule``."""
    verdict, evidence = evaluate(rule, measured)
    record = {"id": cid, "claim": text, "source": source, "measured": measured, "rule": rule,
              "rule_text": describe(rule), "origins": origins(rule), "evidence": evidence, "verdict": verdict}
    if conditions:
        record["conditions"] = conditions
    return record


def recheck(results: dict) -> list[str]:
    """The claims of a results.json whose recorded verdict does not follow from their numbers by
    their rule ("preset: claim id"); an honest file has none."""
    return [f"{name}: {c['id']}" for name, section in results.get("presets", {}).items()
            for c in section.get("claims", []) if judge(c["rule"], c["measured"]) != c["verdict"]]


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
          over: str = "seeds", absolute: bool = False) -> dict:
    """``point``: why this leaf is judged on exact values (e.g. "a count of diverged runs");
    ``over``: what the samples are drawn over (seeds, processes, rounds, input draws);
    ``absolute``: the gap and the margin ``rel`` are a - b itself, not relative to b (slopes)."""
    literal = isinstance(b, (int, float)) and not isinstance(b, bool)
    if (rel or literal) and not origin:
        raise ValueError(f"the threshold of {kind}({a!r}, {b!r}, {rel}) needs an origin: C.source(...) or C.ours(...)")
    if origin and origin.get("by") not in ("source", "normlab"):
        raise ValueError(f"origin must come from C.source(...) or C.ours(...), got {origin!r}")
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
    return rule
