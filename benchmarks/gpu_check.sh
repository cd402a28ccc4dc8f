#!/usr/bin/env bash
# ONE prepared GPU check for the Triton backend: correctness at real sizes (one tensor over 2^31
# elements), the copy ceiling, normlab against torch, torch.compile, Liger-Kernel and quack,
# and check-model on the device. Under 8 minutes on one H100/H200.
#   bash benchmarks/gpu_check.sh OUTDIR [--quick]     (OUTDIR defaults to $OUT)
#   bash benchmarks/gpu_check.sh --dry-run OUTDIR     (CPU, Triton's interpreter, tiny sizes: what CI runs)
# Writes OUTDIR/summary.md and summary.json (every failure listed) and the sections' JSON; the
# exit status is non-zero when anything failed. A CUDA torch and triton are assumed present.
# Peers: wheels in benchmarks/wheels are installed first (a GPU machine without a registry: on a
# machine with one, `pip download liger-kernel quack-kernels nvidia-cutlass-dsl --no-deps -d
# benchmarks/wheels` and carry the folder); else pip is tried; a peer that cannot be installed is
# left out and named in the bench notes.
set -uo pipefail
py="${PYTHON:-python}"  # the interpreter with torch (CI passes its venv's)
cd "$(dirname "$0")/.."
dry=0
args=()
for a in "$@"; do
    if [ "$a" = "--dry-run" ]; then dry=1; else args+=("$a"); fi
done
out="${args[0]:-${OUT:-gpu-check}}"
rest=("${args[@]:1}")
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry" = 1 ]; then
    export TRITON_INTERPRET=1
    timeout 900 "$py" benchmarks/gpu_check.py "$out" --dry-run "${rest[@]}" 2>&1 | tee "$out/log.txt" | tail -40
    exit "${PIPESTATUS[0]}"
fi
if compgen -G "benchmarks/wheels/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-deps --no-index benchmarks/wheels/*.whl 2>&1 | tail -2
fi
for peer in "liger_kernel liger-kernel" "quack quack-kernels nvidia-cutlass-dsl"; do
    set -- $peer
    "$py" -c "import $1" 2>/dev/null || timeout 120 "$py" -m pip install -q --no-deps "${@:2}" 2>&1 | tail -1 || true
done
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$out/nvidia-smi.csv" 2>&1 || true
timeout 470 "$py" benchmarks/gpu_check.py "$out" "${rest[@]}" 2>&1 | tee "$out/log.txt" | tail -60
exit "${PIPESTATUS[0]}"
