"""Claims and the rules that judge them.

A claim is a published statement, the numbers measured to test it, and a rule that turns those
numbers into a verdict: ``holds``, ``does not hold`` or ``inconclusive``. Rules are plain data
(so results.json shows exactly how each verdict was reached and a reader can recompute it) and
:func:`judge` is the only place verdicts come from; nothing writes a verdict by hand.

Leaf rules compare a measured value ``a`` (a key of ``measured``) with ``b`` (a key or a number):

- ``within``:   |a - b| <= rel |b| holds; otherwise does not hold.
- ``above``:    a >= b (1 + rel) holds; a <= b does not hold; in between inconclusive.
- ``below``:    a <= b (1 - rel) holds; a >= b does not hold; in between inconclusive.
- ``at_most``:  a <= b (1 + rel) holds; otherwise does not hold.
- ``at_least``: a >= b (1 - rel) holds; otherwise does not hold.

``given`` judges its ``then`` rule only when its ``if`` rule holds, and is inconclusive otherwise:
a claim about what warmup changes cannot be tested where nothing trained in the first place.

``noise`` (a list of keys of standard deviations, e.g. over seeds) makes a verdict that rests on a
gap no larger than twice the combined noise ``inconclusive`` instead: a difference the seeds
themselves produce does not decide a claim either way. A missing value (None: a run diverged, or
nothing was measured) makes a leaf inconclusive. ``all`` and ``any`` combine rules.
"""

from __future__ import annotations

import math

HOLDS, FAILS, UNSURE = "holds", "does not hold", "inconclusive"
VERDICTS = (HOLDS, FAILS, UNSURE)
LEAVES = ("within", "above", "below", "at_most", "at_least")


def _value(measured: dict, ref):
    if isinstance(ref, (int, float)) and not isinstance(ref, bool):
        return float(ref)
    v = measured.get(ref)
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return None
    return float(v)


def _noise(measured: dict, keys) -> float:
    total = 0.0
    for k in keys or ():
        v = measured.get(k)
        if v is not None and math.isfinite(v):
            total += float(v) ** 2
    return 2 * math.sqrt(total)


def judge(rule: dict, measured: dict) -> str:
    """The verdict of ``rule`` on ``measured`` (see the module docstring)."""
    kind = rule["kind"]
    if kind == "given":
        return judge(rule["then"], measured) if judge(rule["if"], measured) == HOLDS else UNSURE
    if kind in ("all", "any"):
        verdicts = [judge(r, measured) for r in rule["rules"]]
        decisive, other = (FAILS, HOLDS) if kind == "all" else (HOLDS, FAILS)
        if decisive in verdicts:
            return decisive
        return other if all(v == other for v in verdicts) else UNSURE
    if kind not in LEAVES:
        raise ValueError(f"unknown rule kind {kind!r}; expected one of {', '.join(LEAVES + ('all', 'any', 'given'))}")
    a, b = _value(measured, rule["a"]), _value(measured, rule["b"])
    if a is None or b is None:
        return UNSURE
    rel = rule.get("rel", 0.0)
    noise = _noise(measured, rule.get("noise"))
    gap = abs(a - b)
    if kind == "within":
        verdict = HOLDS if gap <= rel * abs(b) else FAILS
    elif kind == "above":
        verdict = HOLDS if a >= b * (1 + rel) else FAILS if a <= b else UNSURE
    elif kind == "below":
        verdict = HOLDS if a <= b * (1 - rel) else FAILS if a >= b else UNSURE
    elif kind == "at_most":
        verdict = HOLDS if a <= b * (1 + rel) else FAILS
    else:  # at_least
        verdict = HOLDS if a >= b * (1 - rel) else FAILS
    # "within" and "at_most" hold on a small gap: only their failures rest on the gap; the others
    # hold on a large one, so only their passes do
    rests_on_gap = verdict == FAILS if kind in ("within", "at_most", "at_least") else verdict == HOLDS
    if rests_on_gap and noise and gap <= noise:
        return UNSURE
    return verdict


def describe(rule: dict) -> str:
    """The rule in words, as the report prints it."""
    kind = rule["kind"]
    if kind == "given":
        return f"if {describe(rule['if'])} then {describe(rule['then'])}, else inconclusive"
    if kind in ("all", "any"):
        joiner = " and " if kind == "all" else " or "
        return "(" + joiner.join(describe(r) for r in rule["rules"]) + ")"
    a, b, rel = rule["a"], rule["b"], rule.get("rel", 0.0)
    b_txt = f"{b:g}" if isinstance(b, (int, float)) else b
    pct = f"{rel:.0%}" if rel else ""
    if kind == "within":
        text = f"{a} within {pct} of {b_txt}"
    elif kind == "above":
        text = f"{a} at least {pct} above {b_txt}" if rel else f"{a} above {b_txt}"
        if rel:
            text += " (not above it: does not hold; in between: inconclusive)"
    elif kind == "below":
        text = f"{a} at least {pct} below {b_txt}" if rel else f"{a} below {b_txt}"
        if rel:
            text += " (not below it: does not hold; in between: inconclusive)"
    elif kind == "at_most":
        text = f"{a} <= {b_txt}" + (f" x {1 + rel:g}" if rel else "")
    else:
        text = f"{a} >= {b_txt}" + (f" x {1 - rel:g}" if rel else "")
    if rule.get("noise"):
        text += "; inconclusive when the gap is within 2 standard deviations of the seed noise"
    return text


def claim(cid: str, text: str, source: str, measured: dict, rule: dict) -> dict:
    """A claim record with its verdict computed from ``measured`` by ``rule``."""
    return {"id": cid, "claim": text, "source": source, "measured": measured, "rule": rule,
            "rule_text": describe(rule), "verdict": judge(rule, measured)}


# Rule builders, so that presets read as sentences.
def within(a, b, rel, noise=None) -> dict:
    return _leaf("within", a, b, rel, noise)


def above(a, b, rel=0.0, noise=None) -> dict:
    return _leaf("above", a, b, rel, noise)


def below(a, b, rel=0.0, noise=None) -> dict:
    return _leaf("below", a, b, rel, noise)


def at_most(a, b, rel=0.0, noise=None) -> dict:
    return _leaf("at_most", a, b, rel, noise)


def at_least(a, b, rel=0.0, noise=None) -> dict:
    return _leaf("at_least", a, b, rel, noise)


def all_of(*rules) -> dict:
    return {"kind": "all", "rules": list(rules)}


def any_of(*rules) -> dict:
    return {"kind": "any", "rules": list(rules)}


def given(condition: dict, then: dict) -> dict:
    return {"kind": "given", "if": condition, "then": then}


def _leaf(kind, a, b, rel, noise) -> dict:
    rule = {"kind": kind, "a": a, "b": b}
    if rel:
        rule["rel"] = rel
    if noise:
        rule["noise"] = list(noise)
    return rule
