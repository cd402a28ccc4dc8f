"""Rewrite the README's generated blocks from the committed records, so the README quotes what a
run measured rather than what somebody typed: the demo tables (from the demo record's
results.json) and the speed summary (from each machine's CPU bench record's JSON).

    python tools/readme_tables.py
"""

import json
from pathlib import Path

from normlab import bench_tables, report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def only(pattern: str) -> Path:
    """The one current record matching ``pattern`` under docs/results."""
    found = sorted(RESULTS.glob(pattern))
    if len(found) != 1:
        raise SystemExit(f"one current record {pattern} expected in docs/results, found "
                         f"{[str(p) for p in found]}")
    return found[0]


def machine(record: Path) -> str | None:
    """What a bench record's page calls its machine: its title after the colon ("2 cores of an AMD
    EPYC (Zen 4, AVX-512)"). A VM gives three AMD generations one processor name."""
    page = record.with_suffix(".md")
    title = page.read_text().splitlines()[0] if page.exists() else ""
    return title.split(": ", 1)[1].strip() if title.startswith("# ") and ": " in title else None


def blocks() -> dict[tuple[str, str], str]:
    """Each generated block's (start marker, end marker) -> its text, from the records."""
    demo = only("compare-demo-*/results.json")
    # one record per machine, and beside it, where one was made, its run with freed memory kept
    speeds = sorted(p for p in RESULTS.glob("cpu-bench-*.json") if not p.name.startswith(KEPT))
    return {
        (report.README_START, report.README_END): report.readme_tables(json.loads(demo.read_text())),
        (bench_tables.README_START, bench_tables.README_END): "\n\n".join(
            bench_tables.readme_summary(
                json.loads(p.read_text()), p.relative_to(ROOT).as_posix(), machine=machine(p), kept=kept(p)
            )
            for p in speeds
        ),
    }


KEPT = "cpu-bench-kept-"  # + the machine: a run with --keep-freed-memory


def kept(record: Path) -> tuple[dict, str] | None:
    """The run of ``record``'s machine with --keep-freed-memory, if one was made."""
    path = record.with_name(KEPT + record.name.removeprefix("cpu-bench-"))
    if not path.exists():
        return None
    run = json.loads(path.read_text())
    if run.get("method", {}).get("freed_memory") != "kept":
        raise SystemExit(f"{path} was not run with --keep-freed-memory")
    return run, path.relative_to(ROOT).as_posix()


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    for (start, end), body in blocks().items():
        a, b = text.index(start), text.index(end)
        text = text[: a + len(start)] + "\n" + body + "\n" + text[b:]
    readme.write_text(text)
    print("README's generated blocks rewritten from docs/results")


if __name__ == "__main__":
    main()
