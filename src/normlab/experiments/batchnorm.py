"""Preset ``batchnorm``: why text models left BatchNorm (batch-mates, padding, small batches)."""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from normlab import claims as C
from normlab import data as D
from normlab.experiments.common import (LM_SEEDS, SHEN20, WORSE, claim_values, lm_sizes, parameters_of,
                                        round_sig, stats, train_norms, trains, unigram_loss)
from normlab.experiments.lab import Lab
from normlab.nn import SequenceBatchNorm
from normlab.train import load_run


@torch.no_grad()
def batch_effects(run_folder: Path, val_tokens, batch_size: int, seq_len: int, n_batches: int) -> dict:
    """For a trained model: how much one sequence's logits change (relative to their RMS) when its
    batch-mates change and when the batch-mates are half padding, in training mode (batch
    statistics); and the validation loss in eval mode and in training mode."""
    model, _ = load_run(run_folder)
    gen = D.Batches(val_tokens, batch_size, seq_len, seed=4242)
    batches = [gen.next() for _ in range(n_batches)]
    model.eval()
    eval_loss = statistics.fmean(model(x, y)[1].item() for x, y in batches)
    model.train()  # batch statistics, as in training (running statistics move; the model is not saved)
    train_loss = statistics.fmean(model(x, y)[1].item() for x, y in batches)
    (xa, _), (xb, _) = batches[0], batches[1]
    la = model(xa)[0][0]
    scale = la.pow(2).mean().sqrt().item()
    mates = torch.cat([xa[:1], xb[1:]])
    lb = model(mates)[0][0]
    mask = torch.ones_like(xa, dtype=torch.bool)
    mask[1:, seq_len // 2:] = False
    padded = xa.masked_fill(~mask, 0)
    lp = model(padded, mask=mask)[0][0]
    return {"mates_change": (la - lb).abs().max().item() / scale,
            "padding_change": (la - lp).abs().max().item() / scale,
            "eval_loss": eval_loss, "train_mode_loss": train_loss}


def accumulation_change(kind: str, d: int, seq_len: int, seed: int, micro: int = 4, batch: int = 32) -> float:
    """Float64: the relative difference between the gradients (of a linear layer feeding the norm,
    and of the norm's own weights) of one batch of ``batch`` sequences and of the same sequences
    as ``batch // micro`` micro-batches of ``micro`` with their gradients accumulated, as NLP
    training does to reach a large batch. Equal up to summation order unless the norm pools
    statistics over the batch."""
    from normlab.nn import build_norm

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, d, generator=gen, dtype=torch.float64)
    readout = torch.randn(d, generator=gen, dtype=torch.float64)
    torch.manual_seed(seed)
    linear = torch.nn.Linear(d, d, dtype=torch.float64)
    norm = build_norm(kind, d, **({"backend": "reference"} if kind != "batchnorm" else {})).double().train()
    params = list(linear.parameters()) + list(norm.parameters())

    def grads(parts: list[torch.Tensor]) -> torch.Tensor:
        total = [torch.zeros_like(p) for p in params]
        for part in parts:  # the mean loss over the whole batch, accumulated part by part
            loss = (norm(linear(part)) @ readout).pow(2).sum() / (batch * seq_len)
            for t, g in zip(total, torch.autograd.grad(loss, params)):
                t += g
        return torch.cat([t.flatten() for t in total])

    full, accumulated = grads([x]), grads(list(x.split(micro)))
    return ((accumulated - full).norm() / full.norm()).item()


BATCH_SIZES = (2, 8, 32)
ACCUM = (8, 4)  # (micro-batches, sequences each): the batch of 32 by gradient accumulation
ACCUM_KEY = f"{ACCUM[1]}x{ACCUM[0]}"


def same_text(batches: int, batch_size: int) -> int:
    """How many batches of ``batch_size`` hold the sequences of ``batches`` batches of the largest
    size: ParagraphBatches draws its paragraphs from one seeded stream, so these are the very same
    ones, and every batch size is validated on the same text (not 16 paragraphs at batch 2 against
    256 at batch 32)."""
    return batches * BATCH_SIZES[-1] // batch_size


BATCHNORM_CONDITIONS = [
    "matches (Shen et al.): variable-length sequences padded per batch, BatchNorm's statistics over the "
    "real tokens only, small and large batches, LayerNorm as the control at every batch size",
    "differs: a character LM whose sequences are the text between blank lines (a speech), at most 64 "
    "tokens; the paper: translation and language modelling with word pieces",
    "matches: every batch size trains the same number of steps (so larger batches see more sequences), as a "
    "batch-size comparison at a fixed training length does; one learning rate for all",
]


@torch.no_grad()
def position_statistics(tokens, newline: int, batch_size: int, seq_len: int, steps: int, seeds,
                        d: int = 32) -> dict:
    """Per-position BatchNorm (statistics per position over the batch's real tokens) on padded
    paragraph batches, as a model's first norm sees them at init: a fixed random embedding of the
    tokens (the same for every seed), ``steps`` training-mode batches per seed of data order.
    Returns per position the real tokens its running statistics came from (mean over seeds), the
    spread over seeds of the running mean (per feature), and whether a position past the longest
    training sequence is refused by name."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(int(max(tokens)) + 1, d)
    means, seen = [], []
    for seed in seeds:
        bn = SequenceBatchNorm(d, per_position=True, max_positions=2 * seq_len)
        gen = D.ParagraphBatches(tokens, batch_size, seq_len, seed, newline)
        for _ in range(steps):
            x, _, mask = gen.next()
            bn(embed(x), mask)
        means.append(bn.running_mean[:seq_len].double())
        seen.append(bn.seen[:seq_len].double())
    bn.eval()
    longest = int((bn.seen > 0).nonzero().max()) + 1
    try:  # one real token past the longest training sequence
        bn(embed(torch.zeros(1, longest + 1, dtype=torch.long)))
        refused = 0
    except ValueError as err:
        refused = int(f"position {longest} " in str(err))
    spread = torch.stack(means).std(dim=0)  # (positions, features): over seeds
    return {"seen": torch.stack(seen).mean(dim=0).tolist(), "spread": spread.tolist(), "longest": longest,
            "refused": refused}


def trend_sizes(lab: Lab) -> tuple[dict, dict, int]:
    """Training and model fields of the batch-size trend, and the steps every run trains."""
    train_fields = dict(preset="small", tokenizer="char", ckpt_every=0, diverge_factor=3.0,
                        batching="paragraphs",
                        lr=2e-3, min_lr=2e-4, weight_decay=0.1)
    if lab.size == "tiny":
        return {**train_fields, "seq_len": 16, "eval_batches": 2}, dict(d_model=16, n_layers=2, n_heads=2,
                                                                        max_seq_len=16,
                                                                        placement="pre"), 6
    if lab.quick:  # the norms preset's steps
        return {**train_fields, "seq_len": 64, "eval_batches": 8}, dict(d_model=64, n_layers=2, n_heads=4,
                                                                        max_seq_len=64,
                                                                        placement="pre"), 200
    return {**train_fields, "seq_len": 256, "eval_batches": 20}, dict(d_model=256, n_layers=4, n_heads=4,
                                                                      max_seq_len=256,
                                                                      placement="pre"), 1000


@torch.no_grad()
def train_eval_losses(run_folder: Path, tcfg_fields: dict, dataset, n_batches: int) -> dict:
    """A trained run's loss on fixed padded validation batches of its own batch size, with
    running statistics (eval mode) and with each batch's own statistics (training mode)."""
    from normlab.train import TrainConfig as _TC
    from normlab.train import make_batches

    model, _ = load_run(run_folder)
    tcfg = _TC(**tcfg_fields)
    gen = make_batches(dataset.val, tcfg, tcfg.seq_len, 4242, dataset.tokenizer)
    batches = [gen.next() for _ in range(n_batches)]
    model.eval()
    eval_loss = statistics.fmean(model(x, y, mask=m)[1].item() for x, y, m in batches)
    model.train()  # batch statistics, as in training (running statistics move; the model is not saved)
    train_loss = statistics.fmean(model(x, y, mask=m)[1].item() for x, y, m in batches)
    return {"eval_loss": eval_loss, "train_mode_loss": train_loss}


def preset_batchnorm(lab: Lab) -> dict:
    seeds = lab.seeds(LM_SEEDS, LM_SEEDS, preset="norms")  # the norms preset's seeds: its runs are reused
    norms = ("batchnorm", "layernorm", "rmsnorm")
    runs = train_norms(lab, norms, seeds)
    train_fields, _ = lm_sizes(lab)
    tf = {**train_fields, **lab.train_over}
    # the batch-size trend, on padded variable-length sequences (left out of the demo: 1.5 minutes on 2 cores)
    trend_train, trend_model, steps = trend_sizes(lab)
    trend_steps = lab.sized_train({**trend_train, "steps": steps}, trend_model)["steps"]  # a rung's scaled
    trend_seeds = lab.seeds(3, 3)
    trend_runs = {}  # (norm, batch size) -> (fields, one run per seed)
    for norm in ("batchnorm", "layernorm") if not lab.s.brief else ():
        for bs in BATCH_SIZES:
            fields = {**trend_train, "batch_size": bs, "steps": steps, "warmup": max(1, steps // 10),
                      "eval_every": max(1, steps // 4),
                      "eval_batches": same_text(trend_train["eval_batches"], bs)}
            trend_runs[norm, bs] = fields, [lab.run(f"pad-{norm}-b{bs}-s{seed}", fields, trend_model,
                                                    {"norm": norm, "seed": seed},
                                                    tune=True) for seed in trend_seeds]
        # the largest batch again, reached as NLP training reaches it: micro-batches with their gradients
        # accumulated, at the true batch's rate (the recipe unchanged: for LayerNorm the same gradients)
        fields, _ = trend_runs[norm, ACCUM[0] * ACCUM[1]]
        lr = lab.arm_lr(f"pad-{norm}-b{ACCUM[0] * ACCUM[1]}")
        accumulated = {**fields, "batch_size": ACCUM[1], "grad_accum": ACCUM[0],
                       "eval_batches": same_text(trend_train["eval_batches"], ACCUM[1])}
        trend_runs[norm, ACCUM_KEY] = (accumulated,
                                   [lab.run(f"pad-{norm}-b{ACCUM_KEY}-s{seed}", accumulated, trend_model,
                                            {"norm": norm, "seed": seed, "lr": lr, "min_lr": lr / 10})
                                    for seed in trend_seeds])
    effects = {}  # the measurements, once every run is asked for (--plan lists runs up to the first one)
    for norm in norms:
        effects[norm] = [lab.job(f"effects-{norm}",
                                 {"run": r["run"], "bs": tf["batch_size"], "T": tf["seq_len"]},
                                 lambda r=r: batch_effects(lab.out / "runs" / r["run"], lab.dataset.val,
                                                           tf["batch_size"],
                                                           tf["seq_len"], lab.pick(4, 10, tiny=2)))
                         for r in runs[norm]]
    accumulation = lab.job("accumulation", {"d": 32, "T": 8, "micro": 4, "batch": 32},
                           lambda: {n: accumulation_change(n, 32, 8, seed=71)
                                    for n in ("layernorm", "batchnorm")})
    rows, measured = [], {f"{n}_accumulation_change": v for n, v in accumulation.items()}
    if trend_runs:  # with the trend (left out of the demo, whose family was planned without it)
        pos_seeds, pos_steps = lab.pick(5, 5, tiny=3), lab.pick(100, 300, tiny=4)
        positions = lab.job("positions",
                            {"B": BATCH_SIZES[1], "T": trend_train["seq_len"], "steps": pos_steps,
                             "seeds": pos_seeds},
                            lambda: position_statistics(lab.dataset.train,
                                                        D.newline_id(lab.dataset.tokenizer), BATCH_SIZES[1],
                                                        trend_train["seq_len"], pos_steps, range(pos_seeds)))
        quarter = max(1, len(positions["seen"]) // 4)
        early, late = positions["spread"][:quarter], positions["spread"][-quarter:]
        measured.update({
            "early_position_tokens": statistics.fmean(positions["seen"][:quarter]),
            "late_position_tokens": statistics.fmean(positions["seen"][-quarter:]),
            # per feature, the spread over seeds averaged over the quarter's positions: paired by feature
            "early_position_spread": [statistics.fmean(col) for col in zip(*early)],
            "late_position_spread": [statistics.fmean(col) for col in zip(*late)],
            "position_unseen_refused": positions["refused"]})
    for norm in norms:
        e = effects[norm]
        mates = max(x["mates_change"] for x in e)
        pad = max(x["padding_change"] for x in e)
        val = stats([r["val_loss"] for r in runs[norm]])
        rows.append({"norm": norm, "batch_size": tf["batch_size"], "batching": "windows",
                     "lr": lab.arm_lr(norm),
                     "mates_change": round_sig(mates, 3), "padding_change": round_sig(pad, 3),
                     "val_loss": round_sig(val["mean"]), "val_std": round_sig(val["std"], 2)})
        measured.update({f"{norm}_mates_change": mates, f"{norm}_padding_change": pad,
                         f"{norm}_val": [r["val_loss"] for r in runs[norm]]})
    trend = {}
    for (norm, bs), (fields, rs) in trend_runs.items():
        losses = [lab.job(f"trainmode-{r['run']}", {"run": r["run"]},
                          lambda r=r, fields=fields: train_eval_losses(
                              lab.out / "runs" / r["run"], {**fields, **lab.train_over}, lab.dataset,
                              same_text(lab.pick(8, 20, tiny=2), fields["batch_size"])))
                  for r in rs]
        gaps = [abs(x["train_mode_loss"] - x["eval_loss"]) / x["eval_loss"] for x in losses]
        trend[norm, bs] = {"val": [r["val_loss"] for r in rs], "gap": gaps}
        val = stats(trend[norm, bs]["val"])
        accumulated = bs == ACCUM_KEY
        rows.append({"norm": norm, "batch_size": ACCUM[0] * ACCUM[1] if accumulated else bs,
                     "batching": f"paragraphs, {ACCUM[0]} x {ACCUM[1]} accumulated" if accumulated
                     else "paragraphs",
                     "lr": lab.arm_lr(f"pad-{norm}-b{ACCUM[0] * ACCUM[1] if accumulated else bs}"),
                     "val_loss": round_sig(val["mean"]),
                     "val_std": round_sig(val["std"], 2),
                     "eval_loss": round_sig(statistics.fmean(x["eval_loss"] for x in losses)),
                     "train_mode_loss": round_sig(statistics.fmean(x["train_mode_loss"] for x in losses)),
                     "train_eval_gap": round_sig(statistics.fmean(gaps), 3)})
    small, large = BATCH_SIZES[0], BATCH_SIZES[-1]
    for bs in (small, large) if trend else ():
        measured[f"batchnorm_gap_b{bs}"] = trend["batchnorm", bs]["gap"]
        measured[f"layernorm_val_b{bs}"] = trend["layernorm", bs]["val"]
        measured[f"batchnorm_excess_b{bs}"] = [None if b is None or ln is None else b / ln - 1
                                               for b, ln in zip(trend["batchnorm", bs]["val"],
                                                                trend["layernorm", bs]["val"])]
    if trend:
        measured["layernorm_val_accum"] = trend["layernorm", ACCUM_KEY]["val"]
        measured["batchnorm_excess_accum"] = [None if b is None or ln is None else b / ln - 1
                                              for b, ln in zip(trend["batchnorm", ACCUM_KEY]["val"],
                                                               trend["layernorm", ACCUM_KEY]["val"])]
    worst = "the largest change over seeds: one sequence whose output moves proves the dependence"
    none_moves = "the largest change over seeds: no sequence's output may move"
    moves = C.ours("1e-3 of the logits' RMS: 100x above float32 rounding's 1e-7-1e-5, so rounding cannot "
                   "pass it")
    still = C.ours("1e-5 of the logits' RMS: what float32 rounding through a few layers can reach, and no "
                   "more")
    trend_cond = BATCHNORM_CONDITIONS + [f"batch sizes {small} and {large} compared, paired by seed "
                                         f"({len(trend_seeds)} seeds)"]
    # the two kinds of model this preset trains: a ladder places each claim at its own runs' size
    norms_size = parameters_of([r for rs in runs.values() for r in rs])
    trend_size = parameters_of([r for _, rs in trend_runs.values() for r in rs])
    claims = [
        C.claim("batchnorm.mates",
                "under BatchNorm a sequence's output changes with its batch-mates and their padding "
                "(largest change of its logits >= 1e-3 of their RMS), under LayerNorm and RMSNorm it does "
                "not (<= 1e-5)", SHEN20,
                claim_values(measured,
                             *[f"{n}_{k}" for n in norms for k in ("mates_change", "padding_change")]),
                C.all_of(C.at_least("batchnorm_mates_change", 1e-3, point=worst, origin=moves),
                         C.at_least("batchnorm_padding_change", 1e-3, point=worst, origin=moves),
                         *[C.at_most(f"{n}_{k}", 1e-5, point=none_moves, origin=still)
                           for n in ("layernorm", "rmsnorm") for k in ("mates_change", "padding_change")]),
                ["matches: the same sequence run with other batch-mates, and with half-padded batch-mates, "
                 "in training mode",
                 "differs: measured on models trained on fixed windows (the norms preset's runs)"],
                parameters=norms_size),
    ]
    claims.append(C.claim(
        "batchnorm.accumulation",
        "with gradient accumulation (8 micro-batches of 4 for a batch of 32, as NLP training "
        "reaches large batches), LayerNorm's gradients are those of the true batch, up to summation order; "
        "BatchNorm's "
        "are not (each micro-batch has its own statistics)",
        "the BatchNorm article: 'NLP training uses small batches "
        "with gradient accumulation, so BatchNorm's statistics are unreliable'",
        claim_values(measured, "layernorm_accumulation_change", "batchnorm_accumulation_change"),
        C.all_of(C.at_most("layernorm_accumulation_change", 1e-12, point="the gradients' relative difference",
                           origin=C.ours("1e-12: float64 summation order changes a sum by about 1e-16 per "
                                         "term")),
                 C.at_least("batchnorm_accumulation_change", 1e-3, point="the gradients' relative difference",
                            origin=moves)),
        ["matches: one linear layer feeding the norm, its gradients and the norm's over a batch of 32 "
         "sequences of 8 tokens, once whole and once as 8 accumulated micro-batches of 4 (float64, training "
         "mode)",
         "differs: a layer, not a trained language model; the loss gap it would cause in training is not "
         "measured here"]))
    measured["unigram_loss"] = unigram_loss(lab.dataset.train)
    # planned after the batchnorm ladder's seeds 0-4 hinted at it (docs/results), so tested on fresh
    # seeds (--seed-start); left out of the demo, whose family was planned without it
    claims += [] if lab.s.brief else [
        C.claim("batchnorm.worse_than_layernorm",
                "BatchNorm trains a language model worse than LayerNorm: it ends at least 2% above "
                "LayerNorm's loss, where LayerNorm trains", SHEN20,
                claim_values(measured, "batchnorm_val", "layernorm_val", "unigram_loss"),
                C.given(trains("layernorm_val"),
                        C.above("batchnorm_val", "layernorm_val", 0.02, origin=WORSE, paired=True)),
                ["matches: BatchNorm in place of every LayerNorm of a Transformer trained on text, each at "
                 "its own tuned learning rate, paired by seed",
                 f"differs: a {lab.model_config(lm_sizes(lab)[1]).n_layers}-layer Pre-LN decoder, fixed "
                 f"windows of one length (no padding) at batch {tf['batch_size']}; the article: translation "
                 "and language models at larger scale"], parameters=norms_size)]
    article = "the BatchNorm article (its figure normalizes each position over the batch)"
    pos_cond = [f"matches: statistics per position over the real tokens of padded paragraph batches of "
                f"{BATCH_SIZES[1]} (SequenceBatchNorm(per_position=True)), as the article's figure draws "
                "them",
                "differs: the first norm's input at init (a fixed random embedding of the tokens, 32 "
                "features), not a trained model's; the seeds vary the data order"]
    claims += [] if not trend else [
        C.claim("batchnorm.position_unseen_refused",
                "per-position BatchNorm has no statistics for a position past the longest training "
                "sequence: a real token there is refused with an error that names the position", article,
                claim_values(measured, "position_unseen_refused"),
                C.at_least("position_unseen_refused", 1,
                           point="whether the error was raised and named the position",
                           origin=C.ours("1: the refusal happened (0: it did not)")), pos_cond),
        C.claim("batchnorm.late_positions_noisier",
                "per position, late positions' running statistics come from fewer "
                "tokens and vary more across seeds than early positions' (the last quarter of positions "
                "against the "
                "first)", article,
                claim_values(measured, "late_position_tokens", "early_position_tokens",
                             "late_position_spread",
                      "early_position_spread"),
                C.all_of(C.below("late_position_tokens", "early_position_tokens",
                                 point="the real tokens per position, counted (mean over seeds)"),
                         C.above("late_position_spread", "early_position_spread", paired=True, absolute=True,
                                 over="features")),
                pos_cond),
        C.claim("batchnorm.gap_grows",
                f"BatchNorm's train/eval mismatch grows as the batch shrinks: its loss in training "
                f"mode differs more from eval mode at batch {small} than at {large}", SHEN20,
                claim_values(measured, f"batchnorm_gap_b{small}", f"batchnorm_gap_b{large}"),
                C.above(f"batchnorm_gap_b{small}", f"batchnorm_gap_b{large}", paired=True), trend_cond,
                parameters=trend_size),
        C.claim("batchnorm.small_batch_worse",
                f"BatchNorm falls further behind LayerNorm as the batch shrinks: its excess "
                f"loss over LayerNorm is larger at batch {small} than at {large}, where LayerNorm trains at "
                "both", SHEN20,
                claim_values(measured, f"batchnorm_excess_b{small}", f"batchnorm_excess_b{large}",
                             f"layernorm_val_b{small}",
                      f"layernorm_val_b{large}", "unigram_loss"),
                C.given(C.all_of(trains(f"layernorm_val_b{small}"), trains(f"layernorm_val_b{large}")),
                        C.above(f"batchnorm_excess_b{small}", f"batchnorm_excess_b{large}", paired=True,
                                absolute=True)),
                trend_cond, parameters=trend_size),
        C.claim("batchnorm.accumulation_worse",
                f"BatchNorm falls further behind LayerNorm when the batch of {large} is "
                f"reached by accumulating {ACCUM[0]} micro-batches of {ACCUM[1]} than with the true batch: "
                "its excess loss "
                "over LayerNorm is larger, where LayerNorm trains at both",
                "the BatchNorm article: 'NLP training uses "
                "small batches with gradient accumulation, so BatchNorm's statistics are unreliable'",
                claim_values(measured, "batchnorm_excess_accum", f"batchnorm_excess_b{large}",
                             "layernorm_val_accum",
                      f"layernorm_val_b{large}", "unigram_loss"),
                C.given(C.all_of(trains("layernorm_val_accum"), trains(f"layernorm_val_b{large}")),
                        C.above("batchnorm_excess_accum", f"batchnorm_excess_b{large}", paired=True,
                                absolute=True)),
                trend_cond
                + ["matches: the accumulated runs train at the true batch's rate, each norm at its own (the "
                   "recipe unchanged, as when accumulation stands in for a batch that does not fit; for "
                   "LayerNorm the very same gradients up to summation order): not tuned again"],
                parameters=trend_size),
    ]
    brief = [] if trend else ["The demo leaves out the batch-size trend on padded sequences (1.5 minutes on "
                              "2 cores): `normlab compare batchnorm --quick` runs it, reusing the demo's "
                              "runs."]
    columns = ["norm", "batch_size", "batching", "lr", "mates_change", "padding_change", "val_loss",
               "val_std"]
    # the trend's rows fill them
    columns += ["eval_loss", "train_mode_loss", "train_eval_gap"] if trend else []
    rows = [{c: r.get(c) for c in columns} for r in rows]
    return {
        "title": "Why text models left BatchNorm",
        "question": "Does BatchNorm make a sequence's output depend on its batch, and does it fail with "
                    "small, padded batches?",
        "settings": {"train": tf, "seeds": seeds,
                     "trend": {"train": trend_train, "model": trend_model, "steps": steps,
                               "batch_sizes": list(BATCH_SIZES), "seeds": trend_seeds}},
        "columns": columns, "rows": rows, "claims": claims,
        "series": {"rows": [r for r in rows if r["batching"] == "windows"],
                   "trend": {f"{n}|{bs}": v for (n, bs), v in trend.items()},
                   "batch_sizes": list(BATCH_SIZES),
                   "accumulation": {"key": ACCUM_KEY, "batch": ACCUM[0] * ACCUM[1],
                                    "label": f"{ACCUM[0]} x {ACCUM[1]} accumulated"}},
        "notes": ["mates_change / padding_change (windows rows): largest change of one sequence's logits, "
                  "relative to their RMS, when its batch-mates are swapped for others / half padded "
                  "(training mode: batch statistics; largest over seeds). In a causal LM, training-mode "
                  "BatchNorm also pools statistics over future positions."]
                 + (["paragraphs rows: trained on the text between blank lines, padded per batch with a "
                     f"mask, {trend_steps} "
                     "steps per run whatever the batch size; val_loss in eval mode (running statistics); "
                     "train_eval_gap: "
                     "|training-mode loss - eval-mode loss| / eval-mode loss on fixed padded validation "
                     "batches of the "
                     "run's own batch size. Every batch size is validated on the same paragraphs (as many "
                     "batches of its size as hold the largest batch's). The accumulated rows: the batch "
                     "of 32 as 8 micro-batches of 4 with their gradients "
                     "summed, so BatchNorm's statistics come from 4 sequences; each norm at its batch-32 "
                     "rate."] if trend else brief),
    }
