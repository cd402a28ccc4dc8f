"""Preset ``dyt``: norm-free Transformers with DyT (Zhu et al. 2025) against RMSNorm and LayerNorm,
and Derf (Chen et al. 2025), DyT with erf(alpha x + s) in place of tanh(alpha x).

DyT(x) = weight * tanh(alpha * x) + bias replaces every norm, with one learned alpha per layer
started at alpha0. Zhu et al. report that it matches LayerNorm and RMSNorm "mostly without
hyperparameter tuning" (their language models tune alpha0); later work reports that it helps
when data is scarce relative to the model and hurts when data is plentiful, through saturation
(|alpha x| > 2). Three alpha0, every seed paired, and two data budgets at the same steps: a
small set that the steps go over 164 times, as the study's 1M tokens were, and the whole
corpus, never repeated.

DyT is not scale-invariant, so what it sees matters. The paper's Llama code multiplies the token
embeddings (std 0.02) by a learned scalar started at sqrt(d): 64 at 7B, so that the first DyT sees
values of RMS 1.28. The DyT runs here do the same with the gain started at 64 (sqrt(d) of this
width would give 0.2); one more setting, at the default alpha0 without the gain, shows what
happens without it. The baselines are the paper's: RMSNorm and LayerNorm without the gain. Derf
runs as the DyT setting at the default alpha0 does (the same gain, shift started at 0), so the two
differ only in the function.
"""

from __future__ import annotations

import statistics

import torch

from normlab import claims as C
from normlab import data as D
from normlab.experiments.common import (COMPARABLE, WORSE, curves_of, claim_values, round_sig, lm_sizes,
                                        stats, trains, unigram_loss)
from normlab.experiments.lab import Lab
from normlab.nn import DyT
from normlab.train import load_run, train_split

ZHU25 = "Zhu, Chen, He, LeCun & Liu (2025), Transformers without Normalization, CVPR"
CHEN25 = ("Chen, Lu, Zhu, Sun & Liu (2025), Stronger Normalization-Free Transformers (arXiv 2512.10938): "
          "Derf improves on DyT in every domain tried, GPT-2 language modelling among them")
REGIME26 = ("When Does Removing LayerNorm Help? Activation Bounding as a Regime-Dependent Implicit "
            "Regularizer (arXiv 2604.23434, 2026): DyT 27% better at 1M tokens, 19% worse at 118M (64M "
            "parameters)")
ALPHA0S = (0.2, 0.5, 1.0)  # the paper's default 0.5, and a factor 2.5 and 2 either side
DEFAULT_ALPHA0 = 0.5
BUDGET_FACTOR = 10  # the large dataset is at least this many times the small one
# The study trained 5000 steps of 64 x 512 tokens on its small set of 1M tokens: 164 passes
# over it, where a model memorizes. The small budget here is a set the steps go over as often.
SMALL_PASSES = 164
SATURATED = 2.0  # |alpha x| above this: tanh is within 4% of +-1 (the regime study's threshold)
# the paper's Llama 7B starts its embedding gain at sqrt(4096): embedding RMS 0.02 x 64 = 1.28
EMBED_GAIN = 64.0


@torch.no_grad()
def saturation(folder, tokens, batch_size: int, seq_len: int) -> float:
    """The share of DyT inputs with |alpha x| > 2, over every DyT of a trained run, on 2 fixed
    batches of ``tokens`` (the run's training tokens, where the regime study counted)."""
    model, _ = load_run(folder)
    model.eval()
    counts = [0, 0]

    def hook(module, args):
        z = (module.alpha.float() * args[0].float()).abs()
        counts[0] += int((z > SATURATED).sum())
        counts[1] += z.numel()

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, DyT)]
    gen = D.Batches(tokens, batch_size, seq_len, seed=606)
    for _ in range(2):
        model(gen.next()[0])
    for h in handles:
        h.remove()
    return counts[0] / max(1, counts[1])


def settings_of(norm: str, alpha0: float | None, gain: bool = True) -> str:
    """A row's name: the norm for a baseline, dyt (derf) and alpha0 for DyT (Derf) (-nogain: no
    embedding gain)."""
    return norm if alpha0 is None else f"{norm}{alpha0:g}" + ("" if gain else "-nogain")


def small_set(steps: int, batch_size: int, seq_len: int) -> int:
    """The tokens of a training set that ``steps`` go over SMALL_PASSES times (a few windows at least)."""
    return max(4 * (seq_len + 1), steps * batch_size * seq_len // SMALL_PASSES)


def data_budgets(lab: Lab, steps: int, batch_size: int, seq_len: int) -> dict:
    """{"small": tokens, "large": tokens}: a training set gone over SMALL_PASSES times in
    ``steps``, and the whole training split (at least BUDGET_FACTOR times larger)."""
    small = small_set(steps, batch_size, seq_len)
    whole = len(lab.dataset.train)
    if whole < BUDGET_FACTOR * small:
        raise ValueError(f"the dyt preset compares a small training set of {small:,} tokens with the whole "
                         f"training split, which must hold at least {BUDGET_FACTOR}x that "
                         f"({BUDGET_FACTOR * small:,} tokens); this data's split has {whole:,}: use more "
                         "text or fewer steps")
    return {"small": small, "large": whole}


def preset_dyt(lab: Lab) -> dict:
    train_fields, model = lm_sizes(lab)
    model = {**model, "placement": "pre"}
    tf = {**train_fields, **lab.train_over}
    steps = lab.train_over.get("steps") or max(2, train_fields["steps"] // 8) * 10  # quick: 250
    fields = {**train_fields, "steps": steps, "warmup": max(1, steps // 10), "eval_every": max(1, steps // 4)}
    # A ladder rung or the gpu size trains longer or shorter than `steps`; the small set is the one
    # the runs' own steps go over SMALL_PASSES times, so it is sized from those. Arm names keep the
    # preset's size (the design's tuned rates are found by them), as "250steps" does.
    run_steps = lab.sized_train(fields, model)["steps"]
    budgets = data_budgets(lab, run_steps, tf["batch_size"], tf["seq_len"])
    passes = {b: run_steps * tf["batch_size"] * tf["seq_len"] / n for b, n in budgets.items()}
    named = {"small": f"-{small_set(steps, tf['batch_size'], tf['seq_len'])}tokens", "large": ""}
    seeds = lab.seeds(3, 3)
    cells = [("rmsnorm", None, False), ("layernorm", None, False)] + [("dyt", a, True) for a in ALPHA0S]
    cells += [("dyt", DEFAULT_ALPHA0, False), ("derf", DEFAULT_ALPHA0, True)]
    runs = {}
    train_tokens = {"small": budgets["small"], "large": 0}  # 0: the whole split, as the runs before it
    for budget, n in train_tokens.items():
        data = {"train_tokens": n} if n else {}
        tag = named[budget]
        for norm, alpha0, gain in cells:
            varied = {"norm": norm, **({"dyt_alpha0": alpha0} if alpha0 is not None else {}),
                      **({"embed_gain": EMBED_GAIN} if gain else {}), **data}
            setting = settings_of(norm, alpha0, gain)
            runs[setting, budget] = [lab.run(f"{setting}-{steps}steps{tag}-s{seed}", fields, model,
                                             {**varied, "seed": seed},
                                             tune=True)
                                     for seed in lab.arm_seeds(f"{setting}-{steps}steps{tag}", seeds, 3)]
    lab.plan_equivalence(f"{settings_of('dyt', DEFAULT_ALPHA0)}-{steps}steps", f"rmsnorm-{steps}steps", 0.02)

    def saturated_in(run: dict, budget: str) -> float:
        data = train_split(lab.dataset, train_tokens[budget])
        return lab.job(f"saturation-{run['run']}",
                       {"run": run["run"], "B": tf["batch_size"], "T": tf["seq_len"], "on": "train"},
                       lambda: saturation(lab.out / "runs" / run["run"], data, tf["batch_size"],
                                          tf["seq_len"]))

    saturated = {(setting, budget): [saturated_in(r, budget) for r in rs]
                 # (tanh's threshold: not Derf)
                 for (setting, budget), rs in runs.items() if setting.startswith("dyt")}
    rows, measured = [], {"unigram_loss": unigram_loss(lab.dataset.train)}
    for (setting, budget), rs in runs.items():
        measured[f"{setting}_{budget}_val"] = [r["val_loss"] for r in rs]
        val = stats(measured[f"{setting}_{budget}_val"])
        sat = saturated.get((setting, budget))
        arm = f"{setting}-{steps}steps{named[budget]}"
        rows.append({"setting": setting, "budget": budget, "lr": lab.arm_lr(arm), "tokens": budgets[budget],
                     "passes": round_sig(passes[budget], 3),
                     "seeds": len(rs),
                     "diverged": sum(r["status"] == "diverged" for r in rs),
                     "val_loss": round_sig(val["mean"]),
                     "val_std": round_sig(val["std"], 2), "saturated": round_sig(statistics.fmean(sat), 3)
                     if sat else None})
    means = {a: stats(measured[f"dyt{a:g}_large_val"])["mean"] for a in ALPHA0S}
    finite = {a: m for a, m in means.items() if m is not None}
    best = min(finite, key=finite.get) if finite else ALPHA0S[0]
    worst = max(finite, key=finite.get) if finite else ALPHA0S[-1]
    measured["dyt_best_alpha0_large_val"] = measured[f"dyt{best:g}_large_val"]
    measured["dyt_worst_alpha0_large_val"] = measured[f"dyt{worst:g}_large_val"]
    default, derf = settings_of("dyt", DEFAULT_ALPHA0), settings_of("derf", DEFAULT_ALPHA0)
    conditions = [
        "matches: every norm of a Pre-LN decoder (both per block and the final one) replaced by DyT with a "
        "learned scalar alpha per layer and per-feature weight, alpha0 = 0.5 the paper's default; the token "
        f"embeddings times a learned scalar as in the paper's Llama code, started at {EMBED_GAIN:g} (its "
        "7B's sqrt(d)) so that the first DyT sees the paper's scale (RMS 1.28; sqrt(d) of this width would "
        "give 0.2); RMSNorm and LayerNorm in the same model without that scalar, as the paper's baselines; "
        "the same data, steps and seeds",
        f"differs: a {model['n_layers']}-layer character LM on Shakespeare for {run_steps} steps over the "
        f"whole corpus ({passes['large']:.2g} passes; the paper: LLaMA 7B-70B on 200B tokens, with alpha0 "
        "tuned per model and per position, at 7B 0.8 before attention and 0.2 before the MLP and at the "
        "end); DyT here also has a per-feature bias, the paper's Llama DyT does not",
    ]
    regime = [conditions[0],
              f"matches: the same {run_steps} steps on a small training set ({budgets['small']:,} tokens, "
              f"the first of the split) gone over {passes['small']:.0f} times, as the study's 1M tokens were "
              f"(5000 steps of 64 x 512), and on the whole split ({budgets['large']:,} tokens, "
              f"{passes['large']:.2g} passes: data not repeated, as at the study's 118M, 1.4 passes); "
              "validation on the same held-out documents",
              f"differs: a far smaller model and run (a character LM on Shakespeare, {run_steps} steps of "
              f"{tf['batch_size'] * tf['seq_len']:,} tokens; the study: GPT-2 from 64M parameters on "
              "WikiText, 5000 steps of 32,768 tokens); the study's DyT starts alpha at 2.0 in GPT-2, "
              f"without an embedding gain, where this one starts at {DEFAULT_ALPHA0:g}, with the gain, in a "
              "Llama-style decoder"]
    claims = [
        C.claim("dyt.parity",
                f"at the default alpha0 = {DEFAULT_ALPHA0:g}, DyT ends within 2% of RMSNorm (larger "
                "budget), where RMSNorm trains", ZHU25,
                claim_values(measured, f"{default}_large_val", "rmsnorm_large_val", "unigram_loss"),
                C.given(trains("rmsnorm_large_val"),
                        C.within(f"{default}_large_val", "rmsnorm_large_val", 0.02, origin=COMPARABLE,
                                 paired=True)), conditions),
        C.claim("dyt.alpha0_sensitive",
                f"DyT depends on alpha0: of {', '.join(f'{a:g}' for a in ALPHA0S)}, the worst "
                "ends at least 2% above the best (larger budget; best and worst chosen by their mean), where "
                "the best "
                "trains", ZHU25, claim_values(measured, "dyt_worst_alpha0_large_val",
                                              "dyt_best_alpha0_large_val", "unigram_loss"),
                C.given(trains("dyt_best_alpha0_large_val"),
                        C.above("dyt_worst_alpha0_large_val", "dyt_best_alpha0_large_val", 0.02, origin=WORSE,
                                paired=True)),
                conditions + [f"the best alpha0 here was {best:g} and the worst {worst:g}"]),
        C.claim("dyt.regime_flips",
                "DyT's effect against LayerNorm (the study's baseline) changes sign with the data: lower "
                f"loss on a small training set gone over {passes['small']:.0f} times, higher on the whole "
                "corpus in the same steps", REGIME26,
                claim_values(measured, f"{default}_small_val", "layernorm_small_val", f"{default}_large_val",
                             "layernorm_large_val",
                      "unigram_loss"),
                C.given(C.all_of(trains("layernorm_small_val"), trains("layernorm_large_val")),
                        C.all_of(C.below(f"{default}_small_val", "layernorm_small_val", paired=True),
                                 C.above(f"{default}_large_val", "layernorm_large_val", paired=True))),
                regime + ["the baseline must train on both budgets (10% below the unigram loss): a baseline "
                          "that only memorizes its small set gives DyT nothing to beat"]),
        C.claim("dyt.derf_beats_dyt",
                f"Derf, erf(alpha x + s), ends below DyT, tanh(alpha x), at the same alpha0 = "
                f"{DEFAULT_ALPHA0:g} and embedding gain (larger budget), where DyT trains", CHEN25,
                claim_values(measured, f"{derf}_large_val", f"{default}_large_val", "unigram_loss"),
                C.given(trains(f"{default}_large_val"),
                        C.below(f"{derf}_large_val", f"{default}_large_val", paired=True)),
                [conditions[0].replace("replaced by DyT",
                                       "replaced by DyT or by Derf (its shift s learned, started at 0)"),
                 conditions[1]
                 + "; the paper's language-model comparison trains GPT-2 on web text, thousands of "
                 "times this model's size",
                 "each at its own tuned learning rate (the pilot tunes every arm)"]),
    ]
    return {
        "title": "DyT and Derf: Transformers without normalization",
        "question": "Does DyT match RMSNorm, how much does alpha0 matter, does its effect depend on the "
                    "data budget, and does Derf's erf beat DyT's tanh?",
        "settings": {"train": {**fields, **lab.train_over}, "model": {**model, **lab.model_over},
                     "budgets": budgets,
                     "passes": passes, "alpha0s": list(ALPHA0S), "dyt_embed_gain": EMBED_GAIN,
                     "seeds": seeds},
        "columns": ["setting", "budget", "lr", "tokens", "passes", "seeds", "diverged", "val_loss", "val_std",
                    "saturated"],
        "rows": rows, "claims": claims,
        "series": {"runs": {f"{s}|{b}": [curves_of(r) for r in rs] for (s, b), rs in runs.items()},
                   "saturated": {f"{s}|{b}": v for (s, b), v in saturated.items()}},
        "notes": [f"{len(seeds)} seeds per setting and budget, {run_steps} steps each; budget: the training "
                  "tokens the steps draw windows from (small: the split's first tokens, large: the whole "
                  "split), passes: how often the steps go over them. Warmup a tenth of the steps, then "
                  f"cosine. saturated: the share of DyT inputs with |alpha x| > {SATURATED:g} after training "
                  "(two batches of the run's own training tokens, every DyT, as the study counted). The dyt "
                  f"settings start the embedding gain at {EMBED_GAIN:g}; "
                  f"{settings_of('dyt', DEFAULT_ALPHA0, False)} is DyT without it (embeddings of RMS 0.02 "
                  "into the first DyT)."],
    }
