#!/usr/bin/env bash
# ONE prepared GPU check for the Triton backend (an H200 with its own torch and triton, no
# package registry): correctness at real sizes, the copy ceiling, normlab bench against peers.
#   bash benchmarks/gpu_check.sh OUTDIR [--quick]      (OUTDIR defaults to $OUT)
# Pure-Python peers travel as wheels: before the call, on a machine with a registry,
#   pip download liger-kernel==0.8.5 --no-deps -d benchmarks/wheels
# (benchmarks/wheels is git-ignored; carry it). Finishes in under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check}}"
shift || true
mkdir -p "$out"
if compgen -G "benchmarks/wheels/*.whl" > /dev/null; then
    python -m pip install -q --no-deps --no-index benchmarks/wheels/*.whl 2>&1 | tail -2
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$out/nvidia-smi.csv" 2>&1 || true
timeout 470 python benchmarks/gpu_check.py "$out" "$@" 2>&1 | tee "$out/log.txt" | tail -60
