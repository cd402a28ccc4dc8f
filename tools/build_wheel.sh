#!/usr/bin/env bash
# The release wheel: the fused CPU kernels compiled ahead of time (tools/build_tiers.py) so that a
# fresh install's first call loads them instead of compiling for 5-30 s. For x86-64 the levels
# x86-64-v3 (AVX2), x86-64-v3-zen (AMD's AVX2 CPUs), x86-64-v4 (AVX-512) and x86-64-v4-bf16; for
# ARM64 the level aarch64 (ARCH=aarch64; on an x86-64 machine built under tools/qemu_arm.sh, after
# its setup). numba's cache is tied to the numba and Python versions that wrote it, so the wheel
# is tagged for this Python and the machine's Linux (it holds no shared library: the kernels are
# object code that numba links itself), and holds only that machine's levels. Run once per Python
# version and machine.
#   bash tools/build_wheel.sh [OUTDIR]      (PYTHON: the interpreter; default .venv's)
#   ARCH=aarch64 bash tools/build_wheel.sh  (the ARM64 wheel; default: this machine's)
# TIER_ARGS: arguments for build_tiers.py (CI's check builds a small one: "--ops rms_norm --dtypes fp32").
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
out="${1:-dist}"
arch="${ARCH:-$(uname -m)}"
tiers=src/normlab/kernels/cpu/tiers
"$py" -m pip install -q build wheel
read -r hash levels < <("$py" -c "import sys; sys.path.insert(0, 'tools'); from build_tiers import levels_for
from normlab.kernels.cpu.cache import sources_hash; print(sources_hash(), ','.join(levels_for('$arch')))")
[ -n "$levels" ] || { echo "ARCH=$arch: no levels are built for it (x86_64 or aarch64)" >&2; exit 2; }
if [ -n "${REUSE_TIERS:-}" ] && ls -d "$tiers/${levels%%,*}/normlab-$hash" > /dev/null 2>&1; then
  echo "reusing the tiers built for these sources ($hash)"  # REUSE_TIERS=1: after a build_tiers.py of this tree
else
  for level in ${levels//,/ }; do rm -rf "${tiers:?}/$level"; done
  "$py" tools/build_tiers.py --tiers "$levels" ${TIER_ARGS:-}
fi
find "$tiers" -mindepth 2 -maxdepth 2 -name 'normlab-*' ! -name "normlab-$hash" -exec rm -rf {} +  # stale
# another machine's levels wait outside the package while the wheel is built
aside="$(mktemp -d)"
trap 'mv "$aside"/* "$tiers"/ 2>/dev/null || true; rm -rf "$aside"' EXIT
for level in "$tiers"/*; do
  [ -d "$level" ] && [[ ",$levels," != *",$(basename "$level"),"* ]] && mv "$level" "$aside"/
done
rm -rf build  # setuptools keeps files of an earlier build there, other levels' too
"$py" -m build -q --wheel --outdir "$out" .
tag="$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
"$py" -m wheel tags --remove --python-tag "$tag" --abi-tag "$tag" --platform-tag "manylinux_2_28_$arch" \
  "$out"/normlab-*-py3-none-any.whl
ls "$out"
