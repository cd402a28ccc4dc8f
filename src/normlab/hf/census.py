"""A census of the norms in the installed transformers (``normlab check-model --census``): every
model type it can build, which norm classes it holds, and for each whether ``patch`` would swap it
for normlab's op (in which flavor) or leave it alone (and why).

Each model type's default config is built with its depth and expert count shrunk (so that a
400-layer or 256-expert default builds in a moment) on the meta device: no memory is allocated,
so widths, heads and vocabularies keep their published sizes, and each norm is probed at the width
it has in the real model. A norm is then judged as ``patch`` judges it (``norm_spec``: the probe on
a copy of the module with random weights); the check against a module's own trained weights,
which ``patch`` adds, needs real weights and is not part of the census.

With ``run`` (``--census --run``) each model type is also built small on the CPU with random
weights (widths cut too, WIDTHS) and run whole: patched (with ``fuse_residual``) against
unpatched, both against a float64 copy, in fp32 and bf16 (``checking.check_model``'s bound). The
probe judges one module on one input; the run also finds what only a whole model shows: a patched
forward called in a way the probe did not try, or a norm whose attributes differ from the probed
copy's.
"""

from __future__ import annotations

import copy
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
# --run: widths cut to these where larger. When a config refuses the cut (heads that must divide a
# width, rotary sizes tied to head sizes), the heads are kept, then every width but the vocabulary.
WIDTHS = {"hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "embed_dim": 64,
          "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "d_ff": 128, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 64, "vocab_size": 320, "vocab_size_per_layer_input": 320,
          "hidden_size_per_layer_input": 16, "max_position_embeddings": 256, "n_positions": 256}
HEADS = {"num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
         "v_head_dim": 16, "d_kv": 16}
CUTS = {"widths and heads": {**WIDTHS, **HEADS}, "widths": WIDTHS,
        "vocabulary": {k: WIDTHS[k] for k in ("vocab_size", "max_position_embeddings", "n_positions")}}
MAX_PARAMS = 60_000_000  # a config that ignores the cuts stays too large to run in a census
RUN_TIMEOUT_S = 300


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


def _why(err: Exception, n: int = 100) -> str:
    """An exception as one short line."""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:n] if str(err) else ''}"


def cut_widths(config, sizes: dict) -> None:
    """Set the fields of ``sizes`` to their values where larger, in the config and its sub-configs;
    a pad token id the smaller vocabulary no longer holds becomes 0."""
    for c in _configs(config):
        for key, small in sizes.items():
            old = vars(c).get(key)
            if isinstance(old, int) and not isinstance(old, bool) and old > small:
                setattr(c, key, small)
        pad = vars(c).get("pad_token_id")
        if isinstance(pad, int) and pad >= vars(c).get("vocab_size", pad + 1):
            c.pad_token_id = 0


def build_small(model_type: str, class_name: str) -> tuple[nn.Module, str]:
    """The model type on the CPU with random weights (norm weights off 1 and 0), depth, experts and
    widths cut (CUTS, in order, until one builds and runs on token ids), experts and attention in
    their eager implementations (the grouped matmul has no float64). Returns it and the cut."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from normlab.hf.checking import output_and_grads, randomize_norms

    cls = getattr(transformers, class_name)
    errors = []
    for cut, sizes in CUTS.items():
        config = CONFIG_MAPPING[model_type]()
        shrink(config)
        cut_widths(config, sizes)
        for c in _configs(config):
            c._attn_implementation, c._experts_implementation = "eager", "eager"
        try:
            with torch.device("meta"):
                n = sum(p.numel() for p in cls(config).parameters())
            if n > MAX_PARAMS:
                errors.append(f"{cut} cut: {n / 1e6:.0f}M parameters")
                continue
            torch.manual_seed(0)
            model = cls(config).eval()
            randomize_norms(model, torch.Generator().manual_seed(1))
            output_and_grads(model, torch.randint(0, 8, (1, 6)), torch.float32)
            return model, cut
        except Exception as err:
            errors.append(f"{cut} cut: {_why(err)}")
    raise RuntimeError("; ".join(errors))


def run_whole(model_type: str, class_name: str) -> dict:
    """``--run``'s part of a row: the cut the small model was built with and, per dtype, whether the
    patched model stays within check_model's bound (``ok``, the worst ``tensor`` and its ``excess``,
    or the ``error`` it raised), or ``{"none": why}`` where the unpatched model itself does not run
    (no small build, or it fails in that dtype or in float64, the truth both are compared with)."""
    from normlab.hf.checking import check_model, float64_truth, output_and_grads

    try:
        model, cut = build_small(model_type, class_name)
    except Exception as err:
        return {"none": f"no small build runs on token ids ({err})"}
    result = {"cut": cut, "params": sum(p.numel() for p in model.parameters())}
    ids = torch.randint(0, 8, (1, 6))

    def fails(dtype: torch.dtype) -> str:
        try:
            if dtype == torch.float64:
                float64_truth(model, ids)  # as check_model makes it
            else:
                output_and_grads(copy.deepcopy(model).to(dtype), ids, dtype)
            return ""
        except Exception as err:
            return _why(err)

    truth = fails(torch.float64)
    for dtype, tdtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        why = f"its float64 copy fails ({truth})" if truth else fails(tdtype)
        if why:
            result[dtype] = {"none": why if truth else f"the unpatched model fails in {dtype} ({why})"}
            continue
        try:
            r = check_model(copy.deepcopy(model), dtype=dtype, seq=12, fuse_residual=True, generate=False,
                            repeat=1)
        except Exception as err:  # the patched model raised: a finding
            result[dtype] = {"ok": False, "error": _why(err, 160)}
            continue
        worst = r["tensors"][0]
        result[dtype] = {"ok": r["ok"], "patched": r["patched"], "fused": r["fused"],
                         "tensor": worst["tensor"], "excess": worst["excess"]}
    return result


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


class _RunTimeout(BaseException):
    """--run's time limit: not an Exception, so that the handlers that record what a model raised
    let it through."""


def _run_alarm(signum, frame):
    raise _RunTimeout


def survey(model_type: str, class_name: str, run: bool = False) -> dict:
    """One model type's row: how it was built (or why not) and, per norm class, its count and the
    flavor ``patch`` finds or the reason it leaves the class alone; with ``run`` (and a norm
    patched), also the whole small model's check (``run_whole``) as the row's "run"."""
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
        row["built"] = f"error: {_why(err, 160)}"
    finally:
        signal.alarm(0)
    if run and any(n["patched"] for n in row["norms"]):
        signal.signal(signal.SIGALRM, _run_alarm)
        signal.alarm(RUN_TIMEOUT_S)
        try:
            row["run"] = run_whole(model_type, class_name)
        except _RunTimeout:
            row["run"] = {"none": f"took over {RUN_TIMEOUT_S} s"}
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


def census(types: list[str] | None = None, jobs: int = 2, progress=None, run: bool = False) -> list[dict]:
    """Rows for ``types`` (default: every model type the installed transformers knows), surveyed in
    ``jobs`` processes (each model type imports its own modeling code; a crash costs one row), with
    ``run`` each also run whole (``run_whole``). Ctrl-C after the first row returns the rows so far:
    fewer than the types asked for."""
    every = model_types()
    unknown = [t for t in types or [] if t not in every]
    if unknown:
        raise ValueError(f"types: unknown model type(s) {', '.join(unknown)} (transformers knows "
                         f"{len(every)})")
    items = [(t, every[t], run) for t in (types or sorted(every))]
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
            "left_alone_by_reason": dict(reasons.most_common()),
            **({"run": run_summary(rows)} if any("run" in r for r in rows) else {})}


def run_summary(rows: list[dict]) -> dict:
    """``--run``'s counts: model types run (in fp32, bf16 or both), those within the bound in every
    dtype they ran in, those not (the findings), and those not run, by reason."""
    ran = [r for r in rows if any("ok" in r.get("run", {}).get(d, {}) for d in ("fp32", "bf16"))]
    why = Counter(_not_run_kind(r["run"]) for r in rows if "run" in r and r not in ran)
    failed = [r["model_type"] for r in ran if any(r["run"][d].get("ok") is False for d in ("fp32", "bf16"))]
    return {"asked": sum("run" in r for r in rows), "run": len(ran), "ok": len(ran) - len(failed),
            "failed": failed, "not_run_by_reason": dict(why.most_common())}


def _not_run_kind(run: dict) -> str:
    if "none" in run:
        return "no small build runs on token ids"
    whys = [run[d].get("none", "") for d in ("fp32", "bf16")]
    if any(w.startswith("its float64 copy fails") for w in whys):
        return "its float64 copy fails"
    return "the unpatched model fails in fp32 and in bf16"


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
    if "run" in s:
        lines += ["", run_text(rows, s["run"])]
    (out / "census.md").write_text("\n".join(lines) + "\n")
    return {"json": out / "census.json", "md": out / "census.md"}


def run_line(r: dict | None) -> str:
    """One line of ``--run``'s counts (``summary(rows)["run"]``; None when no model type was run)."""
    r = r or {"asked": 0, "run": 0, "ok": 0, "failed": []}
    failed = f"; over the bound or raising: {', '.join(r['failed'])}" if r["failed"] else ""
    return (f"Run whole: {r['run']} of the {r['asked']} model types with a patched norm, {r['ok']} within "
            f"check_model's bound in fp32 and bf16 (or the one the unpatched model runs in){failed}.")


def run_text(rows: list[dict], r: dict) -> str:
    """census.md's section on ``--run``: the counts and one line per model type run."""
    lines = ["## Whole models, patched against unpatched (--run)", "",
             run_line(r) + " Not run, by reason:", ""]
    lines += [f"- {kind}: {n}" for kind, n in r["not_run_by_reason"].items()]
    lines += ["", "| model type | cut | fp32 | bf16 |", "|---|---|---|---|"]

    def cell(d: dict) -> str:
        if "none" in d:
            return f"not run: {d['none']}"
        if "error" in d:
            return f"**raises** {d['error']}"
        verdict = "ok" if d["ok"] else "**over the bound**"
        return (f"{verdict} ({d['patched']} patched, {d['fused']} fused; closest to it: {d['tensor']} "
                f"{d['excess']:+.2g})")

    for row in rows:
        run = row.get("run")
        if run is None:
            continue
        if "none" in run:
            lines.append(f"| {row['model_type']} | - | not run: {run['none']} | |".replace("\n", " "))
        else:
            lines.append(f"| {row['model_type']} | {run['cut']} | {cell(run['fp32'])} | {cell(run['bf16'])} |"
                         .replace("\n", " "))
    return "\n".join(lines)


def counts_text(s: dict) -> str:
    return (f"Of {s['model_types']} model types, {s['built']} build (on the meta device, depth and experts "
            f"shrunk) and {s['with_norms']} of those hold a norm: {s['norm_classes']} norm classes, "
            f"{s['modules']} norm modules. normlab.hf.patch finds a flavor for {s['classes_patched']} "
            f"classes in every model type that holds them and for {s['classes_sometimes_patched']} more in "
            f"some ({s['modules_patched']} modules); {s['fully_patched']} model types have every norm "
            f"patched and {s['with_a_patched_norm']} at least one.")
