"""The size ladder's report (``normlab compare --ladder``): ladder.md and ladder.html, each trend
claim's gap at every rung and its verdict, and one plot per preset of those gaps against model size."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

from normlab import claims as C
from normlab.plots import pyplot
from normlab.report import CSS, md_safe, meta_lines, save_text, verdict_badge


def _trend_line(t: dict) -> str:
    """A trend claim's question and evidence in one line."""
    what = {"does not grow": f"the gap does not grow with scale (slope within +-{t['margin_per_decade']:.3g} "
                             "per decade)",
            "grows up": "the effect grows with scale (slope above 0)",
            "grows down": "the effect grows with scale (slope below 0)"}[t["question"]]
    fit = t["fit"]
    if fit is None:
        return (f"{what}: fewer than two rungs where the baseline trains, or fewer than three seed gaps: "
                f"{t['verdict']}")
    adjusted = "" if t.get("p_adjusted") in (None, t["p"]) else f", Holm-adjusted {t['p_adjusted']:.3g}"
    return (f"{what}: slope {fit['slope']:+.4f} ({t['units']}) per decade of parameters, 95% CI "
            f"{fit['lo']:+.4f} to {fit['hi']:+.4f} ({fit['n']} seed gaps, df {fit['df']}); p "
            f"{t['p']:.3g}{adjusted}: **{t['verdict']}**")


def _sizes_line(p: dict) -> str:
    """A preset's sizes: its median run's at each rung, or, where it trains no run, the models its
    claims measure (each trend's line then names its own)."""
    if all(p["parameters"]):
        return "Non-embedding parameters (the preset's median run): " + ", ".join(f"{n:,.0f}"
                                                                                for n in p["parameters"])
    return "Non-embedding parameters: the models each claim measures (named with its trend)"


def _own_sizes(t: dict, p: dict) -> str:
    """A trend's sizes where they are not the preset's median run's (a claim on another model)."""
    sizes = [r["parameters"] for r in t["rungs"]]
    return "" if sizes == p["parameters"] else (". At " + ", ".join(f"{n:,.0f}" for n in sizes)
                                                + " non-embedding parameters (its own runs or model).")


def _left_out(r: dict) -> str:
    """Why a rung is left out of a trend: its baseline did not train, or that is not decided (the
    precondition inconclusive; records from before the verdict was kept say the same)."""
    return ("the baseline did not train" if r.get("precondition_verdict") == C.FAILS
            else "the baseline's training not established")


def _rung_cell(r: dict, units: str) -> str:
    if r.get("precondition") is False:
        return f"left out: {_left_out(r)} ({r['verdict']})"
    if not r["ci"]:
        return f"- ({r['verdict'] or 'not run'})"
    if units == "log ratio":
        return f"{r['ci']['gap']:+.2%} [{r['ci']['gap_lo']:+.2%}, {r['ci']['gap_hi']:+.2%}] ({r['verdict']})"
    return f"{r['ci']['gap']:+.4g} [{r['ci']['gap_lo']:+.4g}, {r['ci']['gap_hi']:+.4g}] ({r['verdict']})"


def _piloted_on(how: str, condition: str) -> str:
    return how.replace("tuned (the design)", f"tuned in the design pilot on {condition}")


def _intro(ladder: dict) -> str:
    fam = ladder["family"]
    how = (f"Holm over the ladder's {fam['size']} trend tests at {fam['alpha']:.0%}"
           if fam["method"] == "holm"
           else "each trend alone, unadjusted")
    untrained = [n for n, p in ladder["presets"].items() if not all(p["parameters"])]
    return (f"Widths: d_model x {', '.join(f'{w:g}' for w in ladder['widths'])} of each preset's size; "
            f"tokens per parameter {ladder['tokens_per_parameter']}; learning rates: {ladder['lr_rule']}. "
            + (f"{', '.join(untrained)} train{'s' if len(untrained) == 1 else ''} no run: measured on the "
               "model at each width, so tokens and rates do not apply. " if untrained else "")
            + f"Trend verdicts: {how}; each rung's claims are judged as their own invocation's (rung0/, "
            "rung1/, rung2/: report.md and report.html each).")


def ladder_markdown(ladder: dict, images: list[str]) -> str:
    lines = ["# normlab size ladder", "", _intro(ladder), ""]
    tokenizers = ladder.get("tokenizers") or {}
    if len(tokenizers) > 1:
        lines += ["Tokenizer conditions, each claim's rows side by side and judged in one family: "
                  + ", ".join(f"{k} (vocabulary {v:,})" for k, v in tokenizers.items() if v)
                  + ". Each arm's rate at the middle rung, by condition: "
                  + "; ".join(f"{k}: {', '.join(_piloted_on(h, k) for h in v)}"
                              for k, v in (ladder.get("rates") or {}).items() if v)
                  + f". rung0-{list(tokenizers)[1]}/ and the like hold the other conditions' rung reports.",
                  ""]
    for name, p in ladder["presets"].items():
        lines += [f"## {name}", "", _sizes_line(p), ""]
        if not p["trends"]:
            lines += ["No claim of this preset has a per-seed gap to follow across the rungs.", ""]
            continue
        several = len(p.get("conditions", [])) > 1  # tokenizer conditions: each claim's rows side by side
        lines += ["| claim | " + ("tokens | " if several else "")
                  + " | ".join(f"rung {i} gap [95% CI] (verdict)" for i in range(len(p["parameters"])))
                  + " | trend |",
                  "|---|" + "---|" * (len(p["parameters"]) + several) + "---|"]
        for t in p["trends"]:
            cells = " | ".join(_rung_cell(r, t["units"]) for r in t["rungs"])
            lines.append(f"| {t['id']} | " + (f"{t.get('condition')} | " if several else "")
                         + f"{cells} | {t['verdict']} |")
        lines.append("")
        for t in p["trends"]:
            tokens = f" ({t.get('condition')} tokens)" if several else ""
            lines += [f"- **{t['id']}**{tokens} ({t['leaf']['a']} vs {t['leaf']['b']}): {_trend_line(t)}"
                      + _own_sizes(t, p)]
        lines.append("")
        lines += [f"![{name}](plots/{f})" for f in images if f == f"ladder-{name}.png"] + [""]
    return md_safe("\n".join(lines))


def render_ladder(ladder: dict, out: str | Path) -> dict[str, Path]:
    """ladder.md and one plot per preset (plots/ladder-<preset>.png) in ``out``."""
    plt = pyplot()
    out = Path(out)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    images = []
    for filename, fig in plot_ladder(ladder, plt).items():
        fig.savefig(out / "plots" / filename, dpi=110)
        plt.close(fig)
        images.append(filename)
    md = out / "ladder.md"
    save_text(md, ladder_markdown(ladder, images))
    page = out / "ladder.html"
    save_text(page, ladder_html(ladder, images, out))
    return {"markdown": md, "html": page, **{f: out / "plots" / f for f in images}}


def ladder_html(ladder: dict, images: list[str], out: Path) -> str:
    """ladder.md's content as one self-contained page (plots inlined), each trend's verdict as a
    badge, with links to the rung reports found beside it."""
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>normlab size ladder</title>"
             f"<style>{CSS}</style></head><body>", "<h1>normlab size ladder</h1>",
             f"<p>{e(_intro(ladder))}</p>"]
    if ladder.get("meta"):
        parts += [f"<p class='rule'>{e(line)}</p>" for line in meta_lines(ladder["meta"])]
    rungs = sorted(p.parent.name for p in out.glob("rung*/report.html"))
    if rungs:
        parts.append("<p>Each rung's report: " + ", ".join(f"<a href='{e(r)}/report.html'>{e(r)}</a>"
                                                          for r in rungs) + ".</p>")
    for name, p in ladder["presets"].items():
        parts += [f"<h2 id='{e(name)}'>{e(name)}</h2>", f"<p>{e(_sizes_line(p))}</p>"]
        if not p["trends"]:
            parts.append("<p>No claim of this preset has a per-seed gap to follow across the rungs.</p>")
            continue
        parts.append("<table><tr><th>claim</th><th>tokens</th>"
                     + "".join(f"<th>rung {i} gap [95% CI] (verdict)</th>"
                               for i in range(len(p["parameters"])))
                     + "<th>trend</th></tr>")
        for t in p["trends"]:
            parts.append(f"<tr><td>{e(t['id'])}<br><small>{e(t.get('text') or '')}</small></td>"
                         f"<td>{e(str(t.get('condition') or ''))}</td>"
                         + "".join(f"<td>{e(_rung_cell(r, t['units']))}</td>" for r in t["rungs"])
                         + f"<td>{verdict_badge(t['verdict'])}</td></tr>")
        parts.append("</table><ul>")
        parts += [f"<li><b>{e(t['id'])}</b> ({e(str(t['leaf']['a']))} vs {e(str(t['leaf']['b']))}): "
                  f"{e(_trend_line(t).replace('**', '') + _own_sizes(t, p))}</li>" for t in p["trends"]]
        parts.append("</ul>")
        for f in images:
            if f == f"ladder-{name}.png":
                data = base64.b64encode((out / "plots" / f).read_bytes()).decode()
                parts.append(f"<p><img alt='{e(f)}' src='data:image/png;base64,{data}'></p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def plot_ladder(ladder: dict, plt) -> dict:
    """One figure per preset of the size ladder: each trend claim's gap at every rung (the mean
    over seeds and its 95% interval) against non-embedding parameters on a log axis, with the
    fitted slope; a claim's tokenizer conditions share its panel, one colour each."""
    figures = {}
    for name, p in ladder["presets"].items():
        panels: dict[str, list[dict]] = {}
        for t in p["trends"]:
            panels.setdefault(t["id"], []).append(t)
        if not panels:
            continue
        cols = min(3, len(panels))
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
        for ax, (claim, trends) in zip(axes.flat, panels.items()):
            for i, t in enumerate(trends):
                _ladder_series(ax, t, f"C{2 * i}", t.get("condition") if len(trends) > 1 else None,
                               1.0 + 0.06 * (i - (len(trends) - 1) / 2))
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=6)
            ax.axhline(0, color="k", lw=0.5)
            if any(r["ci"] or r["gaps"] for t in trends for r in t["rungs"]):
                ax.set_xscale("log")
                # a tick at each rung, named by its size: within a decade or two matplotlib labels
                # its minor ticks and their labels overlap
                sizes = sorted({r["parameters"] for t in trends for r in t["rungs"]})
                ax.minorticks_off()
                ax.set_xticks(sizes, [_count(n) for n in sizes])
                ax.set_xlim(sizes[0] / 1.5, sizes[-1] * 1.5)
            else:
                ax.text(0.5, 0.5, "no rung gives a gap to plot", ha="center", transform=ax.transAxes,
                        fontsize=8)
            ax.set_title(f"{claim}: "
                         + ", ".join(f"{t['verdict']}" + (f" ({t['condition']})" if len(trends) > 1 else "")
                                      for t in trends), fontsize=8)
            ax.set_xlabel("non-embedding parameters")
            ax.set_ylabel(f"gap ({trends[0]['units']})\n{trends[0]['leaf']['a']} vs {trends[0]['leaf']['b']}",
                          fontsize=7)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle(f"{name}: each effect across the ladder (95% t intervals over seeds)", fontsize=10)
        fig.tight_layout()
        figures[f"ladder-{name}.png"] = fig
    return figures


def _count(n: float) -> str:
    """A parameter count as a tick label: 161k, 2.41M."""
    return f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n / 1e3:.3g}k"


def _ladder_series(ax, t: dict, colour: str, condition: str | None, nudge: float) -> None:
    """One trend's rungs (the interval, each seed's gap) and its fitted line; ``nudge`` shifts the
    points along x so that two conditions at one rung do not cover each other."""
    tag = f"{condition}: " if condition else ""
    xs = [r["parameters"] for r in t["rungs"] if r.get("precondition") is not False]
    labelled = set()  # one legend entry per reason, however many rungs share it
    for r in t["rungs"]:
        out = r.get("precondition") is False  # left out of the fit: its baseline's training not shown
        x = r["parameters"] * nudge
        label = f"{tag}left out: {_left_out(r)}" if out else None
        if r["ci"]:
            ax.errorbar([x], [r["ci"]["est"]],
                        yerr=[[r["ci"]["est"] - r["ci"]["lo"]], [r["ci"]["hi"] - r["ci"]["est"]]],
                        fmt="o", color="C7" if out else colour, mfc="none" if out else colour, capsize=3,
                        label=label if label not in labelled else None)
            labelled.add(label)
        ax.plot([x] * len(r["gaps"]), r["gaps"], ".", color="C7" if out else colour, alpha=0.4)
    if t["fit"]:
        f = t["fit"]
        ax.plot(xs, [f["intercept"] + f["slope"] * math.log10(x) for x in xs], "-", color=colour,
                label=f"{tag}slope {f['slope']:+.3f}/decade (95% CI {f['lo']:+.3f} to {f['hi']:+.3f})")
