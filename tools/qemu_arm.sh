#!/usr/bin/env bash
# Run normlab's CPU kernels on aarch64 (ARM64) from an x86-64 Debian machine, under qemu-user.
#
#   bash tools/qemu_arm.sh setup                 # once: qemu, an arm64 Python, aarch64 wheels (~1 GB)
#   bash tools/qemu_arm.sh python -m pytest -q tests/test_cpu_numerics.py -k every_op
#   bash tools/qemu_arm.sh python -c "import normlab; ..."
#   python tools/build_tiers.py --tiers aarch64 # the ARM64 wheel's kernels: build_tiers runs this script
#   NORMLAB_CPU_TIERS=DIR bash tools/qemu_arm.sh python tools/tier_check.py --as-cpu neoverse-n1
#
# For correctness only: emulation runs the kernels (and numba's compiles, minutes each) 10-50x
# slower than an ARM CPU would, so no speed measured here means anything. LLVM sees the emulated
# CPU as "generic" aarch64 (ARMv8 with NEON, no SVE), the baseline every ARM64 CPU runs.
#
# The Python is Debian's arm64 python3.11, unpacked into a folder (no dpkg architecture is
# installed system-wide beyond the package lists); the wheels are PyPI's aarch64 ones for numpy,
# numba, llvmlite and scipy (the CLI) at the versions of this checkout's .venv, and torch 2.5.1: PyPI's aarch64
# torch from 2.6 on is a CUDA build that needs the CUDA libraries to import. Pure-Python
# dependencies (sympy, pytest, ...) are copied from the x86-64 environment.
set -euo pipefail

ROOT=${NORMLAB_ARM_ROOT:-/tmp/normlab-arm}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$HERE/.venv/bin/python}
TORCH_ARM=2.5.1

setup() {
    command -v qemu-aarch64 >/dev/null || apt-get install -y -q qemu-user
    dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
    apt-get update -q >/dev/null
    mkdir -p "$ROOT/debs" "$ROOT/sysroot" "$ROOT/site" "$ROOT/wheels"
    (cd "$ROOT/debs" && for p in python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libgcc-s1 \
        libstdc++6 zlib1g libssl3 libexpat1 libffi8 libbz2-1.0 liblzma5 libsqlite3-0 libuuid1 libcrypt1 \
        libncursesw6 libtinfo6 libreadline8 libgomp1 libnsl2 libtirpc3 libdb5.3 libgssapi-krb5-2 libkrb5-3 \
        libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1; do apt-get download -q "$p:arm64" >/dev/null; done)
    for f in "$ROOT"/debs/*.deb; do dpkg -x "$f" "$ROOT/sysroot"; done
    version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
    local pins=("numpy==$(version numpy)" "numba==$(version numba)" "llvmlite==$(version llvmlite)" "scipy==$(version scipy)"
                "torch==$TORCH_ARM")
    local target=(--no-deps --only-binary=:all: --python-version 3.11 --implementation cp --platform manylinux_2_28_aarch64
                  --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64)
    "$PY" -m pip download -q "${target[@]}" -d "$ROOT/wheels" "${pins[@]}"
    # the pins, not every wheel in the folder: a setup after a version change leaves the old ones there
    "$PY" -m pip install -q "${target[@]}" --no-index --find-links "$ROOT/wheels" --target "$ROOT/site" --upgrade "${pins[@]}"
    # pure-Python packages torch, normlab and the tests import, from wherever this Python finds them
    "$PY" - "$ROOT/site" <<'PYEOF'
import importlib.util, os, shutil, sys
for name in ("filelock", "fsspec", "jinja2", "markupsafe", "mpmath", "networkx", "sympy", "typing_extensions", "rich",
             "pygments", "markdown_it", "mdurl", "pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py",
             "hypothesis", "_hypothesis_globals", "_hypothesis_pytestplugin", "_hypothesis_ftz_detector",
             "sortedcontainers", "attr", "attrs"):
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        sys.exit(f"{name} is not installed in the x86-64 environment")
    src = os.path.dirname(spec.origin) if spec.submodule_search_locations else spec.origin
    dst = os.path.join(sys.argv[1], os.path.basename(src))
    if os.path.isdir(src):
        shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    else:
        shutil.copy(src, dst)
PYEOF
    echo "ready: bash tools/qemu_arm.sh python -c 'import normlab'"
}

run() {
    [ -x "$ROOT/sysroot/usr/bin/python3.11" ] || { echo "run 'bash tools/qemu_arm.sh setup' first" >&2; exit 2; }
    exec qemu-aarch64 -L "$ROOT/sysroot" -E PYTHONPATH="$HERE/src:$ROOT/site" \
        -E NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$ROOT/numba-cache}" -E HOME="$ROOT" \
        "$ROOT/sysroot/usr/bin/python3.11" "$@"
}

case "${1:-}" in
    setup) setup ;;
    python) shift; run "$@" ;;
    *) echo "usage: bash tools/qemu_arm.sh setup | python ARGS..." >&2; exit 2 ;;
esac
