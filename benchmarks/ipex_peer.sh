#!/usr/bin/env bash
# Intel Extension for PyTorch as a CPU peer: its fused inference norms (ipex.llm.functional's
# rms_norm and fast_layer_norm) timed by `normlab bench` against a copy in the same process,
# beside normlab's kernels. IPEX pins its own torch (2.8 for IPEX 2.8), so this runs in a
# virtual environment of its own, made on first use (torch 2.8's Linux wheel pulls in CUDA
# libraries: about 7 GB on disk, though nothing here uses a GPU); normlab is installed into it
# from this checkout.
#   bash benchmarks/ipex_peer.sh OUT.json [more normlab bench options]
# With --keep-freed-memory IPEX's times leave out the page faults of its fresh outputs, which
# normlab's buffer pool avoids (docs/results/ipex-peer-xeon-2core.md: both settings).
# Environment: IPEX_VENV (default ~/.cache/normlab/ipex-venv), IPEX_VERSION (2.8.0) and
# IPEX_TORCH (2.8.0).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash benchmarks/ipex_peer.sh OUT.json [normlab bench options]}"
shift
venv="${IPEX_VENV:-$HOME/.cache/normlab/ipex-venv}"
if ! "$venv/bin/python" -c "import intel_extension_for_pytorch, normlab" 2>/dev/null; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install -q "torch==${IPEX_TORCH:-2.8.0}" "intel-extension-for-pytorch==${IPEX_VERSION:-2.8.0}" -e .
fi
# Threads wait passively: spinning after one peer's call took the cores from the next case's
# (normlab's bf16 layer_norm measured 0.19x copy after IPEX's calls with spinning, 0.93x without).
export OMP_WAIT_POLICY=PASSIVE KMP_BLOCKTIME=0
# forward only: IPEX's fused norms are for inference (with autograd they fall back to torch ops)
"$venv/bin/python" -m normlab bench --backends normlab,ipex --ops rms_norm,layer_norm --dtypes fp32,bf16 \
    --passes fwd --alloc alloc --json "$out" "$@"
