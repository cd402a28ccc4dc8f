#!/usr/bin/env bash
# What a user gets from `pip install normlab`: build the sdist and the wheel, install the wheel
# without extras into a clean virtual environment (no system site packages), and check that the
# fused CPU kernels are there and that `auto` picks them. CI runs this after the tests.
#   bash tools/check_wheel.sh            (PYTHON: the interpreter that builds; default .venv's)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip install -q build
"$py" -m build -q --outdir "$tmp/dist" . > "$tmp/build.log" 2>&1 || { tail -30 "$tmp/build.log"; exit 1; }
ls "$tmp/dist"
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q torch==2.13.0  # the CPU build; an unpinned torch may pull a CUDA one
"$tmp/venv/bin/python" -m pip install -q "$tmp"/dist/normlab-*.whl
"$tmp/venv/bin/normlab" info
"$tmp/venv/bin/python" - <<'PY'
import torch
from normlab import kernels
reason = kernels.unavailable_reason("cpu")
assert reason is None, f"the wheel installed without a working cpu backend: {reason}"
assert kernels.resolve("auto", torch.device("cpu")) == "cpu", "auto does not pick the fused CPU kernels"
print("wheel check: the cpu backend is available and auto picks it")
PY

# The release wheel (tools/build_wheel.sh) with a small tier (rms_norm fp32 for x86-64-v3, where
# this CPU runs it): installed in a fresh venv with an empty numba cache, the first call loads the
# shipped kernels and compiles nothing.
if PYTHONPATH=src "$py" -c 'import sys; from llvmlite import binding as b; from normlab.kernels.cpu.cache import TIERS
f = b.get_host_cpu_features(); sys.exit(not all(f.get(x, False) for x in TIERS["x86-64-v3"]))'; then
  cp -r src/normlab/kernels/cpu/tiers "$tmp/kept-tiers" 2>/dev/null || true  # a checkout's full tiers, put back after
  # another machine's level in the checkout (an ARM64 build's) stays out of this wheel and in place
  other="src/normlab/kernels/cpu/tiers/aarch64/normlab-$(PYTHONPATH=src "$py" -c 'from normlab.kernels.cpu.cache import sources_hash; print(sources_hash())')"
  mkdir -p "$other" && touch "$other/kept"
  TIER_ARGS="--tiers x86-64-v3 --ops rms_norm --dtypes fp32" PYTHON="$py" bash tools/build_wheel.sh "$tmp/release" > "$tmp/release.log" 2>&1 \
    || { tail -30 "$tmp/release.log"; exit 1; }
  [ -f "$other/kept" ] || { echo "build_wheel.sh did not put the aarch64 level back" >&2; exit 1; }
  "$py" - "$tmp"/release/normlab-*.whl <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert not [n for n in names if "/tiers/aarch64/" in n], "the x86-64 release wheel holds the aarch64 level"
assert [n for n in names if "/tiers/x86-64-v3/" in n], "the x86-64 release wheel lacks its x86-64-v3 level"
assert sys.argv[1].endswith("manylinux_2_28_x86_64.whl"), sys.argv[1]
PY
  rm -rf src/normlab/kernels/cpu/tiers
  [ -d "$tmp/kept-tiers" ] && mv "$tmp/kept-tiers" src/normlab/kernels/cpu/tiers
  "$tmp/venv/bin/python" -m pip install -q --force-reinstall --no-deps "$tmp"/release/normlab-*.whl
  # the installed wheel's normlab (tier_check.py takes the checkout's only where none is installed)
  "$tmp/venv/bin/python" tools/tier_check.py --ops rms_norm --dtypes fp32 \
    || { echo "the release wheel's kernels were compiled, not loaded" >&2; exit 1; }
fi
