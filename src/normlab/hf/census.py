"""A census of the norms in the installed transformers (``normlab check-model --census``): every
model type it can build, which norm classes it holds, and for each whether ``patch`` would swap it
for normlab's op (in which flavor) or leave it alone (and why).

Each model type's default config is built with its depth and expert count shrunk (so that a
400-layer or 256-expert default builds in a moment) on the meta device: no memory is allocated,
so widths, heads and vocabularies keep their published sizes, and each norm is probed at the width
it has in the real model. A norm is then judged as ``patch`` judges it (``norm_spec``: the probe on
a copy of the module with random weights); the check against a module's own trained weights,
which ``patch`` adds, needs real weights and is not part of the census.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from normlab.hf.patching import mode_text, norm_spec

# config fields that set depth or the number of experts, shrunk to these values when larger
DEPTH = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
         "num_decoder_layers",
         "num_encoder_layers", "depth", "text_layers", "vision_layers")
EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
SMALL = {**{k: 2 for k in DEPTH}, **{k: 4 for k in EXPERTS}, "num_experts_per_tok": 2, "moe_k": 2, "top_k": 2}
TIMEOUT_S = 120  # one model type's build and probes; a type that takes longer is reported, not waited for


def model_types() -> dict[str, str]:
    """model type -> the class to build: the base model where AutoModel has one, else the first
    task model another Auto mapping names, else the config class's name with Model for Config
    (a sub-model such as a vision tower), or '' when there is none."""
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    mappings = [modeling_auto.MODEL_MAPPING_NAMES] + [v for k, v in sorted(vars(modeling_auto).items())
                                                      if k.startswith("MODEL_")
                                                      and k.endswith("_MAPPING_NAMES")
                                                      and k != "MODEL_MAPPING_NAMES" and isinstance(v, dict)]
    found = {}
    for model_type, config_name in configuration_auto.CONFIG_MAPPING_NAMES.items():
        for mapping in mappings:
            name = mapping.get(model_type)
            if name:
                found[model_type] = name if isinstance(name, str) else name[0]
                break
        else:
            guess = config_name.removesuffix("Config") + "Model"
            found[model_type] = guess if guess in transformers.__all__ or hasattr(transformers, guess) else ""
    return found


def _configs(config):
    """The config and every sub-config inside it (a vision tower's, a text model's, ...)."""
    from transformers import PretrainedConfig

    seen, todo = [], [config]
    while todo:
        c = todo.pop()
        if any(c is s for s in seen):
            continue
        seen.append(c)
        todo += [v for v in vars(c).values() if isinstance(v, PretrainedConfig)]
    return seen


def shrink(config) -> list[str]:
    """Set depth and expert counts to SMALL where larger (lists as long as the depth, such as
    per-layer types, cut to match); returns what changed."""
    changed = []
    for c in _configs(config):
        fields = vars(c)
        for key, small in SMALL.items():
            old = fields.get(key)
            if isinstance(old, int) and not isinstance(old, bool) and old > small:
                setattr(c, key, small)
                changed.append(f"{key} {old}->{small}")
                if key in DEPTH:
                    for name, value in list(vars(c).items()):
                        if isinstance(value, list) and len(value) == old:
                            setattr(c, name, value[:small])
    return changed


def _build(model_type: str, class_name: str, small: bool) -> nn.Module:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    if small:
        shrink(config)
    cls = getattr(transformers, class_name)
    with torch.device("meta"):
        return cls(config)


def _alarm(signum, frame):
    raise TimeoutError(f"took over {TIMEOUT_S} s")


def survey(model_type: str, class_name: str) -> dict:
    """One model type's row: how it was built (or why not) and, per norm class, its count and the
    flavor ``patch`` finds or the reason it leaves the class alone."""
    row = {"model_type": model_type, "class": class_name, "built": "", "norms": []}
    if not class_name:
        row["built"] = "no model class in any Auto mapping"
        return row
    t0 = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT_S)
    try:
        try:
            model, row["built"] = _build(model_type, class_name, small=True), "shrunk"
        except TimeoutError:
            raise
        except Exception:  # a shrunk config its own checks refuse: the published depth, still on meta
            model, row["built"] = _build(model_type, class_name, small=False), "published depth"
        found: dict[tuple[str, str], dict] = {}
        probed: dict = {}
        for module in model.modules():
            spec, reason = norm_spec(module, probed)
            if spec is None and not reason:
                continue
            cls = type(module)
            verdict = mode_text(spec) if spec else reason
            entry = found.setdefault((f"{cls.__module__}.{cls.__qualname__}", verdict),
                                     {"norm": cls.__name__, "module": cls.__module__, "count": 0,
                                      "patched": spec is not None,
                                      "verdict": verdict})
            entry["count"] += 1
        row["norms"] = sorted(found.values(), key=lambda e: (e["norm"], e["verdict"]))
    except Exception as err:
        row["built"] = f"error: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    finally:
        signal.alarm(0)
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _survey(item):
    import contextlib
    import io
    import warnings

    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()  # config warnings about default token ids, deprecations
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return survey(*item)


def census(types: list[str] | None = None, jobs: int = 2, progress=None) -> list[dict]:
    """Rows for ``types`` (default: every model type the installed transformers knows), surveyed in
    ``jobs`` processes (each model type imports its own modeling code; a crash costs one row).
    Ctrl-C after the first row returns the rows so far: fewer than the types asked for."""
    every = model_types()
    unknown = [t for t in types or [] if t not in every]
    if unknown:
        raise ValueError(f"types: unknown model type(s) {', '.join(unknown)} (transformers knows "
                         f"{len(every)})")
    items = [(t, every[t]) for t in (types or sorted(every))]
    rows = []
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch threads forked
    with ctx.Pool(jobs, maxtasksperchild=25, initializer=_leave_ctrl_c_to_the_parent) as pool:
        try:
            for row in pool.imap_unordered(_survey, items):
                rows.append(row)
                if progress:
                    progress(row)
        # the types surveyed so far are kept: the caller sees fewer rows than it asked for
        except KeyboardInterrupt:
            if not rows:
                raise
    return sorted(rows, key=lambda r: r["model_type"])


def _leave_ctrl_c_to_the_parent() -> None:
    """A worker ignores Ctrl-C (no traceback per process); the parent stops the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def summary(rows: list[dict]) -> dict:
    """The counts the README cites."""
    built = [r for r in rows if r["built"] in ("shrunk", "published depth")]
    classes: dict[str, set[bool]] = {}
    for r in built:
        for n in r["norms"]:
            classes.setdefault(f"{n['module']}.{n['norm']}", set()).add(n["patched"])
    reasons = Counter(_reason_kind(n["verdict"]) for r in built for n in r["norms"] if not n["patched"])
    return {"model_types": len(rows), "built": len(built),
            "with_norms": sum(1 for r in built if r["norms"]),
            "with_a_patched_norm": sum(1 for r in built if any(n["patched"] for n in r["norms"])),
            "fully_patched": sum(1 for r in built if r["norms"] and all(n["patched"] for n in r["norms"])),
            "norm_classes": len(classes), "classes_patched": sum(1 for v in classes.values() if v == {True}),
            "classes_sometimes_patched": sum(1 for v in classes.values() if v == {True, False}),
            "modules": sum(n["count"] for r in built for n in r["norms"]),
            "modules_patched": sum(n["count"] for r in built for n in r["norms"] if n["patched"]),
            "left_alone_by_reason": dict(reasons.most_common())}


def _reason_kind(verdict: str) -> str:
    for kind in ("normalizes over the batch", "no normlab flavor agrees",
                 "agrees with normlab in fp32 but not in bf16",
                 "parameters other than weight and bias", "no epsilon attribute", "its forward fails on one",
                 "its forward returns", "spans more than the last dimension", "is not one vector",
                 "not a tensor",
                 "weight parametrization"):
        if kind in verdict:
            return kind
    return verdict[:60]


def write(rows: list[dict], out: Path, versions: dict, asked: int | None = None) -> dict[str, Path]:
    """census.json (every row) and census.md (the counts and one line per model type) in ``out``.
    ``asked``: the number of model types asked for, when a Ctrl-C left fewer rows than that."""
    from normlab.runs import write_json

    out.mkdir(parents=True, exist_ok=True)
    s = summary(rows)
    partial = asked is not None and len(rows) < asked
    write_json(out / "census.json", {"versions": versions, "summary": s, "rows": rows,
                                     **({"interrupted": {"surveyed": len(rows), "asked": asked}} if partial
                                        else {})})
    lines = [f"# Norms in transformers {versions.get('transformers', '?')}: what normlab.hf.patch does with "
             "each", ""]
    if partial:
        lines += [f"Interrupted (Ctrl-C): {len(rows)} of the {asked} model types asked for were surveyed; "
                  "the counts are theirs.", ""]
    lines += [counts_text(s), "", "Left alone, by reason (a norm class in a model type counts once):", ""]
    lines += [f"- {kind}: {n}" for kind, n in s["left_alone_by_reason"].items()]
    lines += ["", "| model type | class built | norms patched (flavor found) | norms left alone (why) |",
              "|---|---|---|---|"]
    for r in rows:
        patched = "; ".join(f"{n['norm']} x{n['count']}: {n['verdict']}" for n in r["norms"] if n["patched"])
        alone = "; ".join(f"{n['norm']} x{n['count']}: {n['verdict']}" for n in r["norms"]
                          if not n["patched"])
        built = r["class"] if r["built"] in ("shrunk",
                                             "published depth") else f"{r['class'] or '-'} ({r['built']})"
        lines.append(
            f"| {r['model_type']} | {built} | {patched or '-'} | {alone or '-'} |".replace("\n", " ")
        )
    (out / "census.md").write_text("\n".join(lines) + "\n")
    return {"json": out / "census.json", "md": out / "census.md"}


def counts_text(s: dict) -> str:
    return (f"Of {s['model_types']} model types, {s['built']} build (on the meta device, depth and experts "
            f"shrunk) and {s['with_norms']} of those hold a norm: {s['norm_classes']} norm classes, "
            f"{s['modules']} norm modules. normlab.hf.patch finds a flavor for {s['classes_patched']} "
            f"classes in every model type that holds them and for {s['classes_sometimes_patched']} more in "
            f"some ({s['modules_patched']} modules); {s['fully_patched']} model types have every norm "
            f"patched and {s['with_a_patched_norm']} at least one.")
