"""The README's code runs as written, and every figure it quotes comes from a current record."""

import importlib.util
import json
import re
from pathlib import Path

from normlab import bench_tables

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"


def _tool():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "tools" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README should show a Python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})  # our own README, not data


def test_readme_generated_blocks_match_the_records():
    text = README.read_text()
    for (start, end), expected in _tool().blocks().items():
        block = text[text.index(start) + len(start): text.index(end)]
        assert block.strip() == expected.strip(), (f"README block {start} is stale: "
                                                   "run python tools/readme_tables.py")


def test_cpu_bench_records_tables_are_their_json():
    # A record's md quotes its run (tools/record_table.py prints the table); records made before
    # that table's layout (no "into out=" column) are left as they were written. The short-row
    # records are bench runs too.
    checked = 0
    for md in sorted([*RESULTS.glob("cpu-bench-*.md"), *RESULTS.glob("short-rows-*.md")]):
        text = md.read_text()
        if bench_tables.RECORD_HEADER not in text:
            continue
        records = json.loads(md.with_suffix(".json").read_text())["records"]
        assert bench_tables.record_table(records) in text, (
            f"{md.name}: its table differs from its JSON (tools/record_table.py)"
        )
        checked += 1
    assert checked, "no CPU bench record in the current layout"


MACHINE = r"-(xeon|epyc|h100|h200|a100)(-\w+)?$"


def test_one_current_record_per_subject_and_machine():
    # A record is named <subject>-<machine>, updated in place (git keeps its history): a dated or
    # lettered series, or a second file of one subject and machine, is a superseded record left behind.
    for path in RESULTS.iterdir():
        name = re.sub(r"\.(json|md)$", "", path.name)
        assert re.search(MACHINE, name) and not re.search(r"\d{4}-\d\d-\d\d",
                                                          name), f"{path.name}: not <subject>-<machine>"
        pages = [path / "README.md", path / "report.md"] if path.is_dir() else [RESULTS / f"{name}.md"]
        assert any(p.exists()
                   for p in pages), f"{path.name}: a record needs a page that says what, where and how"
        text = "".join(p.read_text() for p in pages if p.exists())
        assert re.search(r"git [0-9a-f]{7}", text) and re.search(r"(?i)command", text), (
            f"{path.name}: name the commit and command"
        )


DURATION = r"\d+ min \d+ s|\d+(?:\.\d+)? (?:minutes|min|s)\b"


def test_readme_demo_time_is_stated_once():
    text = README.read_text()
    on_demo = [(line, re.findall(DURATION, line)) for line in text.splitlines() if "demo" in line.lower()]
    on_demo += [(line, re.findall(DURATION, line)) for line in text.splitlines()
                if line.startswith("It took")]
    times = {t for _, found in on_demo for t in found}
    assert len(times) == 1, f"the demo's time should be stated once, found {sorted(times)}"
    (time,) = times
    assert text.count(time) == 1, f"{time} appears more than once"
    (record,) = RESULTS.glob("compare-demo-*/README.md")
    assert time in record.read_text(), f"{time} is not in the demo record"


def test_readme_speedups_lie_in_the_records():
    text = README.read_text()
    runs = {p: json.loads(p.read_text()) for p in RESULTS.glob("cpu-bench-*.json")}
    kept = [run for run in runs.values() if run.get("method", {}).get("freed_memory") == "kept"]
    ranges = [bench_tables.speedup_range(run["records"], "rms_norm") for run in runs.values()
              if run not in kept]
    lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)  # over every machine's record
    quoted = re.search(r"(\d+)-(\d+)x faster than `F\.rms_norm`", text)
    assert quoted, "the introduction should quote rms_norm's speedup over F.rms_norm"
    assert (quoted[1], quoted[2]) == (f"{lo:.0f}", f"{hi:.0f}"), (quoted[0], lo, hi)
    assert kept, "no CPU bench record with freed memory kept"
    intro = " ".join(text[:text.index("## ")].split())
    for run in kept:  # each machine measured with freed memory kept, named in the introduction
        lo, hi = bench_tables.speedup_range(run["records"], "rms_norm")
        assert re.search(rf"\b{lo:.0f}-{hi:.0f}x on the (?:Xeon|Zen \d)\b", intro), (lo, hi)
    assert "with freed memory kept" in intro
    rows = json.loads(next(RESULTS.glob("hf-speed-*.json")).read_text())["rows"]
    quoted = re.search(r"(\d\.\d\d)-(\d\.\d\d)x faster patched", text)
    assert quoted, "the transformers section should quote the patched speedup"
    speedups = [r["speedup"] for r in rows]
    assert (float(quoted[1]), float(quoted[2])) == (round(min(speedups), 2),
                                                    round(max(speedups), 2)), quoted[0]
    decode = [r["speedup"] for r in json.loads(next(RESULTS.glob("hf-speed-*.json")).read_text())["decode"]]
    quoted = re.search(r"the patched models run at\s+(\d\.\d\d)-(\d\.\d\d)x the unpatched speed", text)
    assert quoted, "the transformers section should quote the patched models' decoding speed"
    assert (float(quoted[1]), float(quoted[2])) == (round(min(decode), 2), round(max(decode), 2)), quoted[0]


def test_readme_short_rows_lie_in_their_record():
    text = " ".join(README.read_text().split())
    records = json.loads((RESULTS / "short-rows-xeon-2core.json").read_text())["records"]
    ms = {(r["op"], r["pass"], r["dtype"], r["shape"], r["backend"]): r["ms"] for r in records
          if r["alloc"] == "alloc"}

    def peer_over_normlab(op, peer, short):  # > 1: normlab is faster
        return [ms[k] / ms[(*k[:4], "normlab")] for k in ms
                if k[0] == op and k[4] == peer and (int(k[3].split("x")[1]) < 256) == short]

    slowest = 1 / min(peer_over_normlab("rms_norm", "compile", short=True))
    assert f"torch.compile of the reference is up to {slowest:.1f}x faster than normlab's rms_norm" in text
    slowest = 1 / min(peer_over_normlab("layer_norm", "compile", short=True))
    if slowest > 1:
        assert f"up to {slowest:.1f}x faster than normlab's layer_norm" in text
    else:
        assert "normlab's layer_norm is faster than torch.compile at every length" in text
    slowest = 1 / min(peer_over_normlab("layer_norm", "torch", short=True))
    if slowest > 1:
        assert f"`F.layer_norm` up to {slowest:.1f}x faster than normlab's layer_norm" in text
    else:
        assert "`F.layer_norm` is slower than normlab's layer_norm in every case of the record" in text
    for op, peer in [("rms_norm", "compile"), ("layer_norm", "torch"), ("layer_norm", "compile")]:
        assert min(peer_over_normlab(op, peer, short=False)) > 1, "from 256 features on normlab leads"
    every_length = [r for short in (True, False) for r in peer_over_normlab("rms_norm", "torch", short)]
    assert min(every_length) > 1, "F.rms_norm is slower at every length"


def test_readme_zen4_short_rows_lie_in_their_record():
    text = " ".join(README.read_text().split())
    records = json.loads((RESULTS / "short-rows-epyc-zen4.json").read_text())["records"]
    ms = {(r["op"], r["pass"], r["dtype"], r["shape"], r["backend"]): r["ms"] for r in records
          if r["alloc"] == "alloc"}

    def peer_over_normlab(op, peer):  # > 1: normlab is faster
        return [ms[k] / ms[(*k[:4], "normlab")] for k in ms if k[0] == op and k[4] == peer]

    compiled = peer_over_normlab("rms_norm", "compile") + peer_over_normlab("layer_norm", "compile")
    assert min(compiled) > 1, "normlab leads torch.compile at every length"
    assert min(peer_over_normlab("layer_norm", "torch")) > 1, "and F.layer_norm in every case"
    case = ("rms_norm", "fwd", "bf16", "262144x64")
    lead = ms[(*case, "compile")] / ms[(*case, "normlab")]
    assert f"every length (rms_norm's bf16 forward at 64 features by {lead:.1f}x)" in text
    assert "`F.layer_norm` in every case of the record" in text
    for op in ("dyt", "derf"):
        ratios = peer_over_normlab(op, "compile")
        assert f"{min(ratios):.2f}-{max(ratios):.2f}x" in text, (op, min(ratios), max(ratios))


def test_readme_links_stay_inside_the_repository():
    text = README.read_text()
    assert "../" not in text, "the README refers to a path outside the repository"
    for target in re.findall(r"\]\(([^)#]+)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path = (ROOT / target).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"broken or outside link: {target}"
