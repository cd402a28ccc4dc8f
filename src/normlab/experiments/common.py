"""What the presets share, so that no preset imports another: the sources they cite, the
thresholds their claims use (each with where it comes from), the models and sizes several presets
train, and small helpers over measurements. A preset imports from here and from lab (the run
machinery)."""

from __future__ import annotations

import math
import statistics

import numpy as np

from normlab import claims as C
from normlab.experiments.lab import Lab

# ------------------------------------------------------------------------------- the sources

ZHANG19 = "Zhang & Sennrich (2019), Root Mean Square Layer Normalization, NeurIPS"
XIONG20 = "Xiong et al. (2020), On Layer Normalization in the Transformer Architecture, ICML"
WANG22 = "Wang et al. (2022), DeepNet: Scaling Transformers to 1,000 Layers"
SHEN20 = "Shen et al. (2020), PowerNorm: Rethinking Batch Normalization in Transformers, ICML"
MICIK18 = "Micikevicius et al. (2018), Mixed Precision Training, ICLR"
WORTSMAN23 = ("Wortsman et al. (2023), Small-scale proxies for large-scale Transformer training "
              "instabilities; Dehghani et al. (2023), Scaling Vision Transformers to 22 Billion Parameters")
BLOOM22 = ("BigScience (2022), BLOOM: A 176B-Parameter Open-Access Multilingual Language Model, sec. 3.2.3 "
           "(the embedding LayerNorm improved training stability in their 104B pilot, and penalized "
           "zero-shot generalization)")
GLM22 = ("Zeng et al. (2022), GLM-130B: An Open Bilingual Pre-trained Model (their trials of LayerNorm "
         "placements, Sandwich-LN among them, for the 130B model: DeepNorm was the most stable)")
NORMLAB = "normlab's aim (DESIGN.md): fused kernels faster than the framework's own norms"

NORMS = ("layernorm", "rmsnorm", "prmsnorm", "batchnorm", "none")

# ------------------------------------------------------------------- thresholds with their origins

COMPARABLE = C.ours("the paper reports 'comparable performance' without a number; 2% of the loss (0.04-0.07 "
                    "nats at these losses, a 4-7% change of perplexity) is the lab's bound for a difference "
                    "a user would act on, fixed in the plan before the runs; the evidence also gives the "
                    "smallest margin that holds")
WORSE = C.ours("2% of the loss: as large as the comparable-quality bound, so 'worse' and 'comparable' "
               "cannot both hold")
ZHANG_SPEED = C.source("'reduces the running time by 7%~64% on different models' (abstract)")
DIVERGED = C.ours("a count: one diverged seed is a failure to train")


# Seeds where the design sizes none: the arms outside the equivalence claims (BatchNorm and no
# norm, whose claims are large directional effects), and sizes without a design.
LM_SEEDS = 5

TRAINS = C.ours("10% below the character-frequency (unigram) loss: the model learned more than letter counts")


def trains(key: str) -> dict:
    """The precondition of a claim about training: the loss ends 10% below the unigram loss."""
    return C.at_most(key, "unigram_loss", -0.1, origin=TRAINS)


# ----------------------------------------------------------------- the models and sizes presets share

# The model of Xiong et al. (2020): the original Transformer's pieces in this decoder.
XIONG_MODEL = dict(norm="layernorm", mlp="relu", positions="learned", tie_embeddings=False, embed_scale=True,
                   init="xavier")


def lm_sizes(lab: Lab) -> tuple[dict, dict]:
    """Training and model fields of the language-model comparisons (norms, batchnorm)."""
    train_fields = dict(preset="small", tokenizer="char", ckpt_every=0, diverge_factor=3.0, weight_decay=0.1)
    if lab.size == "tiny":
        train_fields.update(steps=6, batch_size=4, seq_len=16, lr=2e-3, min_lr=2e-4, warmup=2, eval_every=3,
                            eval_batches=2)
        model = dict(d_model=16, n_layers=2, n_heads=2, max_seq_len=16)
    elif lab.quick:
        train_fields.update(steps=200, batch_size=16, seq_len=64, lr=2e-3, min_lr=2e-4, warmup=20,
                            eval_every=25, eval_batches=8)
        model = dict(d_model=96, n_layers=4, n_heads=4, max_seq_len=64)
    else:
        train_fields.update(steps=1000, batch_size=16, seq_len=256, lr=1e-3, min_lr=1e-4, warmup=100,
                            eval_every=50, eval_batches=20)
        model = dict(d_model=256, n_layers=4, n_heads=4, max_seq_len=256)
    return train_fields, model


def train_norms(lab: Lab, norms, seeds, preset: str = "norms") -> dict[str, list[dict]]:
    train_fields, model = lm_sizes(lab)
    return {norm: [lab.run(f"{norm}-s{seed}", train_fields, {**model, "placement": "pre"},
                           {"norm": norm, "seed": seed},
                           tune=True) for seed in lab.arm_seeds(norm, seeds, LM_SEEDS, preset=preset)]
            for norm in norms}


def deep_sizes(lab: Lab, depth_quick: int, depth_full: int) -> tuple[dict, dict]:
    train_fields = dict(preset="small", tokenizer="char", ckpt_every=0, schedule="cosine", diverge_factor=3.0)
    if lab.size == "tiny":
        train_fields.update(steps=6, batch_size=4, seq_len=16, eval_every=3, eval_batches=2)
        model = dict(d_model=16, n_layers=3, n_heads=2, max_seq_len=16, init="xavier")
    elif lab.quick:
        train_fields.update(steps=200, batch_size=8, seq_len=64, eval_every=50, eval_batches=4)
        model = dict(d_model=64, n_layers=depth_quick, n_heads=4, max_seq_len=64, init="xavier")
    else:
        train_fields.update(steps=1000, batch_size=16, seq_len=128, eval_every=100, eval_batches=10)
        model = dict(d_model=128, n_layers=depth_full, n_heads=4, max_seq_len=128, init="xavier")
    return train_fields, model


# ------------------------------------------------------------------------- helpers over measurements


def stats(values) -> dict:
    """mean, std (None with fewer than two values), min and max of the finite values."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else None,
            "min": min(v), "max": max(v), "n": len(v)}


def round_sig(x, digits=4):
    return None if x is None else float(f"{x:.{digits}g}")


def arm_losses(name: str, runs: list[dict], measured: dict) -> dict:
    """One arm's loss columns over its seeds (final validation loss: mean, std, min, max; seeds;
    diverged), recording its per-seed losses and diverged count in ``measured`` as <name>_val and
    <name>_diverged, the keys the claims read."""
    val = stats([r["val_loss"] for r in runs])
    diverged = sum(r["status"] == "diverged" for r in runs)
    measured[f"{name}_val"] = [r["val_loss"] for r in runs]
    measured[f"{name}_diverged"] = diverged
    return {"val_loss": round_sig(val["mean"]), "val_std": round_sig(val["std"], 2),
            "val_min": round_sig(val["min"]),
            "val_max": round_sig(val["max"]), "seeds": len(runs), "diverged": diverged}


def claim_values(measured: dict, *keys) -> dict:
    """The measured values a claim uses."""
    return {k: measured.get(k) for k in keys}


def parameters_of(runs) -> float | None:
    """The median non-embedding size of ``runs`` (run results); None while any has not trained."""
    sizes = [r.get("parameters") for r in runs]
    return statistics.median(sizes) if sizes and all(sizes) else None


def curves_of(run: dict) -> dict:
    return {"status": run["status"], "val_curve": run["val_curve"], "train_curve": run["train_curve"]}


def unigram_loss(tokens) -> float:
    """Cross-entropy (nats) of the token frequencies: the loss of a model that learned nothing else."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
