"""The plots of ``normlab compare``: one function per preset, drawn from its section of
results.json alone (``PLOTS``: preset -> function(section, plt) -> {filename: figure})."""

from __future__ import annotations

NORM_COLOURS = {"layernorm": "C0", "rmsnorm": "C1", "prmsnorm": "C2", "batchnorm": "C3", "none": "C7",
                "l2": "C5", "scalenorm": "C6"}
PLACEMENT_COLOURS = {"post": "C3", "pre": "C0", "sandwich": "C2", "deepnorm": "C4", "deepnorm_article": "C5"}


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def band(values: list) -> tuple[float, float, float]:
    """(mean, lo, hi): the 95% t interval of the mean of the finite values (lo = hi = mean for
    fewer than two): what the curves over seeds shade, never their min-max."""
    import math

    from scipy import stats

    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    mean = sum(v) / len(v)
    if len(v) < 2:
        return mean, mean, mean
    half = stats.t.ppf(0.975, len(v) - 1) * stats.tstd(v) / math.sqrt(len(v))
    return mean, mean - half, mean + half


def _mean_curve(curves: list[dict], key: str) -> tuple[list, list, list, list]:
    """Mean over seeds of val loss at the steps all finished runs share, and its 95% t band."""
    done = [c["val_curve"] for c in curves if c["status"] != "diverged" and c["val_curve"]["step"]]
    if not done:
        return [], [], [], []
    n = min(len(c["step"]) for c in done)
    xs = [sum(c[key][i] for c in done) / len(done) for i in range(n)]
    bands = [band([c["loss"][i] for c in done]) for i in range(n)]
    return xs, [b[0] for b in bands], [b[1] for b in bands], [b[2] for b in bands]


def _n_text(curves_by_setting) -> str:
    """"n = 5 seeds" (or a range) over the settings' finished runs, for a plot's title."""
    ns = sorted({sum(c["status"] != "diverged" for c in cs) for cs in curves_by_setting})
    return f"n = {ns[0]}" if len(ns) == 1 else f"n = {ns[0]}-{ns[-1]}" if ns else "n = 0"


def plot_norms(section: dict, plt) -> dict:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    mixed = len(section.get("clocks", {}).get("runs", [])) > 1  # runs timed under different conditions
    if mixed:
        axes[1].text(0.5, 0.5, "left out: the runs were trained under\ndifferent machines, threads or loads\n"
                     "(see the report's note)", ha="center", va="center", transform=axes[1].transAxes)
    for norm, curves in section["series"]["runs"].items():
        for ax, key, label in ((axes[0], "step",
                                "step"),) + (() if mixed else ((axes[1], "time_s", "training time (s)"),)):
            xs, mean, lo, hi = _mean_curve(curves, key)
            if xs:
                ax.plot(xs, mean, label=norm, color=NORM_COLOURS.get(norm))
                ax.fill_between(xs, lo, hi, alpha=0.2, color=NORM_COLOURS.get(norm))
            ax.set_xlabel(label)
    axes[0].set_ylabel("validation loss")
    axes[0].set_title("per step")
    axes[1].set_title("per second of training")
    axes[0].legend()
    _trim_y(axes[0], section)
    fig.suptitle(f"Validation loss by norm (mean over seeds, band: 95% t interval; "
                 f"{_n_text(section['series']['runs'].values())} seeds)")
    fig.tight_layout()
    return {"norms_loss.png": fig}


def plot_scale(section: dict, plt) -> dict:
    """The scale preset's curves: the norms preset's plot of its three arms."""
    return {"scale_loss.png": plot_norms(section, plt)["norms_loss.png"]}


def _trim_y(ax, section):
    """Zoom in on the part of the curves where the norms differ (the first evaluations dwarf it)."""
    finals = [r["val_loss"] for r in section["rows"] if r.get("val_loss") is not None]
    if finals:
        lo, hi = min(finals), max(finals)
        ax.set_ylim(lo - 0.1 * (hi - lo + 0.1), hi + 1.0)


SWEEP_STYLES = {"post|warm": ("C3", "-"), "post|nowarm": ("C3", "--"), "pre|warm": ("C0", "-"),
                "pre|nowarm": ("C0", "--"),
                "pre|warm|qknorm": ("C2", "-"), "pre|warm|embednorm": ("C1", "-"),
                "pre|warm|sandwich": ("C4", "-")}


def plot_warmup(section: dict, plt) -> dict:
    curves = section["series"]["curves"]
    inits = [c["init"] for c in curves.values() if c["init"] is not None]
    top = sum(inits) / len(inits) if inits else max(v for c in curves.values() for vs in c["loss"] for v in vs
                                                    if v is not None)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    for key, c in curves.items():
        colour, style = SWEEP_STYLES.get(key, ("C7", "-"))
        means, los, his, bad = [], [], [], []
        for lr, losses in zip(c["lr"], c["loss"]):
            ok = [v for v in losses if v is not None]
            mean, lo, hi = band(ok) if ok else (top, top, top)  # a diverged point sits at the loss at init
            means.append(mean)
            los.append(lo)
            his.append(hi)
            if len(ok) < len(losses):
                bad.append((lr, means[-1]))
        ax.plot(c["lr"], means, style, marker="o", ms=3, color=colour, label=key.replace("|", ", "))
        ax.fill_between(c["lr"], los, his, color=colour, alpha=0.12)
        if bad:
            ax.scatter(*zip(*bad), marker="x", s=50, color=colour, zorder=3)
    ax.axhline(top, color="grey", lw=0.8, ls=":", label="loss at init")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate")
    n = max((len(v) for c in curves.values() for v in c["loss"]), default=0)
    ax.set_ylabel(f"final validation loss (mean of {n} seeds, 95% t band; x: a seed diverged)", fontsize=8)
    ax.set_title("Loss against learning rate")
    ax.legend(fontsize=8)
    ax = axes[1]
    logits = section["series"]["logits"]
    for key in ("pre|warm", "pre|warm|qknorm"):
        pts = sorted((float(k.rsplit("|", 1)[1]), sum(v) / len(v)) for k, v in logits.items()
                     if k.rsplit("|", 1)[0] == key)
        if pts:
            colour, style = SWEEP_STYLES[key]
            ax.plot(*zip(*pts), style, marker="o", ms=3, color=colour, label=key.replace("|", ", "))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("largest attention logit after training")
    ax.set_title("Attention logit growth, with and without qk-norm")
    ax.legend(fontsize=8)
    fig.suptitle(section["title"])
    fig.tight_layout()
    return {"warmup_sweep.png": fig}


def plot_gradients(section: dict, plt) -> dict:
    norms, depths = section["series"]["norms"], section["series"]["depths"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, p in zip(axes, ("post", "pre")):
        for i, depth in enumerate(depths):
            for setting, style in (("xiong", "-"), ("llama", "--")):
                g = norms.get(f"{setting}|{p}|{depth}")
                if g:
                    ax.plot(range(1, len(g) + 1), g, style, marker="o" if style == "-" else None, ms=3,
                            color=f"C{i}",
                            label=f"{depth} layers" if setting == "xiong" else None)
        ax.set_yscale("log")
        ax.set_title(f"{p}-LN: W2 gradient by layer")
        ax.set_xlabel("layer")
    axes[0].set_ylabel("grad norm of FFN W2 at init")
    axes[0].plot([], [], "k-", label="Xiong et al.'s model")
    axes[0].plot([], [], "k--", label="this decoder (LLaMA-style)")
    axes[0].legend(fontsize=8)
    ax = axes[2]
    for p, colour in (("post", "C3"), ("pre", "C0")):
        for setting, style in (("xiong", "-"), ("llama", "--")):
            last = [norms[f"{setting}|{p}|{d}"][-1] for d in depths if f"{setting}|{p}|{d}" in norms]
            if len(last) == len(depths):
                slopes = section["series"]["slopes"].get(f"{setting}_{p}_last_slope") or [float("nan")]
                ax.plot(depths, last, style, marker="o", ms=3, color=colour,
                        label=f"{p}, {setting}: slope {sum(slopes) / len(slopes):+.2f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.minorticks_off()
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("layers L")
    ax.set_title("last layer's W2 gradient vs depth\n(Theorem 1: slope 0 post, -1/2 pre)", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle("Gradient norms at initialization (solid: Xiong et al.'s model; dashed: this decoder)")
    fig.tight_layout()
    return {"gradients.png": fig}


def plot_depth(section: dict, plt) -> dict:
    fig, ax = plt.subplots(figsize=(7, 4))
    for p, r in section["series"]["runs"].items():
        c = r["train_curve"]
        label = p + (" (diverged)" if r["status"] == "diverged" else "")
        ax.plot(c["step"], c["loss"], color=PLACEMENT_COLOURS.get(p), label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.set_title(section["title"])
    fig.tight_layout()
    return {"depth.png": fig}


def plot_batchnorm(section: dict, plt) -> dict:
    rows = section["series"]["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = [r["norm"] for r in rows]
    floor = 1e-12
    for j, key in enumerate(("mates_change", "padding_change")):
        vals = [max(r[key] or 0.0, floor) for r in rows]
        axes[0].bar([i + (j - 0.5) * 0.38 for i in range(len(rows))], vals, width=0.38,
                    label=key.replace("_", " "))
    axes[0].set_yscale("log")
    axes[0].set_ylim(floor / 2, None)
    axes[0].set_xticks(range(len(rows)), names)
    axes[0].set_title("change of one sequence's logits (rel. to RMS; 1e-12: none)", fontsize=10)
    axes[0].legend(fontsize=8)
    trend, sizes = section["series"]["trend"], section["series"]["batch_sizes"]
    if not trend:  # the demo leaves the trend out
        for ax in axes[1:]:
            ax.set_axis_off()
        axes[1].text(0.5, 0.5, "batch-size trend: normlab compare batchnorm --quick", ha="center",
                     va="center")
    for ax, key, label in ((axes[1], "val", "final validation loss (eval mode)"),
                           (axes[2], "gap", "train/eval loss gap")):
        if not trend:
            break
        for norm in ("batchnorm", "layernorm"):
            pts = [(bs, [v for v in trend[f"{norm}|{bs}"][key] if v is not None]) for bs in sizes]
            pts = [(bs, v) for bs, v in pts if v]
            if pts:
                bands = [band(v) for _, v in pts]
                ax.plot([bs for bs, _ in pts], [b[0] for b in bands], marker="o", color=NORM_COLOURS[norm],
                        label=f"{norm} (n = {max(len(v) for _, v in pts)} seeds)")
                ax.fill_between([bs for bs, _ in pts], [b[1] for b in bands], [b[2] for b in bands],
                                color=NORM_COLOURS[norm], alpha=0.15)
            # the largest batch again, by accumulated micro-batches
            accum = section["series"].get("accumulation")
            vals = [v for v in trend.get(f"{norm}|{accum['key']}", {}).get(key, [])
                    if v is not None] if accum else []
            if vals:
                mean, lo, hi = band(vals)
                ax.errorbar([accum["batch"]], [mean], yerr=[[mean - lo], [hi - mean]], marker="x",
                            markersize=9, capsize=3,
                            linestyle="none", color=NORM_COLOURS[norm], label=f"{norm}, {accum['label']}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size (padded variable-length sequences)")
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("BatchNorm in a language model: batch dependence, and what small padded batches cost")
    fig.tight_layout()
    return {"batchnorm.png": fig}


def plot_precision(section: dict, plt) -> dict:
    errors, scales, eps = section["series"]["errors"], section["series"]["scales"], section["series"]["eps"]
    keys = list(errors)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), sharey=True)
    for ax, key in zip(axes, keys):
        op, dt = key.split("|")
        top = 1e4
        for i, (impl, errs) in enumerate(errors[key].items()):
            ys = [top if e is None else max(e / eps[dt], 1e-3) for e in errs]
            ax.plot(scales, ys, marker="o", ms=3, label=impl, color=f"C{i}")
            bad = [(s, top) for s, e in zip(scales, errs) if e is None]
            if bad:
                ax.scatter(*zip(*bad), marker="x", s=50, color="C3", zorder=3)
        ax.axhline(2, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{op} {dt}")
        ax.set_xlabel("activation scale")
    axes[0].set_ylabel("max error / machine eps (x: not finite)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Error against float64 as activations grow")
    fig.tight_layout()
    return {"precision.png": fig}


def plot_eps(section: dict, plt) -> dict:
    series = section["series"]
    scales, eps = series["scales"], series["eps"]
    # zero rows drawn left of the rest
    xs = [s if s > 0 else min(x for x in scales if x > 0) / 10 for s in scales]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for i, mode in enumerate(("inside", "outside")):
        ax.plot(xs, [r["gain"] for r in series["results"][f"{mode}|exact"]], marker="o", color=f"C{i}",
                label=f"eps {mode} (float64)")
        ax.plot(xs, [r["gain"] for r in series["results"][f"{mode}|normlab"]], ls="", marker="x", ms=8,
                color=f"C{i}",
                label=f"eps {mode} (normlab fp32)")
    ax.axhline(1 / eps ** 0.5, color="grey", lw=0.8, ls=":", label="1/sqrt(eps)")
    ax.axhline(1 / eps, color="grey", lw=0.8, ls="--", label="1/eps")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("row RMS (leftmost: all-zero rows)")
    ax.set_ylabel("largest ||dx|| / ||dy||")
    ax.set_title(f"RMSNorm's gradient gain, eps = {eps:g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return {"eps.png": fig}


def plot_stability(section: dict, plt) -> dict:
    series = section["series"]
    spreads, eps, mean = series["spreads"], series["eps"], series["mean"]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot(spreads, series["gains"]["layernorm"], marker="o", color="C0", label="LayerNorm (float64)")
    ax.plot(spreads, [1 / ((s * mean) ** 2 + eps) ** 0.5 for s in spreads], color="C0", ls=":",
            label="1/sqrt(s^2 + eps)")
    ax.plot(spreads, series["gains"]["rmsnorm"], marker="s", color="C1", label="RMSNorm (float64)")
    ax.axhline(1 / abs(mean), color="C1", lw=0.8, ls="--", label="1/|mean|")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.invert_xaxis()
    ax.set_xlabel(f"row spread s / mean (mean {mean:g})")
    ax.set_ylabel("largest ||dx|| / ||dy||")
    ax.set_title(f"input-gradient gain as the spread shrinks, eps = {eps:g}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return {"stability.png": fig}


def plot_speed(section: dict, plt) -> dict:
    recs = [r for r in section["series"]["records"] if r["op"] != "copy"]
    groups = sorted({(r["op"], r["pass"], r["dtype"]) for r in recs})
    backends = list(dict.fromkeys(r["backend"] for r in recs))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / max(1, len(backends))
    for j, b in enumerate(backends):
        vals = []
        for g in groups:
            sel = [r["frac_of_copy"] for r in recs if (r["op"], r["pass"], r["dtype"]) == g
                   and r["backend"] == b]
            vals.append(sum(sel) / len(sel) if sel else 0)
        axes[0].bar([i + (j - (len(backends) - 1) / 2) * width for i in range(len(groups))], vals,
                    width=width, label=b)
    axes[0].set_xticks(range(len(groups)), [f"{o}\n{p} {d}" for o, p, d in groups], fontsize=8)
    axes[0].axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[0].set_ylabel("fraction of copy bandwidth (mean over shapes)")
    axes[0].legend(fontsize=8)
    axes[0].set_title("kernels (allocating calls)")
    timing = section["series"]["timing"]
    labels = list(timing)
    axes[1].barh(range(len(labels)), [timing[k] for k in labels],
                 color=["C0" if k.endswith("normlab") else "C7" for k in labels])
    axes[1].set_yticks(range(len(labels)), [k.replace("|", " / ") for k in labels])
    axes[1].set_xlabel("ms per training step")
    axes[1].set_title("training step")
    fig.tight_layout()
    return {"speed.png": fig}


def plot_invariance(section: dict, plt) -> dict:
    exact, invariant = section["series"]["exact"], section["series"]["invariant"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.6, 1]})
    ax = axes[0]
    labels = [(where, name) for where in ("op", "model") for name in exact["layernorm"][where]]
    floor = 1e-17
    for j, norm in enumerate(exact):
        vals = [max(exact[norm][where][name], floor) for where, name in labels]
        bars = ax.bar([i + (j - 0.5) * 0.38 for i in range(len(labels))], vals, width=0.38, label=norm,
                      color=NORM_COLOURS.get(norm))
        for bar, (_, name) in zip(bars, labels):
            if name not in invariant[norm]:
                bar.set_hatch("//")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, 10)
    ax.set_xticks(range(len(labels)), [f"{name.replace('_', ' ')}\n({where})" for where, name in labels],
                  fontsize=8)
    ax.set_ylabel("relative change of the output (float64)")
    ax.set_title("exact: hatched = not invariant in theory", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    for key, curves in section["series"]["runs"].items():
        norm, noise = key.split("|")
        xs, mean, _, _ = _mean_curve(curves, "step")
        if xs:
            ax.plot(xs, mean, color=NORM_COLOURS.get(norm), ls="-" if noise == "0" else "--",
                    label=f"{norm}" + ("" if noise == "0" else f", shift noise {noise}"))
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (mean over seeds)")
    ax.set_title("training with re-centering noise in every norm's input", fontsize=10)
    ax.legend(fontsize=8)
    _trim_y(ax, {"rows": [r for r in section["rows"] if r.get("val_loss") is not None]})
    fig.suptitle("Invariance to re-centering and re-scaling: LayerNorm vs RMSNorm")
    fig.tight_layout()
    return {"invariance.png": fig}


def plot_final_norm(section: dict, plt) -> dict:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, curves in section["series"]["head_rms"].items():
        final, which = key.split("|")
        style = dict(color="C0" if final == "True" else "C3", ls="-" if which == "base" else "--")
        label = f"{'with' if final == 'True' else 'without'} final norm, {which} lr"
        for i, c in enumerate(curves):
            if c["step"]:
                axes[0].plot(c["step"], c["rms"], label=label if i == 0 else None, alpha=0.8, **style)
        xs, mean, _, _ = _mean_curve(section["series"]["runs"][key], "step")
        if xs:
            axes[1].plot(xs, mean, label=label, **style)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("RMS of the LM head's input")
    axes[0].set_title("what the LM head reads (each seed)", fontsize=10)
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("validation loss (mean over finished seeds, "
                       f"{_n_text(section['series']['runs'].values())})")
    axes[1].set_title("loss", fontsize=10)
    axes[1].legend(fontsize=8)
    _trim_y(axes[1], section)
    fig.suptitle("Pre-LN with and without the final norm")
    fig.tight_layout()
    return {"final_norm.png": fig}


def plot_shallow(section: dict, plt) -> dict:
    depths = section["settings"]["depths"]
    fig, axes = plt.subplots(1, len(depths), figsize=(5.5 * len(depths), 4), sharey=True)
    for ax, depth in zip(axes, depths):
        for p in ("post", "pre"):
            curves = section["series"]["runs"][f"{p}|{depth}"]
            xs, mean, lo, hi = _mean_curve(curves, "step")
            diverged = sum(c["status"] == "diverged" for c in curves)
            if xs:
                ax.plot(xs, mean, color=PLACEMENT_COLOURS[p],
                        label=p + (f" ({diverged} diverged)" if diverged else ""))
                ax.fill_between(xs, lo, hi, color=PLACEMENT_COLOURS[p], alpha=0.2)
        ax.set_title(f"{depth} layers", fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    axes[0].set_ylabel(f"validation loss (mean, 95% t band; {_n_text(section['series']['runs'].values())} "
                       "seeds)")
    _trim_y(axes[0], section)
    fig.suptitle("Post-LN vs Pre-LN, shallow and deep")
    fig.tight_layout()
    return {"shallow.png": fig}


def plot_sandwich(section: dict, plt) -> dict:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for p, per_seed in section["series"]["stream_rms"].items():
        for i, layers in enumerate(per_seed):
            axes[0].plot(range(1, len(layers) + 1), layers, marker="o", color=PLACEMENT_COLOURS.get(p),
                         label=p if i == 0 else None, alpha=0.8)
        for i, layers in enumerate(section["series"].get("stream_rms_at_init", {}).get(p, [])):
            axes[0].plot(range(1, len(layers) + 1), layers, ls="--", marker=".",
                         color=PLACEMENT_COLOURS.get(p),
                         label=f"{p}, before training" if i == 0 else None, alpha=0.6)
        xs, mean, lo, hi = _mean_curve(section["series"]["runs"][p], "step")
        if xs:
            axes[1].plot(xs, mean, color=PLACEMENT_COLOURS.get(p), label=p)
            axes[1].fill_between(xs, lo, hi, color=PLACEMENT_COLOURS.get(p), alpha=0.2)
    axes[0].set_xlabel("layer")
    axes[0].set_xticks(range(1, section["settings"]["model"]["n_layers"] + 1))
    axes[0].set_ylabel("residual stream RMS after the layer")
    axes[0].set_yscale("log")
    axes[0].set_title("after training and before it (dashed), each seed", fontsize=10)
    axes[0].legend(fontsize=8, ncol=2, loc="center right")  # between Pre-LN's trained and untrained lines
    axes[1].set_xlabel("step")
    axes[1].set_ylabel(f"validation loss (mean, 95% t band; {_n_text(section['series']['runs'].values())} "
                       "seeds)")
    axes[1].legend(fontsize=8)
    _trim_y(axes[1], section)
    fig.suptitle("Sandwich norms vs Pre-LN")
    fig.tight_layout()
    return {"sandwich.png": fig}


CURSE_COLOURS = {"pre": PLACEMENT_COLOURS["pre"], "post": PLACEMENT_COLOURS["post"], "lns": "C1"}


def plot_curse(section: dict, plt) -> dict:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm, per_layer in section["series"]["layers"].items():
        for ax, key in zip(axes, ("rise", "cos")):
            if per_layer[key]:
                ax.plot(range(1, len(per_layer[key]) + 1), per_layer[key], marker="o",
                        color=CURSE_COLOURS.get(arm), label=arm)
    n = section["settings"]["model"]["n_layers"]
    for ax, label in zip(axes, ("validation loss rise when the layer is skipped",
                                "cosine(block input, block output)")):
        ax.axvline(n // 2 + 0.5, color="grey", lw=0.8, ls=":")  # the halves the claims compare
        ax.set_xlabel("layer")
        ax.set_xticks(range(1, n + 1))
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[0].set_yscale("symlog", linthresh=1e-3)
    axes[0].set_title("each layer's contribution (mean over seeds)", fontsize=10)
    axes[1].set_title("how much each block turns the stream (1: not at all)", fontsize=10)
    fig.suptitle("The curse of depth: Pre-LN, Post-LN and LayerNorm Scaling (lns)")
    fig.tight_layout()
    return {"curse.png": fig}


def plot_dyt(section: dict, plt) -> dict:
    budgets = list(section["settings"]["budgets"])
    runs = section["series"]["runs"]
    fig, axes = plt.subplots(1, len(budgets) + 1, figsize=(5 * (len(budgets) + 1), 4))
    settings = list(dict.fromkeys(k.split("|")[0] for k in runs))
    pointwise = [x for x in settings if x.startswith(("dyt", "derf"))]
    colours = {**NORM_COLOURS, **{s: f"C{4 + i}" for i, s in enumerate(pointwise)}}
    for ax, budget in zip(axes, budgets):
        for setting in settings:
            xs, mean, lo, hi = _mean_curve(runs[f"{setting}|{budget}"], "step")
            if xs:
                ax.plot(xs, mean, color=colours.get(setting), label=setting)
                ax.fill_between(xs, lo, hi, color=colours.get(setting), alpha=0.15)
        tokens, passes = section["settings"]["budgets"][budget], section["settings"]["passes"][budget]
        ax.set_title(f"{budget} data: {tokens:,} tokens, {passes:.3g} passes", fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        _trim_y(ax, {"rows": [r for r in section["rows"] if r["budget"] == budget]})
    axes[0].set_ylabel(f"validation loss (mean, 95% t band; {_n_text(runs.values())} seeds)")
    ax = axes[-1]
    width = 0.8 / len(budgets)
    dyts = [s for s in settings if s.startswith("dyt")]
    for j, budget in enumerate(budgets):
        shares = [section["series"]["saturated"].get(f"{s}|{budget}") or [0.0] for s in dyts]
        ax.bar([i + (j - (len(budgets) - 1) / 2) * width for i in range(len(dyts))],
               [sum(v) / len(v) for v in shares],
               width=width, label=f"{budget} data")
    ax.set_xticks(range(len(dyts)), dyts)
    ax.set_ylabel("share of DyT inputs with |alpha x| > 2")
    ax.set_title("saturation after training (on training data)", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle("DyT and Derf against RMSNorm and LayerNorm")
    fig.tight_layout()
    return {"dyt.png": fig}


PLOTS = {"norms": plot_norms, "warmup": plot_warmup, "gradients": plot_gradients, "depth": plot_depth,
         "batchnorm": plot_batchnorm, "precision": plot_precision, "speed": plot_speed, "eps": plot_eps,
         "stability": plot_stability,
         "invariance": plot_invariance, "final-norm": plot_final_norm, "shallow": plot_shallow,
         "sandwich": plot_sandwich,
         "dyt": plot_dyt, "scale": plot_scale, "curse": plot_curse}
