"""Preset ``shallow``: Post-LN against Pre-LN at a shallow and at a deep depth.

The placement studies report that where Post-LN trains (shallow models, with warmup) it ends at a
better loss than Pre-LN, and that Pre-LN's advantage is stability as depth grows past about a
dozen layers. Both placements, both depths, the same steps, warmup and seeds.
"""

from __future__ import annotations

from normlab import claims as C
from normlab.experiments.common import (DIVERGED, XIONG20, XIONG_MODEL, curves_of, claim_values, round_sig,
                                        deep_sizes, parameters_of, stats, trains, unigram_loss)
from normlab.experiments.lab import Lab

LIU20 = ("Liu et al. (2020), Understanding the Difficulty of Training Transformers, EMNLP (Post-LN, when it "
         "trains, often performs better than Pre-LN; Pre-LN is more stable in depth); " + XIONG20)


def preset_shallow(lab: Lab) -> dict:
    depths = lab.pick((3, 12), (3, 18), tiny=(1, 3))
    train_fields, model = deep_sizes(lab, depths[0], depths[0])
    model = {**model, **XIONG_MODEL}
    lr = lab.pick(1e-3, 5e-4, tiny=1e-3)
    warmup = max(1, {**train_fields, **lab.train_over}["steps"] // 4)
    seeds = lab.seeds(3, 3)
    runs = {(p, depth): [lab.run(f"{p}-L{depth}-s{seed}", train_fields, model,
                                 {"placement": p, "n_layers": depth, "lr": lr, "min_lr": lr / 10,
                                  "warmup": warmup, "seed": seed},
                                 tune=True) for seed in seeds]
            for depth in depths for p in ("post", "pre")}
    rows, measured = [], {"unigram_loss": unigram_loss(lab.dataset.train)}
    for (p, depth), rs in runs.items():
        which = "shallow" if depth == depths[0] else "deep"
        measured[f"{p}_{which}_val"] = [r["val_loss"] for r in rs]
        measured[f"{p}_{which}_diverged"] = sum(r["status"] == "diverged" for r in rs)
        val = stats(measured[f"{p}_{which}_val"])
        rows.append({"placement": p, "layers": depth, "lr": lab.arm_lr(f"{p}-L{depth}"), "seeds": len(rs),
                     "diverged": measured[f"{p}_{which}_diverged"],
                     "val_loss": round_sig(val["mean"]), "val_std": round_sig(val["std"], 2)})
    warm_here = lab.sized_train(train_fields, model, {"warmup": warmup})["warmup"]  # a ladder rung scales it
    conditions = [
        "matches: Post-LN and Pre-LN in the original Transformer's pieces (LayerNorm, ReLU FFN, learned "
        f"positions), with warmup ({warm_here} steps), the same steps and seeds, at {depths[0]} and "
        f"{depths[1]} layers, each at its own learning rate (the best of a pilot grid on seeds the test runs "
        "do not use)",
        "differs: a decoder-only character LM on Shakespeare for a few hundred steps (the studies: 6-layer "
        "to 18-layer encoder-decoders for translation, trained to convergence)",
    ]
    # each claim's runs are of one depth: a ladder places it at their size, not at both depths' median
    size = {depth: parameters_of([r for (_, d), rs in runs.items() if d == depth for r in rs])
            for depth in depths}
    claims = [
        C.claim("shallow.post_better",
                f"at {depths[0]} layers, Post-LN ends at a lower validation loss than Pre-LN, where "
                "Post-LN trains", LIU20,
                claim_values(measured, "post_shallow_val", "pre_shallow_val", "unigram_loss"),
                C.given(trains("post_shallow_val"),
                        C.below("post_shallow_val", "pre_shallow_val", paired=True)),
                conditions, parameters=size[depths[0]]),
        C.claim("shallow.pre_deep",
                f"at {depths[1]} layers, Pre-LN is the better placement: Post-LN diverges or ends at a "
                "higher validation loss, where Pre-LN trains", LIU20,
                claim_values(measured, "post_deep_val", "pre_deep_val", "post_deep_diverged", "unigram_loss"),
                C.given(trains("pre_deep_val"),
                        C.any_of(C.at_least("post_deep_diverged", 1, point="a count of diverged seeds",
                                            origin=DIVERGED),
                                 C.above("post_deep_val", "pre_deep_val", paired=True))),
                conditions, parameters=size[depths[1]]),
    ]
    return {
        "title": f"Post-LN vs Pre-LN at {depths[0]} and {depths[1]} layers",
        "question": "Is Post-LN better when shallow and Pre-LN when deep?",
        "settings": {"train": {**train_fields, **lab.train_over, "lr": lr, "warmup": warmup},
                     "model": {**model, **lab.model_over},
                     "depths": list(depths), "seeds": seeds},
        "columns": ["placement", "layers", "lr", "seeds", "diverged", "val_loss", "val_std"],
        "rows": rows, "claims": claims,
        "series": {"runs": {f"{p}|{depth}": [curves_of(r) for r in rs] for (p, depth), rs in runs.items()}},
        "notes": [f"{len(seeds)} seeds per setting, cosine schedule after {warm_here} warmup steps. Unigram "
                  f"loss {measured['unigram_loss']:.3f}: a model that learned only character frequencies."],
    }
