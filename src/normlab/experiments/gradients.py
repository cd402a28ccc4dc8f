"""Preset ``gradients``: gradient norms by layer at initialization, and how they scale with depth."""

from __future__ import annotations

import math
import statistics

import numpy as np
import torch

from normlab import claims as C
from normlab import data as D
from normlab.experiments.common import XIONG20, XIONG_MODEL, claim_values, round_sig
from normlab.experiments.lab import Lab
from normlab.model import Decoder, ModelConfig


def layer_grad_norms(cfg: ModelConfig, batches: list, seed: int) -> list[float]:
    """Per layer, the gradient norm of the MLP output weight at initialization, averaged over batches."""
    torch.manual_seed(seed)
    model = Decoder(cfg)
    total = np.zeros(cfg.n_layers)
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        total += np.array([g["mlp_out"] for g in model.grad_norms()])
    return (total / len(batches)).tolist()


def log_slope(norms: list[float]) -> float:
    """Least-squares slope of log(norm) against the layer index."""
    idx = np.arange(len(norms))
    return float(np.polyfit(idx, np.log(np.asarray(norms)), 1)[0])


# This decoder (LLaMA-style), with the same xavier init so that only the architecture differs.
LLAMA_MODEL = dict(norm="rmsnorm", mlp="swiglu", positions="rope", tie_embeddings=True, embed_scale=False,
                   init="xavier")
# Xiong's model with one factor taken from this decoder: which one changes the picture?
GRAD_SETTINGS = {"xiong": XIONG_MODEL, "llama": LLAMA_MODEL,
                 "xiong+rmsnorm": {**XIONG_MODEL, "norm": "rmsnorm"},
                 "xiong+swiglu": {**XIONG_MODEL, "mlp": "swiglu"},
                 "xiong+rope+tied": {**XIONG_MODEL, "positions": "rope", "tie_embeddings": True,
                                     "embed_scale": False}}
XIONG_CONDITIONS = [
    "matches: LayerNorm, a ReLU FFN (d_ff = 4d), learned positions, untied token embeddings ~ N(0, 1/d) "
    "scaled by sqrt(d), xavier init, a final LayerNorm only in Pre-LN",
    "matches: the gradient norm of each layer's FFN W2 at initialization, averaged over fixed batches",
    "differs: a decoder-only character-level LM on Shakespeare (Fig. 3: a 6-6 encoder-decoder for "
    "translation)",
    "differs: no biases in the linear layers; width d = 64 at quick size (the paper: 512)",
]
LLAMA_CONDITIONS = [
    "differs (this decoder, LLaMA-style): RMSNorm, a SwiGLU FFN, rotary positions, tied unscaled embeddings",
    "matches: xavier init, a final norm only in Pre-LN, the gradient norm of each layer's FFN W2 at "
    "initialization",
]


def preset_gradients(lab: Lab) -> dict:
    depths = lab.pick((6, 12, 24), (6, 12, 24), tiny=(2, 3))
    fig3_depth = depths[0]  # Fig. 3 is drawn for 6 layers
    seeds = lab.seeds(5, 5)
    n_batches = lab.pick(4, 16, tiny=2)
    width = lab.at_rung(lab.pick(dict(d_model=64, n_heads=4, max_seq_len=64),
                                 dict(d_model=256, n_heads=4, max_seq_len=128),
                                 tiny=dict(d_model=16, n_heads=2, max_seq_len=16)))
    B, T = lab.pick((8, 64), (16, 128), tiny=(4, 16))
    gen = D.Batches(lab.dataset.train, B, T, seed=2020)
    batches = [gen.next() for _ in range(n_batches)]
    cells = [(name, p, depth) for name in GRAD_SETTINGS for p in ("post", "pre") for depth in depths]

    def measure():
        return {f"{name}|{p}|{depth}": [layer_grad_norms(lab.model_config({**width, **GRAD_SETTINGS[name],
                                                                           "n_layers": depth,
                                                                          "placement": p}), batches, seed)
                                        for seed in seeds]
                for name, p, depth in cells}

    per_seed = lab.job("grad_norms_settings", {"cells": cells, "seeds": seeds, "batches": [n_batches, B, T],
                                               "model": width, "over": lab.model_over}, measure)
    rows, measured = [], {}
    for name, p, depth in cells:
        runs = per_seed[f"{name}|{p}|{depth}"]
        g = np.mean(runs, axis=0)
        growths = [math.exp(log_slope(r) * (depth - 1)) for r in runs]
        rows.append({"setting": name, "placement": p, "layers": depth, "first": round_sig(g[0]),
                     "last": round_sig(g[-1]),
                     "fitted_last_over_first": round_sig(statistics.fmean(growths), 3)})
        if depth == fig3_depth:
            measured[f"{name}_{p}_growth"] = growths
    for name in GRAD_SETTINGS:  # the last layer's W2 gradient against depth, one log-log slope per seed
        for p in ("post", "pre"):
            measured[f"{name}_{p}_last_slope"] = [
                float(np.polyfit(np.log(depths), np.log([per_seed[f"{name}|{p}|{d}"][i][-1] for d in depths]),
                                 1)[0])
                for i in range(len(seeds))]
    for row in rows:
        row["last_vs_depth_slope"] = round_sig(
            statistics.fmean(measured[f"{row['setting']}_{row['placement']}_last_slope"]), 3
        )
    band = C.ours("Fig. 3 gives no ratio; 1.5x from first to last layer (and 0.5-1.5 for 'flat') is the "
                  "lab's bound")
    slope_band = C.ours("+-0.25: halfway between the theorem's two rates, 0 (Post-LN) and -1/2 (Pre-LN)")
    claims = []
    for name, where, conditions in (("xiong", "Xiong et al.'s model", XIONG_CONDITIONS),
                                    ("llama", "this decoder (LLaMA-style)", LLAMA_CONDITIONS)):
        tag = "" if name == "xiong" else ".llama"
        # where a ladder places each claim: the model it measures (the depth-slope ones: the middle depth)
        at_fig3, at_middle = (lab.size_of({**width, **GRAD_SETTINGS[name], "n_layers": d})
                              for d in (fig3_depth, depths[len(depths) // 2]))
        claims += [
            C.claim(f"gradients.post_grows{tag}",
                    f"at initialization, Post-LN's gradient norm grows toward the last layers "
                    f"({where}, {fig3_depth} layers: fitted last/first ratio of W2's gradient norm >= 1.5)",
                    XIONG20 + ", Fig. 3",
                    claim_values(measured, f"{name}_post_growth"),
                    C.above(f"{name}_post_growth", 1.0, 0.5, origin=band), conditions, parameters=at_fig3),
            C.claim(f"gradients.pre_flat{tag}",
                    f"at initialization, Pre-LN's gradient norm is flat across layers ({where}, "
                    f"{fig3_depth} layers: fitted last/first ratio within 0.5-1.5)", XIONG20 + ", Fig. 3",
                    claim_values(measured, f"{name}_pre_growth"),
                    C.within(f"{name}_pre_growth", 1.0, 0.5, origin=band), conditions, parameters=at_fig3),
            C.claim(f"gradients.post_last_constant{tag}",
                    f"the last layer's W2 gradient of Post-LN stays about constant as depth grows ({where}, "
                    f"L = {', '.join(map(str, depths))}: log-log slope within 0 +- 0.25)",
                    XIONG20 + ", Theorem 1", claim_values(measured, f"{name}_post_last_slope"),
                    C.within(f"{name}_post_last_slope", 0, 0.25, origin=slope_band, absolute=True),
                    conditions, parameters=at_middle),
            C.claim(f"gradients.pre_last_scaling{tag}",
                    f"the last layer's W2 gradient of Pre-LN scales like L^-1/2 ({where}, "
                    f"L = {', '.join(map(str, depths))}: log-log slope within -0.5 +- 0.25)",
                    XIONG20 + ", Theorem 1",
                    claim_values(measured, f"{name}_pre_last_slope"),
                    C.within(f"{name}_pre_last_slope", -0.5, 0.25, origin=slope_band, absolute=True),
                    conditions, parameters=at_middle),
        ]
    return {
        "title": "Gradient norms by layer at initialization: Xiong et al.'s model and this decoder",
        "question": "Is Post-LN's gradient norm larger near the output at initialization and Pre-LN's flat "
                    "(Xiong et al., Fig. 3), and does the last layer's gradient scale with depth as their "
                    "Theorem 1 says?",
        "settings": {"model": {**width, **lab.model_over}, "settings": GRAD_SETTINGS, "depths": list(depths),
                     "seeds": seeds,
                     "batches": n_batches, "batch_size": B, "seq_len": T},
        "columns": ["setting", "placement", "layers", "first", "last", "fitted_last_over_first",
                    "last_vs_depth_slope"],
        "rows": rows, "claims": claims,
        "series": {"norms": {k: np.mean(v, axis=0).tolist() for k, v in per_seed.items()},
                   "depths": list(depths),
                   "slopes": {k: v for k, v in measured.items() if k.endswith("_last_slope")}},
        "notes": ["Gradient norm of each block's FFN output projection (W2) at initialization, averaged "
                  f"over {n_batches} fixed batches, then over {len(seeds)} seeds (every claim's interval is "
                  "over the seeds). 'xiong': the paper's model; 'llama': this decoder with the same xavier "
                  "init; 'xiong+...': the paper's model with one factor from this decoder. "
                  "last_vs_depth_slope: least squares of ln(last layer's norm) against ln(L).",
                  _factor_note(measured, fig3_depth)],
    }


def _factor_note(measured: dict, depth: int) -> str:
    """Which single factor moves Xiong's picture toward this decoder's the most."""
    base = {p: statistics.fmean(measured[f"xiong_{p}_growth"]) for p in ("post", "pre")}
    moves = {name: {p: statistics.fmean(measured[f"{name}_{p}_growth"]) for p in ("post", "pre")}
             for name in GRAD_SETTINGS if name.startswith("xiong+")}
    text = "; ".join(f"{name}: post {v['post']:.2f}, pre {v['pre']:.2f}" for name, v in moves.items())
    worst = max(moves, key=lambda n: sum(abs(math.log(moves[n][p] / base[p])) for p in base))
    return (f"Fitted last/first ratio at {depth} layers (mean over seeds), Xiong's model: post "
            f"{base['post']:.2f}, pre {base['pre']:.2f}; with one factor from this decoder: {text}. The "
            f"factor that moves it most: {worst}.")
