"""report.md read back as a reader reads it: every claim's Evidence lines agree with the claim's
verdict and with its rule, line by line (a reader who finds one wrong sentence stops trusting the
verdicts beside it)."""

import copy
import json
import re
from pathlib import Path

import pytest

from normlab import claims as C
from normlab import report

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
VERDICTS = ("does not hold", "inconclusive", "holds")
CLAIM = re.compile(r"^- \*\*(holds|does not hold|inconclusive)\*\*(?: \(alone: [a-z ]+\))?: (.*)")
ALTERNATIVES = re.compile(r"^one of (\d+) alternatives suffices \((.*): (holds|does not "
                          r"hold|inconclusive)\):$")
EXACT = re.compile(r"^(\S+): (\S+), must be (at most|at least) (\S+) \(exact;")
HOLM = re.compile(r"p (\S+) \((holds|does not hold|inconclusive) alone\)(?:, Holm-adjusted p (\S+))?: "
                  r"(holds|does not hold|inconclusive)$")


def outcome(line: str) -> str:
    for v in VERDICTS:
        if line.endswith(": " + v):
            return v
    raise AssertionError(f"an evidence line without its verdict: {line!r}")


def both(verdicts: list[str]) -> str:
    return "does not hold" if "does not hold" in verdicts else "holds" if all(v == "holds"
                                                                              for v in verdicts) \
        else "inconclusive"


def either(verdicts: list[str]) -> str:
    return "holds" if "holds" in verdicts else "does not hold" if all(v == "does not hold"
                                                                      for v in verdicts) \
        else "inconclusive"


def claim_blocks(text: str) -> list[tuple[str, str, list[str]]]:
    """(verdict, claim text, evidence lines) of every claim in a report.md."""
    blocks, current, in_evidence = [], None, False
    for line in text.splitlines():
        m = CLAIM.match(line)
        if m:
            current = (m.group(1), m.group(2), [])
            blocks.append(current)
            in_evidence = False
        elif current is None:
            continue
        elif line.startswith("  Evidence:"):
            in_evidence = True
            rest = line[len("  Evidence:"):].strip()
            if rest:
                current[2].append(rest)
        elif re.match(r"^  [A-Z][a-z]+:", line) or not line.startswith("  "):
            in_evidence = False
        elif in_evidence and line.startswith("  - "):
            current[2].append(line[4:].rstrip())
    return blocks


def check_leaf(line: str) -> list[str]:
    """What is wrong with one judged line: its final verdict against its plain one and its
    adjusted p, or an exact number against its bound."""
    problems = []
    verdict = outcome(line)
    m = HOLM.search(line)
    if m:
        plain, adjusted = m.group(2), m.group(3)
        want = plain if adjusted is None or float(adjusted) <= C.ALPHA else "inconclusive"
        if verdict != want:
            problems.append(f"says {verdict}, but alone it {plain} and its adjusted p is {adjusted}: {line}")
    m = EXACT.match(line)
    if m and m.group(2) not in ("None", "nan"):
        value, bound = float(m.group(2).rstrip(",")), float(m.group(4))
        ok = value <= bound if m.group(3) == "at most" else value >= bound
        if ok != (verdict == "holds"):
            problems.append(f"{value:g} {m.group(3)} {bound:g} is {ok}, but the line says {verdict}: {line}")
    return problems


def check_claim(verdict: str, evidence: list[str]) -> list[str]:
    """What is wrong with a claim's evidence, read as the report prints it (see claims.evaluate)."""
    problems, pre, rest = [], [], []
    for line in evidence:
        m = re.match(r"^precondition (holds|does not hold|inconclusive): (.*)$", line)
        (pre if m else rest).append((m.group(1), m.group(2)) if m else line)
    if pre:
        stated = {v for v, _ in pre}
        own = both([outcome(line) for _, line in pre])
        if len(stated) != 1 or stated.pop() != own:
            problems.append(f"the precondition is stated {sorted({v for v, _ in pre})}, its lines give {own}")
        problems += [p for _, line in pre for p in check_leaf(line)]
        if own != "holds":
            return problems + ([] if verdict == "inconclusive"
                               else [f"verdict {verdict} with a precondition that {own}"])
    parts, i = [], 0
    while i < len(rest):
        m = ALTERNATIVES.match(rest[i])
        if not m:
            problems += check_leaf(rest[i])
            parts.append(outcome(rest[i]))
            i += 1
            continue
        n = int(m.group(1))
        alts = rest[i + 1:i + 1 + n]
        if [a.split(":", 1)[0] for a in alts] != ["either"] + ["or"] * (n - 1):
            problems.append(f"alternatives not read as either/or: {alts}")
        alts = [a.split(": ", 1)[1] for a in alts]
        outcomes = [outcome(a) for a in alts]
        problems += [p for a in alts for p in check_leaf(a)]
        held = [C.ORDINALS[j] for j, v in enumerate(outcomes) if v == "holds"]
        named = re.findall(r"\b(" + "|".join(C.ORDINALS) + r")\b", m.group(2))
        if m.group(3) != either(outcomes) or named != held:
            problems.append(f"'{rest[i]}' over alternatives that {outcomes}")
        parts.append(m.group(3))
        i += 1 + n
    if parts and both(parts) != verdict:
        problems.append(f"verdict {verdict}, but its evidence gives {both(parts)}: {parts}")
    return problems


def rejudged(path: Path) -> dict:
    """A record's results judged again by today's code (the evidence a fresh run would write),
    each section in the family it was judged in."""
    results = json.loads(path.read_text())
    families: dict[tuple, list[dict]] = {}
    for section in results["presets"].values():
        family = section.get("family") or {}
        families.setdefault((family.get("method"), tuple(family.get("p_values") or ())), []).append(section)
    for (method, _), sections in families.items():
        C.familywise(sections, per_claim=method != "holm")
    return results


@pytest.mark.parametrize("record", ["compare-demo-epyc-avx512", "compare-all-quick-epyc-avx2"])
def test_every_evidence_line_agrees_with_its_verdict_and_rule(record, tmp_path):
    results = rejudged(RESULTS / record / "results.json")
    text = report.markdown(results, {})
    blocks = claim_blocks(text)
    assert len(blocks) == sum(len(s["claims"]) for s in results["presets"].values())
    problems = [f"{claim[:60]}: {p}" for verdict, claim, evidence in blocks
                for p in check_claim(verdict, evidence)]
    assert not problems, "\n".join(problems)
    # the OR claims are read
    assert any("alternatives suffices" in line for _, _, ev in blocks for line in ev)


def test_the_reader_catches_evidence_that_contradicts_its_verdict():
    # the check must be able to fail: a verdict flipped, an adjusted p ignored, an OR misnamed
    ev = ["precondition holds: a vs u: gap -30% (95% CI -31% to -29%, 5 seeds), must be at least 10% below; "
          "p 1e-06 (holds alone), Holm-adjusted p 1e-05: holds",
          "one of 2 alternatives suffices (the first holds: holds):",
          "either: d: 2, must be at least 1 (exact; a count; not a sampled test): holds",
          "or: n vs l: gap +19% (95% CI +11% to +28%, 3 pairs of seeds), must be at least 2% above; p 0.011 "
          "(holds alone), Holm-adjusted p 0.11: inconclusive"]
    assert check_claim("holds", ev) == []
    assert check_claim("does not hold", ev)
    wrong_p = copy.copy(ev)
    wrong_p[3] = wrong_p[3].replace(": inconclusive", ": holds")
    assert check_claim("holds", wrong_p)
    misnamed = copy.copy(ev)
    misnamed[1] = "one of 2 alternatives suffices (the second holds: holds):"
    assert check_claim("holds", misnamed)
    wrong_exact = copy.copy(ev)
    wrong_exact[2] = "either: d: 0, must be at least 1 (exact; a count; not a sampled test): holds"
    assert check_claim("holds", wrong_exact)


def test_the_step_time_expectation_says_whether_the_measurement_fits_it():
    # issue 42: "can be at most about 0.1% faster" printed beside a measured -4.7%, without a word
    from normlab.experiments.norms import expected_step

    ln = [30.0, 31.0, 29.0, 30.5]
    far = expected_step(0.001, 0.3, [v * 0.953 for v in ln], ln)
    assert "at most 0.1%" in far and "Measured: 4.7% faster" in far and "is not the norms'" in far
    near = expected_step(0.09, 0.33, [v * 0.99 for v in ln], ln)
    assert "Measured: 1.0% faster" in near and "within what the norms' share allows" in near
    slower = expected_step(0.09, 0.33, [v * 1.02 for v in ln], ln)
    assert "Measured: 2.0% slower" in slower and "the slower one" in slower


def test_runs_trained_under_mixed_conditions_are_said_at_the_top_and_not_plotted_per_second(tmp_path):
    # issue 42: the header said torch_threads 1 while some runs used 2, and the per-second plot
    # compared runs timed under different thread counts
    results = rejudged(RESULTS / "compare-demo-epyc-avx512" / "results.json")
    one, two = {"processor": "AMD EPYC", "threads": 1}, {"processor": "AMD EPYC", "threads": 2}
    for section in results["presets"].values():
        section["clocks"] = {"runs": [one], "timings": [two]}
    text = report.markdown(results, {})
    # one for the runs: nothing to say
    assert "Mixed conditions" not in text and "different conditions" not in text
    results["presets"]["norms"]["clocks"]["runs"] = [one, two]
    text = report.markdown(results, {})
    top = text.split("| preset | claim |")[0]
    assert ("Mixed conditions: the training runs of norms were trained under 2 (AMD EPYC, 1 thread; "
            "AMD EPYC, 2 threads)") in top
    assert "(the collecting process's)" in top
    html_text = report.html_page(results, {}, tmp_path)
    assert "Mixed conditions" in html_text
    from normlab.plots import plot_norms

    plt = report.pyplot()
    fig = plot_norms(results["presets"]["norms"], plt)["norms_loss.png"]
    per_second = fig.axes[1]
    assert not per_second.lines and "left out" in per_second.texts[0].get_text()
    results["presets"]["norms"]["clocks"]["runs"] = [one]
    assert plot_norms(results["presets"]["norms"], plt)["norms_loss.png"].axes[1].lines
    plt.close("all")
