"""Preset ``depth``: DeepNorm keeps a deep Post-LN model trainable where Pre-LN trains, with
DeepNet's init and with the init as the article on LayerNorm vs RMSNorm writes it."""

from __future__ import annotations

from normlab import claims as C
from normlab.experiments.common import (
    DIVERGED,
    WANG22,
    XIONG_MODEL,
    curves_of,
    claim_values,
    round_sig,
    arm_losses,
    deep_sizes,
    stats,
    trains,
    unigram_loss,
)
from normlab.experiments.lab import Lab

DEPTH_CONDITIONS = [
    "matches (DeepNet): Post-LN, DeepNorm and Pre-LN at the same depth with LayerNorm; DeepNorm's "
    "decoder-only constants alpha = (2L)^(1/4), beta = (8L)^(-1/4) and its init (xavier, gain beta on v, o "
    "and the FFN)",
    "matches: a Pre-LN baseline that trains at this depth (a precondition: 10% below the unigram loss)",
    "matches: each placement at its own learning rate, the best of a pilot grid around 3e-3 (seeds the test "
    "runs do not use), so that no placement is judged at a rate chosen for another",
    "differs: no warmup, to stress the placements (DeepNet trains with warmup); a character LM of width 32 "
    "for a few hundred steps (DeepNet: translation, 100 to 1,000 layers, long training)",
]


ARTICLE_INIT = ("the article on LayerNorm vs RMSNorm (its summary of DeepNorm's init), after " + WANG22)
# arm -> (placement, DeepNorm's init)
ARMS = {"post": ("post", "deepnet"), "deepnorm": ("deepnorm", "deepnet"),
        "deepnorm_article": ("deepnorm", "article"),
        "pre": ("pre", "deepnet")}


def preset_depth(lab: Lab) -> dict:
    train_fields, model = deep_sizes(lab, 24, 64)
    model = {**model, **XIONG_MODEL,
             **lab.pick(dict(d_model=32, n_heads=2), dict(d_model=64, n_heads=4), tiny={"n_layers": 4})}
    train_fields = {**train_fields, **lab.pick(dict(steps=300, batch_size=8, eval_every=50), {}, tiny={})}
    # the pilot grid's centre: high for a model this deep without warmup; each arm then trains at its best
    lr = 3e-3
    seeds = lab.seeds(3, 3)
    runs, rows, measured = {}, [], {}
    # the ladder trains the arms its trend claims were planned for (the article's init came later)
    arms = {k: v for k, v in ARMS.items() if lab.s.rung is None or k != "deepnorm_article"}
    for arm, (placement, init) in arms.items():
        label = arm.replace("_", "-")
        rs = [lab.run(f"{label}-deep-s{seed}", train_fields, model,
                      {"placement": placement, "lr": lr, "min_lr": lr / 10, "warmup": 0, "seed": seed,
                       **({"deepnorm_init": init} if init != "deepnet" else {})}, tune=True)
              for seed in seeds]
        runs[arm] = rs[0]
        rows.append({"placement": placement, "init": init if placement == "deepnorm" else model["init"],
                     "lr": lab.arm_lr(f"{label}-deep"), "steps": min(r["steps"] for r in rs),
                     **arm_losses(arm, rs, measured),
                     "train_loss": round_sig(stats([r["train_loss"] for r in rs])["mean"])})
    measured["unigram_loss"] = unigram_loss(lab.dataset.train)
    layers = lab.model_over.get("n_layers", model["n_layers"])
    count = "a count of diverged seeds"
    clearly = C.ours("5% of the loss: DeepNet reports Post-LN failing outright at depth; 5% is well past "
                     "seed noise")
    claims = [
        C.claim("depth.post_fails",
                f"a deep Post-LN model ({layers} layers, no warmup) diverges or ends at least 5% worse than "
                "Pre-LN, where Pre-LN trains", WANG22,
                claim_values(measured, "post_val", "pre_val", "post_diverged", "unigram_loss"),
                C.given(trains("pre_val"),
                        C.any_of(C.at_least("post_diverged", 1, point=count, origin=DIVERGED),
                                 C.above("post_val", "pre_val", 0.05, origin=clearly, paired=True))),
                DEPTH_CONDITIONS),
        C.claim("depth.deepnorm_trains",
                "DeepNorm keeps the same Post-LN model trainable: it does not diverge and ends at most "
                "5% above Pre-LN, where Pre-LN trains", WANG22,
                claim_values(measured, "deepnorm_val", "pre_val", "deepnorm_diverged", "unigram_loss"),
                C.given(trains("pre_val"),
                        C.all_of(C.at_most("deepnorm_diverged", 0, point=count, origin=DIVERGED),
                                 C.at_most("deepnorm_val", "pre_val", 0.05, origin=clearly, paired=True))),
                DEPTH_CONDITIONS),
        *([C.claim("depth.deepnorm_article_trains",
                   "DeepNorm with the init as the article writes it (xavier, then the FFN's weights / "
                   "sqrt(L) and attention's W_V, W_out / sqrt(2L)) also keeps the Post-LN model trainable: "
                   "no divergence, at most 5% above Pre-LN, where Pre-LN trains", ARTICLE_INIT,
                   claim_values(measured, "deepnorm_article_val", "pre_val", "deepnorm_article_diverged",
                                "unigram_loss"),
                   C.given(trains("pre_val"),
                           C.all_of(C.at_most("deepnorm_article_diverged", 0, point=count, origin=DIVERGED),
                                    C.at_most("deepnorm_article_val", "pre_val", 0.05, origin=clearly,
                                              paired=True))),
                   DEPTH_CONDITIONS[1:]
                   + ["differs: the init of the article on LayerNorm vs RMSNorm, not DeepNet's; "
                      "alpha = (2L)^(1/4) as DeepNet's"])]
          if "deepnorm_article" in arms else []),
    ]
    return {
        "title": f"Depth: Post-LN vs DeepNorm vs Pre-LN at {layers} layers without warmup",
        "question": "Does DeepNorm keep a deep Post-LN model trainable?",
        "settings": {"train": {**train_fields, **lab.train_over, "lr": lr, "warmup": 0},
                     "model": {**model, **lab.model_over},
                     "seeds": seeds},
        "columns": ["placement", "init", "lr", "seeds", "diverged", "steps", "val_loss", "val_std",
                    "train_loss"],
        "rows": rows, "claims": claims, "series": {"runs": {k: curves_of(r) for k, r in runs.items()}},
        "notes": [f"{len(seeds)} seeds per placement, cosine schedule without warmup; curves: seed 0. "
                  f"Unigram loss {measured['unigram_loss']:.3f}: a model that learned only character "
                  "frequencies.",
                  "init: deepnet = xavier with gain (8L)^(-1/4) on W_V, W_out and the FFN (DeepNet); "
                  "article = xavier, then the FFN / sqrt(L) and W_V, W_out / sqrt(2L); xavier = every block "
                  "matrix xavier (Xiong et al.), the Post-LN and Pre-LN baselines'. The two DeepNorm claims "
                  "say which init keeps the model trainable."],
    }

