"""The HTML / Markdown report of ``normlab compare`` and its plots (normlab.plots), rendered from
results.json alone (``normlab report DIR`` redraws them without rerunning anything)."""

from __future__ import annotations

import base64
import csv
import html
import io
import re
from pathlib import Path

from normlab.plots import PLOTS, pyplot

VERDICT_COLOURS = {"holds": "#1a7f37", "does not hold": "#cf222e", "inconclusive": "#9a6700"}


def render(results: dict, out: str | Path) -> dict[str, Path]:
    """Write the PNG plots, report.md and report.html into ``out``; returns their paths. Every
    verdict is judged again from its numbers first: a file whose verdicts do not follow is refused."""
    from normlab.claims import recheck

    bad = recheck(results)
    if bad:
        raise ValueError("results.json holds verdicts that its numbers and rules do not give "
                         f"({', '.join(bad)}); rerun the preset instead of editing the file")
    plt = pyplot()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    images: dict[str, list[str]] = {}
    for name, section in results["presets"].items():
        images[name] = []
        for filename, fig in PLOTS[name](section, plt).items():
            fig.savefig(out / filename, dpi=110)
            plt.close(fig)
            images[name].append(filename)
    md = out / "report.md"
    save_text(md, markdown(results, images))
    page = out / "report.html"
    save_text(page, html_page(results, images, out))
    tables = write_tables(results, out)
    return {"markdown": md, "html": page, **tables, **{f: out / f for fs in images.values() for f in fs}}


# ------------------------------------------------------------------------------------- text


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0 or (1e-3 <= abs(v) < 1e5):
            return f"{v:.4g}"
        return f"{v:.2e}"
    return str(v)


def _setting(v) -> str:
    """A setting's value as a reader would write it: lists as items (long runs of seeds shortened),
    a dict as "key value" pairs, a dict of dicts as "key: pairs; ..."."""
    if isinstance(v, dict):
        nested = any(isinstance(x, dict) for x in v.values())
        return ("; " if nested else ", ").join(f"{k}{':' if isinstance(x, dict) else ''} {_setting(x)}"
                                               for k, x in v.items())
    if isinstance(v, list):
        if len(v) > 6 and all(isinstance(x, int) for x in v) and v == list(range(v[0], v[0] + len(v))):
            return f"{v[0]} to {v[-1]} ({len(v)})"
        return ", ".join(_setting(x) for x in v)
    return _fmt(v)


def settings_rows(section: dict) -> list[tuple[str, str]]:
    """(setting, value) rows of a section's settings, one per top-level key; first, where its runs
    were resized (a ladder rung, the gpu size), the sizes they trained at, which the preset's own
    fields below do not show."""
    rows = [(str(k), _setting(v)) for k, v in section["settings"].items()]
    sized = sized_text(section)
    if not sized:
        return rows
    return [("trained at", sized + "; the rows below are the preset's own size") if section.get("trained_at")
            else ("measured at", sized)] + rows


def sized_sentence(section: dict) -> str | None:
    """:func:`sized_text` as the report's sentence: trained runs, or a measurement's model."""
    sized = sized_text(section)
    return sized and f"{'Trained' if section.get('trained_at') else 'Measured'} at {sized}."


def sized_text(section: dict) -> str | None:
    """Where a section's runs were resized: its ladder rung and the sizes they trained at (a preset
    that trains no run measures at the rung's width: its settings show that model)."""
    at = section.get("trained_at")
    rung = section.get("rung")
    if not at:
        return (f"ladder rung {rung['index']} (d_model x{rung['width']:g} of the preset's): the model in the "
                "settings is the rung's") if rung else None
    sizes = "; ".join(", ".join(f"{k} {_fmt(v)}" for k, v in a.items()) for a in at)
    return (f"ladder rung {rung['index']} (d_model x{rung['width']:g} of the preset's): {sizes}" if rung
            else sizes)


def clock_text(clock: dict) -> str:
    """One measuring condition (env.clock) in words."""
    return (f"{clock.get('processor')}, {clock.get('threads')} "
            f"thread{'s' if clock.get('threads') != 1 else ''}"
            + (f", {clock['gpu']}" if clock.get("gpu") else "")
            + (", under load (steps slowed 5x)" if clock.get("loaded") else ""))


def clock_lines(results: dict) -> list[str]:
    """Mixed measuring conditions, said at the top: training runs of one section trained under
    different machines, thread counts or loads (their tokens/s and per-second curves do not compare,
    so those curves are left out), or sections trained under different ones."""
    runs = {name: s.get("clocks", {}).get("runs", []) for name, s in results["presets"].items()}
    mixed = {name: c for name, c in runs.items() if len(c) > 1}
    every = {clock_text(c) for cs in runs.values() for c in cs}
    lines = []
    if mixed:
        lines.append("Mixed conditions: the training runs of " + "; of ".join(
            f"{name} were trained under {len(c)} ({'; '.join(clock_text(x) for x in c)})"
            for name, c in mixed.items())
            + ". Their tokens/s, run_step_ms and per-second curves do not compare across those conditions: "
            "the per-second curves are left out. Timing claims are not among them: each is measured in one "
            "process, keyed by machine and thread count.")
    elif len(every) > 1:
        lines.append(f"The sections' training runs were trained under {len(every)} conditions "
                     f"({'; '.join(sorted(every))}), each section under one: compare run times within a "
                     "section, not across sections.")
    return lines


def meta_lines(meta: dict) -> list[str]:
    keys = ("date", "processor", "cpus", "torch_threads", "gpu", "python", "torch", "numba", "triton",
            "normlab", "git")
    meta = (
        {**meta, "torch_threads": f"{meta['torch_threads']} (the collecting process's)"}
        if meta.get("torch_threads")
        else meta
    )
    env = ", ".join(f"{k} {meta[k]}" for k in keys if meta.get(k) is not None)
    seeds = f"{meta['seeds']}" if meta.get("seeds") else "each preset default"
    if meta.get("seed_start"):
        seeds += f", from seed {meta['seed_start']} (fresh seeds)"
    return [f"Machine and versions: {env}.",
            f"Command: `{meta.get('command') or 'normlab compare'}` ({meta.get('size', 'full')} sizes; "
            f"seeds: {seeds}; data: {meta.get('data')}; overrides: "
            f"{meta.get('overrides') or 'none'})."]


def family_lines(results: dict) -> list[str]:
    """How the verdicts were judged: one line per family (one compare invocation each)."""
    groups: dict[tuple, list[str]] = {}
    for name, section in results["presets"].items():
        f = section.get("family") or {"method": "none", "size": None}
        groups.setdefault((f.get("method"), f.get("size"), tuple(f.get("p_values") or ())), []).append(name)
    lines = []
    for (method, size, _), names in groups.items():
        where = ", ".join(names)
        if method == "holm":
            lines.append(f"Verdicts ({where}) are family-wise: the {size} sampled tests of one `normlab "
                         "compare` invocation are judged together by Holm's step-down, so the chance of any "
                         "wrong conclusive verdict among them is at most 5%. Beside each verdict: the claim "
                         "judged alone (its plain 95% interval).")
        else:
            lines.append(f"Verdicts ({where}) are per claim, UNADJUSTED for the number of claims "
                         "(`--per-claim`): each is right with 95% confidence alone, but among many some "
                         "will be wrong by chance.")
    return lines


def _counts_text(counts: dict[str, int]) -> str:
    """"3 hold, 1 does not hold, 2 inconclusive"."""
    h, f = counts["holds"], counts["does not hold"]
    return (f"{h} {'holds' if h == 1 else 'hold'}, {f} {'does not hold' if f == 1 else 'do not hold'}, "
            f"{counts['inconclusive']} inconclusive")


def verdict_counts(results: dict) -> dict[str, int]:
    counts = {"holds": 0, "does not hold": 0, "inconclusive": 0}
    for section in results["presets"].values():
        for c in section["claims"]:
            counts[c["verdict"]] += 1
    return counts


def _measured_text(measured: dict) -> str:
    def one(v):
        return "[" + ", ".join(_fmt(x) for x in v) + "]" if isinstance(v, list) else _fmt(v)

    return ", ".join(f"{k} = {one(v)}" for k, v in measured.items())


def _claim_lines(c: dict) -> list[tuple[str, list[str]]]:
    """What the report prints under a claim: (label, lines)."""
    parts = [("Rule", [c["rule_text"]]), ("Evidence", c.get("evidence", [])),
             ("Thresholds", c.get("origins", [])), ("Conditions", c.get("conditions", [])),
             ("Measured", [_measured_text(c["measured"])])]
    return [(label, lines) for label, lines in parts if lines]


NOT_REPRODUCED = ("Not every claim reproduced here. 'inconclusive' means the test could not decide at the "
                  "family-wise level: its interval straddles the claim's margin, or its p-value, adjusted "
                  "for the other tests of the invocation, is above 5%; the evidence above gives both, and "
                  "the verdict of the claim alone.")


def md_safe(text: str) -> str:
    """Markdown with no raw HTML from the results: a "<" that would open a tag (or a comment) is
    written as &lt;, so a claim text cannot inject markup into report.md (report.html escapes
    everything). A "<" before a digit or a space, as in "p < 0.001", stays."""
    return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text)


def markdown(results: dict, images: dict[str, list[str]]) -> str:
    meta = results.get("meta", {})
    lines = ["# normlab compare: report", ""] + [f"{line}  " for line in meta_lines(meta)] + [""]
    counts = verdict_counts(results)
    lines += [f"Claims: {_counts_text(counts)} "
              "at this scale. Verdicts are computed from the measured numbers by the stated rule.", ""]
    lines += [f"{line}  " for line in family_lines(results) + clock_lines(results)] + [""]
    lines += ["| preset | claim | verdict | alone (95%) |", "|---|---|---|---|"]
    for name, section in results["presets"].items():
        for c in section["claims"]:
            lines.append(f"| {name} | {c['claim']} | **{c['verdict']}** | "
                         f"{c.get('verdict_plain', c['verdict'])} |")
    lines.append("")
    for name, section in results["presets"].items():
        lines += [f"## {name}: {section['title']}", "", f"*{section['question']}*", ""]
        if section.get("meta"):
            lines += [f"Measured by `{section['meta'].get('command')}` on {section['meta'].get('date')} "
                      f"(git {section['meta'].get('git')}, "
                      f"data sha256 {section['meta'].get('data_sha256')}).", ""]
        sized = sized_sentence(section)
        if sized:
            lines += [sized, ""]
        cols = section["columns"]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for row in section["rows"]:
            lines.append("| " + " | ".join(_fmt(row.get(c)) for c in cols) + " |")
        lines.append("")
        for c in section["claims"]:
            alone = c.get("verdict_plain", c["verdict"])
            lines.append(f"- **{c['verdict']}**{_alone(c)}: {c['claim']} ({c['source']}).  "
                         if alone != c["verdict"]
                         else f"- **{c['verdict']}**: {c['claim']} ({c['source']}).  ")
            for label, items in _claim_lines(c):
                lines += (
                    [f"  {label}: {items[0]}  "]
                    if len(items) == 1
                    else [f"  {label}:  "] + [f"  - {x}" for x in items]
                )
        if any(c["verdict"] != "holds" for c in section["claims"]):
            lines.append(f"- {NOT_REPRODUCED} ({section.get('size', 'full')} sizes)")
        lines.append("")
        for note in section.get("notes", []):
            lines += [f"> {note}", ""]
        for img in images.get(name, []):
            lines += [f"![{name}]({img})", ""]
        lines += ["| setting | value |", "|---|---|",
                  *(f"| {k} | {v} |" for k, v in settings_rows(section)),
                  "", f"Compute time {section.get('seconds', 0):.0f} s.", ""]
    return md_safe("\n".join(lines))


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#1f2328;
line-height:1.45}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
td,th{border:1px solid #d0d7de;padding:.25em .6em;text-align:right}
th{background:#f6f8fa}.warn{background:#fff8c5;padding:.4em .6em;border-left:3px solid #d4a72c}
td:first-child,th:first-child{text-align:left}.settings td{text-align:left}img{max-width:100%}
.verdict{font-weight:600;padding:.05em .4em;border-radius:.3em;color:#fff;white-space:nowrap}
.claim{margin:.5em 0 .8em}.claim ul{margin:.1em 0 .2em;padding-left:1.4em}
.rule,.measured{font-size:.85em;color:#57606a}
.note{font-size:.88em;color:#57606a;border-left:3px solid #d0d7de;padding-left:.7em}
code{font-size:.85em;background:#f6f8fa;padding:.1em .3em}"""


def verdict_badge(verdict: str) -> str:
    colour = VERDICT_COLOURS[verdict]
    return f'<span class="verdict" style="background:{colour}">{html.escape(verdict)}</span>'


def html_page(results: dict, images: dict[str, list[str]], folder: Path) -> str:
    e = html.escape
    meta = results.get("meta", {})
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>normlab compare "
             f"report</title><style>{CSS}</style></head><body>",
             "<h1>normlab compare: report</h1>"]
    parts += [f"<p>{e(line)}</p>" for line in meta_lines(meta)]
    counts = verdict_counts(results)
    parts.append(f"<p>Claims: {_counts_text(counts)} at this scale. Every verdict is computed from the "
                 "measured numbers by the rule shown with it.</p>")
    parts += [f"<p>{e(line)}</p>" for line in family_lines(results)]
    parts += [f"<p class='warn'>{e(line)}</p>" for line in clock_lines(results)]
    parts.append("<table><tr><th>preset</th><th>claim</th><th>verdict</th><th>alone (95%)</th></tr>")
    for name, section in results["presets"].items():
        for c in section["claims"]:
            parts.append(f"<tr><td>{e(name)}</td><td "
                         f"style='text-align:left'>{e(c['claim'])}</td><td>{verdict_badge(c['verdict'])}</td>"
                         f"<td>{e(c.get('verdict_plain', c['verdict']))}</td></tr>")
    parts.append("</table>")
    for name, section in results["presets"].items():
        parts += [f"<h2 id='{e(name)}'>{e(name)}: {e(section['title'])}</h2>",
                  f"<p><em>{e(section['question'])}</em></p>"]
        if section.get("meta"):
            m = section["meta"]
            parts.append(f"<p class='rule'>Measured by <code>{e(str(m.get('command')))}</code> on "
                         f"{e(str(m.get('date')))} (git {e(str(m.get('git')))}, data sha256 "
                         f"{e(str(m.get('data_sha256')))}).</p>")
        sized = sized_sentence(section)
        if sized:
            parts.append(f"<p class='rule'>{e(sized)}</p>")
        cols = section["columns"]
        parts.append("<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in cols) + "</tr>")
        for row in section["rows"]:
            parts.append("<tr>" + "".join(f"<td>{e(_fmt(row.get(c)))}</td>" for c in cols) + "</tr>")
        parts.append("</table>")
        for c in section["claims"]:
            body = "".join(f"<div class='rule'>{e(label)}:<ul>" + "".join(f"<li>{e(x)}</li>" for x in items)
                           + "</ul></div>"
                           for label, items in _claim_lines(c))
            parts.append(f"<div class='claim'>{verdict_badge(c['verdict'])}{e(_alone(c))} {e(c['claim'])} "
                         f"<span class='rule'>({e(c['source'])})</span>{body}</div>")
        if any(c["verdict"] != "holds" for c in section["claims"]):
            parts.append(f"<p class='note'>{e(NOT_REPRODUCED)}</p>")
        for note in section.get("notes", []):
            parts.append(f"<p class='note'>{e(note)}</p>")
        for img in images.get(name, []):
            data = base64.b64encode((folder / img).read_bytes()).decode()
            parts.append(f"<p><img alt='{e(img)}' src='data:image/png;base64,{data}'></p>")
        rows = "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>"
                       for k, v in settings_rows(section))
        parts.append(f"<table class='settings'><tr><th>setting</th><th>value</th></tr>{rows}</table>"
                     f"<p class='rule'>Compute time {section.get('seconds', 0):.0f} s.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _alone(c: dict) -> str:
    """" (alone: holds)" where the claim judged alone reads differently from its family-wise verdict."""
    alone = c.get("verdict_plain", c["verdict"])
    return f" (alone: {alone})" if alone != c["verdict"] else ""


# ------------------------------------------------------------------ tables others can reuse


def write_tables(results: dict, out: Path) -> dict[str, Path]:
    """results.csv (tidy: one measured sample per row), claims.csv (one row per leaf test of each
    claim) and report.tex (a booktabs table of the claims)."""
    from normlab.claims import leaf_rows

    paths = {"results_csv": out / "results.csv", "claims_csv": out / "claims.csv", "tex": out / "report.tex"}
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["preset", "quantity", "over", "sample", "value"])
    for name, section in results["presets"].items():
        seen = set()
        for c in section["claims"]:
            overs = _overs(c["rule"])
            for key, value in c["measured"].items():
                if key in seen:
                    continue
                seen.add(key)
                values = value if isinstance(value, list) else [value]
                seeds = section.get("settings", {}).get("seeds")
                for i, v in enumerate(values):
                    over = overs.get(key, "seeds" if isinstance(value, list) else "exact")
                    sample = (
                        seeds[i]
                        if over == "seeds" and isinstance(seeds, list) and len(seeds) == len(values)
                        else i
                    )
                    w.writerow([name, key, over, sample, "" if v is None else repr(float(v))])
    save_text(paths["results_csv"], buf.getvalue())
    buf = io.StringIO()
    w = csv.writer(buf)
    cols = ["preset", "claim", "verdict", "verdict_alone", "family", "family_size", "a", "b", "kind",
            "margin", "test",
            "n", "gap", "ci95_lo", "ci95_hi", "p", "p_adjusted", "leaf_verdict", "leaf_verdict_alone"]
    w.writerow(cols)
    for name, section in results["presets"].items():
        family = section.get("family") or {}
        for c in section["claims"]:
            for r in leaf_rows(c["rule"], c["measured"], family):
                w.writerow([name, c["id"], c["verdict"], c.get("verdict_plain", c["verdict"]),
                            family.get("method", "none"),
                            family.get("size", ""), r["a"], r["b"], r["kind"], r["margin"], r["test"],
                            _csv(r["n"]),
                            _csv(r["gap"]), _csv(r["ci_lo"]), _csv(r["ci_hi"]), _csv(r["p"]),
                            _csv(r["p_adjusted"]),
                            r["verdict"], r["verdict_plain"]])
    save_text(paths["claims_csv"], buf.getvalue())
    save_text(paths["tex"], latex_table(results))
    return paths


def save_text(path: Path, text: str) -> None:
    """Crash- and full-disk-safe: the previous file stays until the new one is whole."""
    from normlab.runs import write_atomic

    write_atomic(path, lambda tmp: tmp.write_bytes(text.encode()))


def _csv(v) -> str:
    return "" if v is None else repr(v) if isinstance(v, float) else str(v)


def _overs(rule: dict) -> dict[str, str]:
    """What each key's samples are drawn over, from the rule's leaves."""
    if rule["kind"] == "given":
        return {**_overs(rule["if"]), **_overs(rule["then"])}
    if rule["kind"] in ("all", "any"):
        return {k: v for r in rule["rules"] for k, v in _overs(r).items()}
    over = "exact" if rule.get("point") else rule.get("over", "seeds")
    return {k: over for k in (rule["a"], rule["b"]) if isinstance(k, str)}


_TEX = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
        "}": r"\}",
        "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def tex_escape(text: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in str(text))


def latex_table(results: dict) -> str:
    """A booktabs table of every claim: preset, claim, verdict (family-wise) and verdict alone."""
    lines = ["% normlab compare: the claims (needs \\usepackage{booktabs} and \\usepackage{longtable})",
             "\\begin{longtable}{@{}llp{0.5\\linewidth}ll@{}}", "\\toprule",
             "preset & claim & statement & verdict & alone (95\\%) \\\\", "\\midrule", "\\endhead"]
    for name, section in results["presets"].items():
        for c in section["claims"]:
            lines.append(" & ".join(tex_escape(x) for x in (name, c["id"], c["claim"], c["verdict"],
                                                            c.get("verdict_plain", c["verdict"]))) + " \\\\")
    family = " ".join(tex_escape(x) for x in family_lines(results))
    lines += ["\\bottomrule", f"\\caption{{{family}}}", "\\end{longtable}", ""]
    return "\n".join(lines)


def load(folder: str | Path, name: str = "results.json") -> dict:
    """A compare's results file (``name``: a ladder rung's is results-rung<i>.json) in ``folder``."""
    path = Path(folder) / name
    if not path.exists():
        raise FileNotFoundError(f"no {name} in {folder}; run `normlab compare PRESET --out {folder}` "
                                "first")
    from normlab.runs import read_json

    results = read_json(path)
    unknown = sorted(set(results.get("presets", {})) - set(PLOTS)) if isinstance(results, dict) else ["?"]
    if not isinstance(results, dict) or "presets" not in results or unknown:
        raise ValueError(f"{path} is not a results file of this normlab "
                         f"({'presets ' + ', '.join(unknown) if unknown else 'no presets'}); rerun the "
                         "presets with normlab compare to write it again")
    return results


# ------------------------------------------------------------------------------ README tables

README_START = "<!-- demo tables: generated by tools/readme_tables.py -->"
README_END = "<!-- end of demo tables -->"


def _short(line: str) -> str:
    """An evidence line without its trailing verdict."""
    return line.rsplit(": ", 1)[0]


def readme_tables(results: dict) -> str:
    """The README's demo tables (norms, then every claim with its verdict and interval), from a
    demo's results.json: regenerated by tools/readme_tables.py, checked by tests/test_readme.py."""
    norms = results["presets"]["norms"]
    n = len(norms["settings"]["seeds"])
    lines = [f"| norm (Pre-LN) | learning rate | final val loss (mean ± std, {n} seeds) | step ms | vs "
             "LayerNorm |",
             "|---|---|---|---|---|"]
    for r in norms["rows"]:
        lines.append(f"| {r['norm']} | {_fmt(r.get('lr'))} | {r['val_loss']:.3f} ± {r['val_std']:.3f} | "
                     f"{r['step_ms']:.1f} | {r['step_vs_layernorm']:.2f} |")
    family = norms.get("family") or {}
    how = (f"family-wise (Holm, {family['size']} tests)" if family.get("method") == "holm"
           else "per claim, unadjusted")
    lines += ["", f"| claim | verdict here, {how} | alone (95%) | the numbers behind it |",
              "|---|---|---|---|"]
    for section in results["presets"].values():
        for c in section["claims"]:
            ev = [_short(x) for x in c["evidence"]]
            more = f"; {len(ev) - 2} more in the report" if len(ev) > 2 else ""
            lines.append(f"| {c['claim']} | {c['verdict']} | {c.get('verdict_plain', c['verdict'])} | "
                         f"{'; '.join(ev[:2])}{more} |")
    return "\n".join(lines)
