"""Rewrite the README's demo tables from a demo's results.json (default: the committed record),
so the README quotes what a run measured rather than what somebody typed.

    python tools/readme_tables.py [docs/results/compare-demo-xeon-2core/results.json]
"""

import json
import sys
from pathlib import Path

from normlab import report

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else next((ROOT / "docs" / "results").glob("compare-demo-*/results.json"))
    readme = ROOT / "README.md"
    text = readme.read_text()
    start, end = text.index(report.README_START), text.index(report.README_END)
    tables = report.readme_tables(json.loads(src.read_text()))
    readme.write_text(text[: start + len(report.README_START)] + "\n" + tables + "\n" + text[end:])
    print(f"README tables rewritten from {src.relative_to(ROOT) if src.is_relative_to(ROOT) else src}")


if __name__ == "__main__":
    main()
