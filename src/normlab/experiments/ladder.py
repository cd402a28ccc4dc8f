"""The size ladder: a preset's trained claims at three model widths, and trend claims on how each
effect moves with parameters.

**Rungs.** Width d_model times 0.5, 1 and 2 at the preset's depth and head count, so that the
non-embedding parameters (about 12 L d^2) grow about 4x a rung. The middle rung is the size the
lab already judges at (``--quick``: the verdicts in docs/results), so its runs are the same runs.
A preset that trains no run (gradients: gradient norms at initialization) measures its model at
the rung's width (``Lab.at_rung``), and each claim names the size of the model it measures.

**Tokens per parameter** are held at the middle rung's ratio: each rung trains for the preset's
steps times its parameters over the middle rung's (batch and sequence length fixed; warmup and
evaluation cadence scaled alike). Fixed before any ladder run, because a ladder that gave the
larger models fewer tokens per parameter would measure undertraining, not scale (Kaplan et al.
2020 and Hoffmann et al. 2022 compare sizes at a fixed budget rule). The ratio is the middle
rung's and not Chinchilla's 20 because 20 would need about 40x the compute of today's runs.
What a preset defines by its steps follows the rung's (``Lab.sized_train``): dyt's small data
set stays one its runs go over 164 times, so it grows with the rung as the tokens do.

**Learning rates** are not tuned again at each rung: each arm's rate (its tuned one where the
design has it) is multiplied by d_middle / d, the muP rule for Adam's hidden-layer rates (Yang et
al. 2022, "Tensor Programs V"). One rule for every arm, fixed before the data, so that it cannot
favour an arm; the report names it.

**Seeds**: 5 per arm and rung (``SEEDS``), every arm alike, unless --seeds says otherwise. Fixed
from the pilot's spread before any ladder run: the norms pilot's paired log-ratio sd of 0.8%
(RMSNorm vs LayerNorm) over 15 seed gaps at log10 parameters -0.6, 0, +0.6 gives a slope interval
of about +-0.009 per decade, inside that claim's 0.0198 margin, so a flat trend can be decided;
pRMSNorm's 3.2% spread cannot be, at this count (its trend is expected inconclusive).

**Trends.** For each claim whose effect leaf is a per-seed gap (paired runs, or runs against an
exact number), the gap of every seed at every rung where the claim's precondition holds (its
baseline trains: a rung that did not train says nothing about how an effect moves) (log ratio, or
a - b for absolute rules) is regressed on log10 of the rung's parameters (ordinary least squares,
seeds as the unit, scipy's linregress). An equivalence claim asks "the gap does not grow with
scale": the slope's 95% interval within +-(its margin) per decade of parameters, the smallest
drift that would carry the gap across the whole margin within one decade. A directional claim asks
"the effect grows with scale": the slope in the effect's direction above 0. Each trend is decided
on its p-value like a claim's leaf, with Holm's adjustment over the ladder's trends.

**Tokenizers** are a condition of the ladder (``--tokenizers char,bpe``): the same rungs and
seeds on characters and on BPE tokens of the same text, judged as one family, so that a
reader sees whether an effect is one of the architecture or of character-level text. BPE uses
``BPE_VOCAB`` = 2,048 merges+bytes unless ``bpe_vocab`` is set: fixed before any BPE run, as the
largest power of two whose embedding stays under half the middle quick rung's non-embedding
parameters (2,048 x 96 = 197k of 443k), where GPT-2's 50k would make the embedding ten times the
model; on the 5 MB corpus it still merges the frequent words whole. Each condition trains at the
rates tuned under its own tokens where the design holds a pilot for them (`compare PRESET --quick
--tune tokenizer=bpe bpe_vocab=2048` writes them under "quick|bpe2048"); where it does not, at
the character rates, and each arm's entry in results.json (settings.arm_lrs) says which. The rule
was fixed after the first BPE ladder, whose character rates left deep Post-LN and DeepNorm at 1/3 and 3x
Pre-LN's rate and reversed the character signs (docs/results/ladder-shallow-depth-quick-epyc).

**The gpu size** (``--size gpu``) applies the same rule once, from the full size to a width meant
for one GPU: d_model 768 with 64-wide heads (12 heads: GPT-2 small's width), depth unchanged (the
depth presets' claims are about depth, so one rule keeps every preset's depths), steps grown so
that tokens per parameter stay the full size's, and each rate times d_full / 768. A ladder at the
gpu size has rungs of 384, 768 and 1536. Its purpose is the costed plan (``--plan``): what the
claims cost at a size where the norms' share of a step and the depth effects look like a real
model's, before a cluster job is submitted.
"""

from __future__ import annotations

import math

from scipy import stats as S

from normlab import claims as C

WIDTHS = (0.5, 1.0, 2.0)  # d_model multipliers of the three rungs
MIDDLE = 1  # the rung at the preset's own size
SEEDS = 5  # per arm and rung (see the module's text)
LR_RULE = ("each arm's learning rate times d_middle / d (muP's Adam rule for hidden layers), "
           "not tuned again per rung")
TOKENIZERS = ("char", "byte", "bpe")  # the ladder's possible conditions (data.build_tokenizer's kinds)
BPE_VOCAB = 2048  # the BPE condition's vocabulary (see the module's text)
GPU_WIDTH, GPU_HEAD_DIM = 768, 64  # the gpu size (see the module's text)
GPU_RULE = (f"the full size's runs at d_model {GPU_WIDTH} ({GPU_HEAD_DIM}-wide heads) and their own depth, "
            "tokens per parameter held at the full size's, learning rates times d_full / d")
DRIFT = C.ours("one claim margin per decade of parameters: the smallest drift that carries the gap across "
               "the whole equivalence margin within a 10x larger model")


def condition_overrides(tokenizer: str, overrides: dict) -> dict:
    """The fields of every run under one tokenizer condition (the user's bpe_vocab, if set, wins)."""
    extra = {"bpe_vocab": overrides.get("bpe_vocab", BPE_VOCAB)} if tokenizer == "bpe" else {}
    return {**overrides, "tokenizer": tokenizer, **extra}


def width(d_model: int, n_heads: int, rung: int) -> int:
    """The rung's d_model: the preset's times WIDTHS[rung], a multiple of 2 * n_heads (even head
    dimensions for rotary positions)."""
    step = 2 * n_heads
    return max(step, int(round(d_model * WIDTHS[rung] / step)) * step)


def gpu_width(model_over: dict) -> dict:
    """The gpu size's width fields: d_model 768 and 64-wide heads, unless the user set them."""
    d = int(model_over.get("d_model", GPU_WIDTH))
    return {"d_model": d, "n_heads": int(model_over.get("n_heads", max(1, d // GPU_HEAD_DIM)))}


def scale_steps(train_fields: dict, ratio: float) -> dict:
    """Training fields with steps, warmup and evaluation cadence times ``ratio`` (tokens grow with
    parameters; batch and sequence length stay)."""
    out = dict(train_fields)
    for key in ("steps", "warmup", "eval_every"):
        if out.get(key):
            out[key] = max(1, int(round(out[key] * ratio)))
    return out


def scale_lr(train_fields: dict, factor: float) -> dict:
    out = dict(train_fields)
    for key in ("lr", "min_lr"):
        if out.get(key) is not None:
            out[key] = float(f"{out[key] * factor:.4g}")
    return out


# ---------------------------------------------------------------------------------- trends


def slope(x: list[float], y: list[float], level: float = 0.95) -> dict | None:
    """The least-squares slope of y on x with its t interval (n - 2 degrees of freedom), or None
    with fewer than three points or no spread in x."""
    pts = [(a, b) for a, b in zip(x, y) if b is not None and math.isfinite(b)]
    if len(pts) < 3 or len({a for a, _ in pts}) < 2:  # a slope needs two rungs and a residual
        return None
    r = S.linregress([a for a, _ in pts], [b for _, b in pts])
    df = len(pts) - 2
    half = float(S.t.ppf(0.5 + level / 2, df)) * float(r.stderr)
    return {"slope": float(r.slope), "se": float(r.stderr), "lo": float(r.slope) - half,
            "hi": float(r.slope) + half,
            "df": df, "n": len(pts), "intercept": float(r.intercept)}


def _effect_leaf(rule: dict) -> dict | None:
    """The claim's effect: its first sampled leaf over seeds whose gap has one value per seed
    (paired, or against an exact number), looking in a precondition's ``then`` first."""
    kind = rule["kind"]
    if kind == "given":
        return _effect_leaf(rule["then"])
    if kind in ("all", "any"):
        for r in rule["rules"]:
            leaf = _effect_leaf(r)
            if leaf:
                return leaf
        return None
    if rule.get("point") or rule.get("test") == "sign" or rule.get("over", "seeds") != "seeds":
        return None
    if not (rule.get("paired") or not isinstance(rule["b"], str)):
        return None
    return rule


def _relative(leaf: dict) -> bool:
    """The leaf's gap is a log ratio (not absolute, and not against an exact 0), as claims.py reads it."""
    return not leaf.get("absolute") and not (not isinstance(leaf["b"], str) and leaf["b"] == 0)


def seed_gaps(leaf: dict, measured: dict) -> list[float]:
    """One gap per seed: log(a/b) (relative) or a - b (absolute, or against 0)."""
    a = measured.get(leaf["a"])
    b = measured.get(leaf["b"]) if isinstance(leaf["b"], str) else leaf["b"]
    if not isinstance(a, list):
        return []
    pairs = C.pairs(a, b) if isinstance(b, list) else [(float(x), float(b)) for x in C.finite(a)]
    if _relative(leaf):
        return [math.log(x / y) for x, y in pairs if x > 0 and y > 0]
    return [x - y for x, y in pairs]


def _p_trend(question: str, fit: dict, margin: float) -> tuple[float, float]:
    """One-sided p-values (for holds, for does not hold) of the trend question."""
    def gt(c):
        return float(S.t.sf((fit["slope"] - c) / fit["se"], fit["df"]))

    def lt(c):
        return float(S.t.cdf((fit["slope"] - c) / fit["se"], fit["df"]))

    if question == "does not grow":
        return max(gt(-margin), lt(margin)), min(gt(margin), lt(-margin))
    if question == "grows up":
        return gt(0.0), lt(0.0)
    return lt(0.0), gt(0.0)  # grows down: the effect is a negative gap


def trends(rungs: list[dict], params: list[float]) -> list[dict]:
    """Trend claims of one preset from its sections at each rung (``rungs``, results.json
    sections, in rung order) and the rungs' non-embedding parameter counts (None: a preset that
    trains no run), which a claim's own ``parameters`` overrides; a claim with no size at some rung
    has no trend. Verdicts are plain; :func:`judge_trends` adjusts them family-wise."""
    out = []
    first = rungs[0]
    for claim in first["claims"]:
        leaf = _effect_leaf(claim["rule"])
        matches = [next((c for c in section["claims"] if c["id"] == claim["id"]), None) for section in rungs]
        # the size of the claim's own runs or model where it says, else the preset's median run
        sizes = [(match or {}).get("parameters") or n for match, n in zip(matches, params)]
        if leaf is None or not all(sizes):
            continue
        xs, ys, per_rung = [], [], []
        for match, n in zip(matches, sizes):
            pre = _precondition(match) if match is not None else None
            trained = match is not None and pre in (None, C.HOLDS)
            gaps = seed_gaps(leaf, match["measured"]) if trained else []
            xs += [math.log10(n)] * len(gaps)
            ys += gaps
            ci = C.interval(*_sides_of(leaf, match["measured"]), paired=leaf.get("paired", False),
                            absolute=leaf.get("absolute", False)) if match else None
            per_rung.append({"parameters": n, "gaps": gaps, "verdict": match["verdict"] if match else None,
                             "precondition": None if pre is None else trained,
                             "precondition_verdict": pre,
                             "ci": None if not ci or "none" in ci
                             else {k: ci[k] for k in ("gap", "gap_lo", "gap_hi", "est", "lo", "hi")}})
        relative = _relative(leaf)
        margin = leaf.get("rel", 0.0)
        margin = math.log1p(margin) if relative and margin else margin
        question = ("does not grow" if leaf["kind"] == "within"
                    else "grows up" if leaf["kind"] in ("above", "at_least") else "grows down")
        fit = slope(xs, ys)
        trend = {"id": claim["id"], "text": claim["claim"], "leaf": {k: leaf[k] for k in ("kind", "a", "b")},
                 "question": question, "margin_per_decade": margin if question == "does not grow" else 0.0,
                 "units": "log ratio" if relative else "absolute", "rungs": per_rung, "fit": fit}
        if fit is None:
            trend.update(p=None, verdict_plain=C.UNSURE)
        else:
            p_hold, p_fail = _p_trend(question, fit, margin)
            p = min(1.0, 2 * min(p_hold, p_fail))
            trend.update(p=p, leans=C.HOLDS if p_hold <= p_fail else C.FAILS,
                         verdict_plain=(C.HOLDS if p_hold <= p_fail else C.FAILS) if p <= C.ALPHA
                         else C.UNSURE)
        out.append(trend)
    return out


def _precondition(claim: dict) -> str | None:
    """The plain verdict of a claim's precondition (``given``'s ``if``: the baseline trains) at this
    rung, judged alone as the claim's own plain verdict judges it; None for a claim without one,
    which counts everywhere. A rung where it does not hold, or is not decided, says nothing about
    how the effect moves."""
    rule = claim["rule"]
    return C.judge(rule["if"], claim["measured"]) if rule["kind"] == "given" else None


def _sides_of(leaf: dict, measured: dict) -> tuple:
    a = measured.get(leaf["a"])
    b = measured.get(leaf["b"]) if isinstance(leaf["b"], str) else leaf["b"]
    return (a if isinstance(a, list) else [], b if b is not None else [])


def judge_trends(all_trends: list[dict], per_claim: bool = False) -> dict:
    """Holm's step-down over the ladder's trend p-values (the ladder's own family; each rung's
    claims are judged as their own invocation's). Sets each trend's ``verdict``."""
    ps = [t["p"] for t in all_trends if t["p"] is not None]
    adjusted = dict(zip(range(len(ps)), C.holm(ps))) if ps and not per_claim else {}
    i = 0
    for t in all_trends:
        if t["p"] is None:
            t["verdict"], t["p_adjusted"] = C.UNSURE, None
            continue
        q = adjusted.get(i, t["p"])
        i += 1
        t["p_adjusted"] = q
        t["verdict"] = t["leans"] if q <= C.ALPHA else C.UNSURE
    return {"method": "none" if per_claim else "holm", "alpha": C.ALPHA, "size": len(ps)}
