"""Do two source trees of normlab give the same bits? Outputs and gradients of every CPU op.

    python tools/same_bits.py OLD_SRC NEW_SRC          # e.g. /tmp/old/src src

For a refactor of the kernels, which must not change a single bit. Each tree runs in its own
process (PYTHONPATH=TREE, a numba cache directory of its own), computes every op (rms_norm,
layer_norm and their add variants) for every dtype and option on inputs from a fixed seed, at
sizes that reach every code path (heads and tails, vector blocks, bf16 row pairs, rows past
65536 values) with plain and with streaming stores, and saves the results; then the two are
compared bit for bit. Exit status 1 when any tensor differs, with the cases that do listed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
SHAPES = ((7, 1), (7, 3), (5, 123), (6, 1000), (4, 3000), (8, 4096), (6, 8448), (2, 65537))
RMS_OPTIONS = (
    {},
    {"eps_mode": "outside"},
    {"cast": "gemma"},
    {"cast": "gemma", "offset": 1.0},
    {"cast": "llama", "offset": 1.0},
    {"partial": 0.0625},
    {"partial": 0.3, "eps_mode": "outside", "cast": "gemma"},
    {"weight": False},
)
LN_OPTIONS = ({}, {"weight": False}, {"bias": False})
ADD_OPTIONS = ({}, {"residual_in_fp32": True})


def cases():
    """(name, op, shape, dtype, options) for the whole grid."""
    for op in ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm"):
        options = RMS_OPTIONS if "rms" in op else LN_OPTIONS
        adds = ADD_OPTIONS if op.startswith("add") else ({},)
        for shape, dtype, opts, add in itertools.product(SHAPES, DTYPES, options, adds):
            opts = {**opts, **add}
            yield f"{op} {shape[0]}x{shape[1]} {dtype} {opts}", op, shape, dtype, opts


def dump(path: str) -> None:
    """Compute every case in this process (the tree on PYTHONPATH) and save the tensors."""
    import torch

    from normlab import functional as F

    results = {}
    for i, (name, op, shape, dtype_name, opts) in enumerate(cases()):
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator().manual_seed(i)
        opts = dict(opts)
        has_weight, has_bias = opts.pop("weight", True), opts.pop("bias", True)
        x = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype).requires_grad_()
        leaves = [x]
        args = [x]
        if op.startswith("add"):
            r = torch.randn(shape, generator=gen).to(dtype).requires_grad_()
            leaves.append(r)
            args.append(r)
        w = None
        if has_weight:
            w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(dtype).requires_grad_()
        args.append(w)
        leaves += [w] if w is not None else []
        if "layer" in op:
            b = torch.randn(shape[-1], generator=gen).to(dtype).requires_grad_() if has_bias else None
            args.append(b)
            leaves += [b] if b is not None else []
        out = getattr(F, op)(*args, backend="cpu", **opts)
        outs = out if isinstance(out, tuple) else (out,)
        seeds = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, leaves, seeds)
        results[name] = [t.detach() for t in (*outs, *grads)]
    torch.save(results, path)


def run_tree(tree: str, out: str, stream: bool, cache: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve()), "NUMBA_CACHE_DIR": cache}
    if stream:
        env["NORMLAB_CPU_STREAM_MB"] = "0"  # every output through the non-temporal path
    subprocess.run([sys.executable, __file__, "--dump", out], env=env, check=True)


def _bits(t):
    """A tensor's bit patterns as integers (so nan equals nan when its bits do)."""
    import torch

    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                8: torch.int64}[t.element_size()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", nargs="?", help="the first tree's source directory (holding normlab/)")
    parser.add_argument("new", nargs="?", help="the second tree's source directory")
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dump:
        dump(args.dump)
        return 0
    if not (args.old and args.new):
        parser.error("give two source directories, OLD and NEW")
    import torch

    failures, total = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for stream in (False, True):
            saved = []
            for label, tree in (("old", args.old), ("new", args.new)):
                path = os.path.join(tmp, f"{label}-{stream}.pt")
                run_tree(tree, path, stream, os.path.join(tmp, f"numba-{label}"))
                saved.append(torch.load(path, weights_only=True))
            old, new = saved
            for name in old:
                total += 1
                a, b = old[name], new.get(name)
                same = b is not None and len(a) == len(b) and all(
                    x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))
                    for x, y in zip(a, b)
                )
                if not same:
                    failures.append(("streamed " if stream else "") + name)
    for name in failures:
        print("DIFFERS:", name)
    print(f"{total - len(failures)} of {total} cases bitwise equal (outputs and gradients)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
