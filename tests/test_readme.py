"""The README's code runs as written, and its demo tables are the committed demo record's."""

import json
import re
from pathlib import Path

from normlab import report

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README should show a Python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})  # our own README, not data


def test_readme_demo_tables_match_the_demo_record():
    records = sorted((ROOT / "docs" / "results").glob("compare-demo-*/results.json"))
    assert len(records) == 1, f"one current demo record expected, found {records}"
    text = README.read_text()
    block = text[text.index(report.README_START) + len(report.README_START): text.index(report.README_END)]
    expected = report.readme_tables(json.loads(records[0].read_text()))
    assert block.strip() == expected.strip(), "README demo tables are stale: run python tools/readme_tables.py"
