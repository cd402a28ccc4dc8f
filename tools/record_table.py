"""Print a CPU bench record's table (docs/results/cpu-bench-*.md, short-rows-*.md) from its JSON,
so the md quotes what the run measured: a row per op the run timed, pass, dtype and shape.

    python tools/record_table.py docs/results/cpu-bench-epyc-avx512.json
"""

import argparse
import json

from normlab import bench_tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", help="a `normlab bench --json` file")
    args = parser.parse_args()
    with open(args.record) as f:
        print(bench_tables.record_table(json.load(f)["records"]))


if __name__ == "__main__":
    main()
