"""``normlab compare``: presets that test published claims about norms on this machine.

Each preset trains or measures what its claims need and returns a section of results.json: the
settings, a table, the series its plots draw, and the claims with verdicts computed from the
numbers by their rules (normlab.claims). Presets:

    norms      RMSNorm matches LayerNorm and is faster; pRMSNorm matches; no norm trains worse
    warmup     learning-rate sweeps: Post-LN needs warmup, Pre-LN does not; qk-norm bounds the logits
    gradients  at init Post-LN's gradient grows toward the output, Pre-LN's is flat; depth scaling
               (Xiong et al.'s model and this decoder side by side)
    depth      DeepNorm keeps a deep Post-LN model trainable where Pre-LN trains
    batchnorm  BatchNorm's output depends on batch-mates and padding; small padded batches hurt it
    precision  fp32 statistics are needed in fp16/bf16
    speed      kernel GB/s per backend, a normalized GRU's step, and training-step time with
               normlab's and torch's norms
    eps        RMSNorm's eps inside the square root bounds the gradient on all-zero (padding) rows;
               outside it the gradient there is 1/eps (exact, no training)
    invariance LayerNorm is invariant to re-centering and re-scaling, RMSNorm to re-scaling only
               (exact, on the op and a model), and shift noise in training costs only RMSNorm
    final-norm Pre-LN needs its final norm: loss, the LM head's input RMS, a high learning rate
    shallow    Post-LN beats Pre-LN when shallow; Pre-LN wins when deep
    sandwich   norms on each branch's output bound the residual stream at Pre-LN's quality
    dyt        DyT (no norm: tanh(alpha x)) matches RMSNorm, depends on alpha0, and helps on a small
               training set repeated but hurts on plentiful data

Every claim carries the conditions of its source's experiment that this run matches and those it
does not; verdicts come from t intervals over seeds of log ratios, judged family-wise over the
invocation's tests by Holm's step-down (normlab.claims; --per-claim: each alone). The arms a preset
compares train at their own learning rates and the presets at their seed counts, both from pilot
runs on seeds no test run uses (--tune; normlab.experiments.design).

``demo`` runs norms, gradients, batchnorm (without its batch-size trend) and precision at quick
size; ``all`` runs every preset.
Sizes: ``full`` (the default: minutes to hours on a CPU, meant for a GPU or a patient machine),
``quick`` (2 CPU cores: every preset together in about an hour with --jobs 2, 57 min on a Zen 3 in
docs/results/compare-all-quick-epyc-avx2), ``tiny`` (seconds: the tests) and ``gpu`` (the full
size's runs widened to d_model 768, tokens per parameter held: meant for one GPU each;
normlab.experiments.ladder states the rule, ``--plan`` prints the cost).

Everything lives in the output directory: ``runs/<label>-<hash>/`` holds one training run (the
hash covers its whole config, so a run is reused by any preset, or any later command, that asks
for the same config), ``jobs/<preset>/`` the measurements that are not training runs, and
results.json the sections finished so far. Rerunning the same command skips what is finished and
resumes an interrupted training run from its checkpoint.

``--ladder`` runs the presets at three widths (normlab.experiments.ladder: d_model x0.5, x1, x2,
tokens per parameter held fixed, learning rates by the muP rule) into results-rung<i>.json, and
judges trend claims on how each effect moves with parameters (ladder.json, ladder.md).

The training runs can also run elsewhere: ``--plan`` prints one ``normlab train`` command line
per unfinished run (for a Slurm job array or GNU parallel) and the ``--collect`` line that then
measures and reports without training; ``--jobs N`` trains N runs at a time on this machine. A
preset therefore asks for all its training runs before its first measurement.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path

from normlab import claims as C
from normlab.experiments import design as DS
from normlab.experiments import ladder as LD
from normlab.experiments.batchnorm import BATCH_SIZES, preset_batchnorm
from normlab.experiments.common import lm_sizes
from normlab.experiments.curse import preset_curse
from normlab.experiments.depth import preset_depth
from normlab.experiments.dyt import preset_dyt
from normlab.experiments.eps import preset_eps
from normlab.experiments.final_norm import preset_final_norm
from normlab.experiments.gradients import preset_gradients
from normlab.experiments.invariance import preset_invariance
from normlab.experiments.lab import SIZES, Interrupted, Lab, Pending, RunsPending, Settings
from normlab.experiments.norms import preset_norms
from normlab.experiments.precision import preset_precision
from normlab.experiments.sandwich import preset_sandwich
from normlab.experiments.scale import preset_scale
from normlab.experiments.shallow import preset_shallow
from normlab.experiments.speed import preset_speed
from normlab.experiments.stability import preset_stability
from normlab.experiments.warmup import SWEEP, lr_sensitivity, parse_lrs, preset_warmup
from normlab.runs import holder, locked, read_json, write_json

# ===================================================================================== presets

PRESETS: dict[str, Callable[[Lab], dict]] = {
    "norms": preset_norms,
    "warmup": preset_warmup,
    "gradients": preset_gradients,
    "depth": preset_depth,
    "batchnorm": preset_batchnorm,
    "precision": preset_precision,
    "speed": preset_speed,
    "eps": preset_eps,
    "stability": preset_stability,
    "invariance": preset_invariance,
    "final-norm": preset_final_norm,
    "shallow": preset_shallow,
    "sandwich": preset_sandwich,
    "dyt": preset_dyt,
    "scale": preset_scale,
    "curse": preset_curse,
}
GROUPS = {"all": tuple(PRESETS), "demo": ("norms", "gradients", "batchnorm", "precision")}
# The fields a preset compares: the user cannot override them for it.
VARIES = {"norms": {"norm", "seed"}, "scale": {"norm", "seed"},
          "warmup": {"placement", "lr", "min_lr", "warmup", "seed", "qk_norm", "embed_norm", "beta2",
                     "grad_clip", "norm", "mlp", "positions"},
          "gradients": {"placement", "n_layers", "norm", "mlp", "positions", "tie_embeddings", "embed_scale",
                        "init"},
          "depth": {"placement", "lr", "min_lr", "warmup", "seed", "norm", "mlp", "positions",
                    "deepnorm_init"},
          "batchnorm": {"norm", "seed", "batch_size", "batching", "steps"}, "precision": set(),
          "speed": {"norm", "norm_impl"}, "eps": set(), "stability": set(),
          "invariance": {"norm", "seed", "norm_shift_noise", "placement", "norm_eps", "backend"},
          "final-norm": {"final_norm", "lr", "min_lr", "seed", "placement", "norm"},
          "shallow": {"placement", "n_layers", "lr", "min_lr", "warmup", "seed"},
          "sandwich": {"placement", "norm", "seed"},
          "dyt": {"norm", "dyt_alpha0", "seed", "steps", "warmup", "eval_every", "placement"},
          "curse": {"placement", "ln_scaling", "lr", "min_lr", "warmup", "seed"}}


def expand(names: list[str]) -> list[str]:
    out = []
    for name in names:
        if name in GROUPS:
            out.extend(GROUPS[name])
        elif name in PRESETS:
            out.append(name)
        else:
            raise ValueError(
                f"unknown preset {name!r}; choose from {', '.join(list(PRESETS) + list(GROUPS))}"
            )
    return list(dict.fromkeys(out))


def check_overrides(presets: list[str], overrides: dict) -> None:
    for name in presets:
        clash = sorted(set(overrides) & VARIES[name])
        if clash:
            raise ValueError(f"the {name} preset compares {', '.join(clash)}; it cannot be overridden for it "
                             f"(run another preset, or train that setting alone with `normlab train`)")


def _prepare(names: list[str], settings: Settings) -> tuple[list[str], Settings]:
    presets = expand(names)
    if "demo" in names:
        settings = dataclasses.replace(settings, size="tiny" if settings.size == "tiny" else "quick",
                                       brief=True)
    check_overrides(presets, settings.overrides)
    return presets, settings


def plan_presets(names: list[str], settings: Settings, console=None) -> list[Pending]:
    """The training runs the presets need that have not finished, each with the `normlab train`
    command that trains it: nothing is trained or measured (the measurements wait for the runs).
    A run another process is training now is left out, with a note (on stderr without a console)."""
    presets, settings = _prepare(names, settings)
    lab = Lab(dataclasses.replace(settings, mode="plan"), console)
    for name in presets:
        lab.begin(name)
        try:
            PRESETS[name](lab)
        except RunsPending:
            pass
    held = {run.folder: holder(run.folder) for run in lab.pending.values()}
    busy = [run for run in lab.pending.values() if held[run.folder]]
    if busy:
        from rich.console import Console

        notes = console or Console(stderr=True)
        notes.print(f"[yellow]{len(busy)} run(s) in progress in other processes[/yellow], left out of this "
                    "plan:")
        for run in busy:
            notes.print(f"  {run.label} ({run.folder}): process {held[run.folder]}")
    return [run for run in lab.pending.values() if not held[run.folder]]


def tune_presets(names: list[str], settings: Settings, console=None, command: str = "") -> dict:
    """--tune: train every tuned arm of the presets at the pilot seeds and learning rates (nothing
    else), decide each arm's learning rate and each preset's seeds (normlab.experiments.design),
    and write them to <out>/design.json. Returns the design."""
    from normlab.env import environment

    presets, settings = _prepare(names, settings)
    lab = Lab(dataclasses.replace(settings, mode="pilot"), console)
    for i, name in enumerate(presets, 1):
        lab.begin(name)
        lab.say(f"[bold cyan]({i}/{len(presets)}) {name}: pilot[/bold cyan]")
        try:
            PRESETS[name](lab)
        except RunsPending:
            pass
    if settings.tune_arms is not None and not lab.pilot["arms"]:
        raise ValueError(f"--arms {','.join(settings.tune_arms)} matches none of the tuned arms of "
                         f"{', '.join(presets)}: {', '.join(sorted(lab.arms_seen))}")
    key = lab.design_key  # the size, and the tokenizer where it is not characters
    design = DS.decide(lab.pilot, key, command, environment())
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "design.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    merged = {**old, **design}
    if key in old:  # tuning some presets again keeps the others' arms and seeds
        arms = old[key].get("arms", {})
        # an arm another preset owns (a baseline a new preset shares, e.g. rmsnorm) keeps its rate:
        # tuning one preset must not move the runs another preset's verdicts stand on
        kept = {a: v for a, v in arms.items() if a in design[key]["arms"] and v.get("preset") not in presets}
        if kept and console is not None:
            console.print(f"kept the design's rates of {', '.join(kept)} (tuned with "
                          f"{', '.join(sorted({v['preset'] for v in kept.values()}))})")
        merged[key] = {**design[key], "arms": {**arms, **design[key]["arms"], **kept},
                       "seeds": {**old[key].get("seeds", {}), **design[key]["seeds"]}}
    write_json(path, merged)
    return merged


def run_presets(names: list[str], settings: Settings, console=None, command: str = "",
                results_file: str = "results.json") -> dict:
    """Run the presets (skipping finished work) and write results.json; returns the results. With
    ``settings.mode == "collect"`` nothing is trained: the presets whose runs have all finished are
    measured and written, and RunsMissing then lists the runs the others still need."""
    presets, settings = _prepare(names, settings)
    lab = Lab(settings, console)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / results_file
    results = read_json(path) if path.exists() else {"presets": {}}
    from normlab.env import environment

    family: list[dict] = []  # this invocation's sections: their claims are judged together
    for i, name in enumerate(presets, 1):
        lab.begin(name)
        lab.say(f"[bold cyan]({i}/{len(presets)}) {name}[/bold cyan]")
        try:
            section = PRESETS[name](lab)
        except RunsPending:
            continue
        if lab.waiting:  # computed from runs that have not finished: not a result
            continue
        # to compute it from nothing: cached work counts at its original cost
        section["seconds"] = round(lab.cost, 1)
        if lab.stale:
            section["notes"].append("Cached results that no longer matched their data or code were computed "
                                    f"again: {', '.join(lab.stale)}.")
        section["size"] = lab.size
        # report.py flags runs trained under different conditions (their times then do not compare)
        section["clocks"] = {k: [json.loads(c) for c in sorted(v)] for k, v in lab.clocks.items()}
        section["parameters"] = statistics.median(lab.parameters) if lab.parameters else None
        # the runs as sized: settings show the preset's own fields
        if settings.rung is not None or lab.size == "gpu":
            section["trained_at"] = [dict(zip(("d_model", "n_layers", "steps", "lr"), t))
                                     for t in sorted(lab.trained_at, key=lambda t: tuple(str(x) for x in t))]
        if settings.rung is not None:
            section["rung"] = {"index": settings.rung, "width": LD.WIDTHS[settings.rung],
                               "lr_rule": LD.LR_RULE}
        if lab.tuned:
            section["settings"]["arm_lrs"] = lab.tuned
        results["presets"][name] = section
        results["presets"] = {k: results["presets"][k] for k in PRESETS if k in results["presets"]}
        results["meta"] = {**environment(), "command": command, "size": lab.size, "seeds": settings.seeds,
                           "seed_start": settings.seed_start,
                           "data": settings.data or "shakespeare", "data_sha256": lab.data_hash,
                           "overrides": settings.overrides,
                           "tokenizer": lab.dataset.tokenizer.kind,
                           "vocab_size": lab.dataset.tokenizer.vocab_size}
        # results.json may merge sections of several commands: each says its own
        section["meta"] = results["meta"]
        family.append(section)
        # again with each section: every write is consistent
        C.familywise(family, per_claim=settings.per_claim)
        # read-merge-write: another compare's sections stay
        with locked(out, "normlab compare: results", wait=True):
            if path.exists():
                merged = read_json(path)
                merged["presets"].update(results["presets"])
                merged["presets"] = {k: merged["presets"][k] for k in PRESETS if k in merged["presets"]}
                results = {**merged, "meta": results["meta"]}
            write_json(path, results)
    if lab.pending:
        raise RunsMissing(list(lab.pending.values()), results)
    return results


def rung_file(rung: int, condition: str | None = None) -> str:
    """A rung's results file; a tokenizer condition other than the first of the ladder's gets its own."""
    return f"results-rung{rung}{'-' + condition if condition else ''}.json"


def ladder_results(names: list[str], out: str | Path, per_claim: bool = False,
                   conditions: tuple = (None,)) -> dict:
    """The ladder's trend claims from the rungs' results files in ``out`` (normlab.experiments.
    ladder), for each preset that every rung holds, under each tokenizer condition (``None``: the
    files without a condition suffix), judged as one family; written to <out>/ladder.json."""
    out = Path(out)
    presets: dict = {}
    meta: dict = {}
    vocabularies: dict = {}  # each tokenizer condition's vocabulary size
    rates: dict = {}  # each tokenizer condition's ways its arms' learning rates were chosen
    for condition in conditions:
        files = [out / rung_file(r, condition) for r in range(len(LD.WIDTHS))]
        rungs = [read_json(f) if f.exists() else {"presets": {}} for f in files]
        meta = meta or rungs[LD.MIDDLE].get("meta", {})
        tokenizer = rungs[LD.MIDDLE].get("meta", {}).get("tokenizer")
        vocabularies[tokenizer] = rungs[LD.MIDDLE].get("meta", {}).get("vocab_size")
        for name in expand(names):
            sections = [r["presets"].get(name) for r in rungs]
            if any(s is None for s in sections):
                continue
            params = [s.get("parameters") for s in sections]
            trends = LD.trends(sections, params)
            for t in trends:
                t["condition"] = tokenizer
            p = presets.setdefault(name, {"parameters": params, "trends": [],
                                          "sizes": [s.get("size") for s in sections],
                                          "conditions": []})
            p["conditions"].append(tokenizer)
            # the other rungs follow lr_rule
            arms = sections[LD.MIDDLE].get("settings", {}).get("arm_lrs", {})
            rates.setdefault(tokenizer, set()).update(a["how"] for a in arms.values())
            p["trends"] += trends
    for p in presets.values():  # a claim's conditions side by side
        first: dict = {}
        for i, t in enumerate(p["trends"]):
            first.setdefault(t["id"], i)
        p["trends"].sort(key=lambda t: first[t["id"]])  # stable: each claim's conditions in their order
    family = LD.judge_trends([t for p in presets.values() for t in p["trends"]], per_claim)
    ladder = {"widths": list(LD.WIDTHS), "lr_rule": LD.LR_RULE,
              "tokens_per_parameter": "held at the middle rung's ratio",
              "family": family, "presets": presets, "meta": meta, "tokenizers": vocabularies,
              "rates": {k: sorted(v) for k, v in rates.items()}}
    write_json(out / "ladder.json", ladder)
    return ladder


class RunsMissing(Exception):
    """``collect`` found training runs that have not finished (``.pending``); ``.results`` holds
    the sections it could write."""

    def __init__(self, pending: list[Pending], results: dict) -> None:
        super().__init__(f"{len(pending)} training run(s) have not finished")
        self.pending, self.results = pending, results


recheck = C.recheck

__all__ = ["BATCH_SIZES", "GROUPS", "PRESETS", "SIZES", "SWEEP", "Interrupted", "Lab", "Pending",
           "RunsMissing", "Settings",
           "check_overrides", "expand", "lm_sizes", "lr_sensitivity", "parse_lrs", "plan_presets", "recheck",
           "run_presets",
           "tune_presets"]
