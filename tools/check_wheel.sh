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
