"""Speed of the kernels a wheel ships for a portable level (tools/build_tiers.py) against the same
kernels compiled for this exact CPU, each as a fraction of a copy timed in the same run.

    python tools/tier_ab.py TIERS_DIR [--rounds 3] [--ops rms_norm,layer_norm] [--dtypes fp32,bf16]
                            [--shapes 4096x4096,8192x1024]

One process cannot hold both builds of a kernel, so this alternates `normlab bench` processes:
host, tier, tier, host, ... (the host build from numba's user cache with NORMLAB_CPU_TIERS=off;
the tier with an empty cache, so that every kernel comes from TIERS_DIR). It prints each case's
median fraction of copy for both and the tier's speed over the host's (median of the rounds'
ratios, with their range).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def bench(tiers: str, args, out: Path) -> dict:
    env = {**os.environ, "NORMLAB_CPU_TIERS": tiers}
    if tiers != "off":
        env["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="normlab-tier-")
    subprocess.run([sys.executable, "-m", "normlab", "bench", "--backends", "normlab", "--passes", "fwd,bwd",
                    "--ops", args.ops,
                    "--dtypes", args.dtypes, "--shapes", args.shapes, "--json", str(out), "--quiet"],
                   env=env, check=True, capture_output=True)
    records = json.loads(out.read_text())["records"]
    return {(r["op"], r["dtype"], r["shape"], r["pass"]): r["frac_of_copy"] for r in records
            if r["backend"] == "normlab"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tiers", help="the tiers folder (holds x86-64-v3/ and/or x86-64-v4/)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ops", default="rms_norm,layer_norm")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--shapes", default="4096x4096,8192x1024")
    args = parser.parse_args()
    host, tier = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = [("off", host), (args.tiers, tier)][:: 1 if r % 2 == 0 else -1]
            for setting, into in order:
                into.append(bench(setting, args, Path(tmp) / "bench.json"))
    print(f"{'case':<34} {'host (x copy)':>13} {'tier (x copy)':>13} {'tier / host':>18}")
    for case in host[0]:
        ratios = [t[case] / h[case] for h, t in zip(host, tier)]
        print(f"{' '.join(case):<34} {statistics.median(h[case] for h in host):>13.2f} "
              f"{statistics.median(t[case] for t in tier):>13.2f} "
              f"{statistics.median(ratios):>6.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
