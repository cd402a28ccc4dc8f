#!/usr/bin/env bash
# The release wheel: the fused CPU kernels compiled ahead of time for x86-64-v3 (AVX2), x86-64-v3-zen
# (AMD's AVX2 CPUs), x86-64-v4 (AVX-512) and x86-64-v4-bf16 (tools/build_tiers.py), so that a fresh install's first call loads them
# instead of compiling for 5-30 s. numba's cache is tied to the numba and Python versions that
# wrote it, so the wheel is tagged for this Python and x86-64 Linux (it holds no shared library:
# the kernels are object code that numba links itself). Run once per Python version.
#   bash tools/build_wheel.sh [OUTDIR]      (PYTHON: the interpreter; default .venv's)
# TIER_ARGS: arguments for build_tiers.py (CI's check builds a small one: "--ops rms_norm --dtypes fp32").
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
out="${1:-dist}"
"$py" -m pip install -q build wheel
hash="$(PYTHONPATH=src "$py" -c 'from normlab.kernels.cpu.cache import sources_hash; print(sources_hash())')"
if [ -n "${REUSE_TIERS:-}" ] && ls -d src/normlab/kernels/cpu/tiers/x86-64-v*/normlab-"$hash" > /dev/null 2>&1; then
  echo "reusing the tiers built for these sources ($hash)"  # REUSE_TIERS=1: after a build_tiers.py of this tree
else
  rm -rf src/normlab/kernels/cpu/tiers
  "$py" tools/build_tiers.py ${TIER_ARGS:-}
fi
find src/normlab/kernels/cpu/tiers -mindepth 2 -maxdepth 2 -name 'normlab-*' ! -name "normlab-$hash" -exec rm -rf {} +  # stale
"$py" -m build -q --wheel --outdir "$out" .
tag="$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
"$py" -m wheel tags --remove --python-tag "$tag" --abi-tag "$tag" --platform-tag manylinux_2_28_x86_64 "$out"/normlab-*-py3-none-any.whl
ls "$out"
