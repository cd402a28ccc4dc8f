"""Interleaved A/B of two versions of the CPU kernels in one process.

    python tools/cpu_ab.py OLD_SRC NEW_SRC [--ops rms,ln,rmsb,lnb] [--shapes 8192x1024,...]
                           [--dtype bf16|fp16|fp32] [--threads 2] [--rounds 10] [--llama] [--in-cache]
                           [--prefetch-ab] [--ahead-ab N] [--mean M]

On a machine whose memory bandwidth drifts (2x within minutes on the 2-core CI machine), two
bench runs a minute apart differ by more than most kernel changes do. This loads both trees'
kernels (OLD_SRC and NEW_SRC hold normlab/; the trees' kernel packages are imported under
names of their own, without registering their custom ops), then for
each case alternates batches of calls: a copy of the same bytes, A, B (B, A in every other
round, so neither always follows the copy), and reports each one's speed as a fraction of the
copy and B's speedup over A as the median of the per-round ratios with their range. Inputs
rotate over as many sets as ``normlab bench`` uses, so they do not stay in the cache between calls.
Each tree's kernels get what its launchers pass: (address, shape, witness) triples and the llama
order's weight in the output's dtype from ceab71e on, arrays before. Even so, an A/A run moves by
about 5%: trust a change when its whole range sits on one side, and confirm one near the line with
alternating `normlab bench` runs of each tree (docs/cpu-kernels.md, "The A/B tool and the launchers").
``--in-cache`` (with ``--threads 1`` and a shape such as 64x1024) keeps one input set and times
batches of 200 calls: what a change does to the arithmetic, where memory would hide it.
``--prefetch-ab`` (one tree twice) builds A with the next row always prefetched into L1 and B as
the launchers choose (into L2 for wide rows): cases the rule leaves in L1 are then an A/A.
``--ahead-ab N`` (one tree twice) builds A with the next row prefetched and B with the row N on,
at every shape given: what memory.SHORT_ROWS_AHEAD's choice buys on this CPU.
``--mean M`` draws x about M instead of 0 (LayerNorm's statistics take other paths far from 0).

Ops: rms / ln / dyt (forward into a preallocated output), rmsb / lnb / dytb (backward; its
fraction of copy counts the three tensors it moves). Example, the working tree against the last commit::

    git worktree add /tmp/old HEAD
    python tools/cpu_ab.py /tmp/old/src src --ops ln
"""

import argparse
import importlib
import importlib.util
import inspect
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="normlab-ab-")

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from normlab.bench import rotation  # noqa: E402
from normlab.kernels.cpu import launch as C  # noqa: E402
from normlab.kernels.cpu import memory  # noqa: E402


def load(src: str, name: str):
    """The kernels (rms_fwd, ln_fwd, rms_bwd, ln_bwd, and DyT's where the tree has them) of the tree
    whose sources are in ``src``."""
    package = Path(src) / "normlab" / "kernels" / "cpu"
    if not package.is_dir():  # before the kernels became a package: one module, _numba.py
        spec = importlib.util.spec_from_file_location(name, package.parent / "_numba.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # numba's cache wants the module importable by name
        spec.loader.exec_module(module)
        return module
    parent = types.ModuleType(name)  # the package without its __init__, which registers custom ops
    parent.__path__ = [str(package)]
    sys.modules[name] = parent
    rms, ln = (importlib.import_module(f"{name}.{op}") for op in ("rmsnorm", "layernorm"))
    if (package / "layernorm_bwd.py").is_file():  # trees from the forward's row pairs on
        ln.ln_bwd = importlib.import_module(f"{name}.layernorm_bwd").ln_bwd
    kernels = types.SimpleNamespace(rms_fwd=rms.rms_fwd, ln_fwd=ln.ln_fwd, rms_bwd=rms.rms_bwd,
                                    ln_bwd=ln.ln_bwd)
    # trees from 7beb5e1 on take ``far`` (prefetch into L2) after ``stream``
    kernels.far = "far" in inspect.signature(rms.rms_fwd.py_func).parameters
    # and from c03980f on ``skip`` (the rows past the next that short rows prefetch) after it
    kernels.skip = "skip" in inspect.signature(rms.rms_fwd.py_func).parameters
    # trees from ceab71e on take tensors as (address, shape, dtype witness) triples, the llama
    # order's weight in the output's dtype: pass them as their launchers do, since an array
    # argument compiles a signature of its own, which need not run at the same speed
    kernels.triples = hasattr(importlib.import_module(f"{name}.rows"), "at")
    if (package / "pointwise.py").is_file():  # DyT and Derf in one kernel: s (the shift) None for DyT
        pw = importlib.import_module(f"{name}.pointwise")
        # (..., table, far) and then (..., table, far, skip) in later trees: ``pf_`` holds both
        taken = len({"far", "skip"} & set(inspect.signature(pw.pointwise_fwd.py_func).parameters))
        kernels.dyt_fwd = lambda x, a, *rest, pf_: pw.pointwise_fwd(x, a, None, *rest, *pf_[:taken])
        kernels.dyt_bwd = lambda dy, x, a, w, dx, da, *rest, pf_: pw.pointwise_bwd(
            dy, x, a, None, w, dx, np.zeros((da.shape[0], 2)), *rest, *pf_[:taken]
        )
        dyt = pw
    elif (package / "dynamic_tanh.py").is_file():
        dyt = importlib.import_module(f"{name}.dynamic_tanh")
        kernels.dyt_fwd = lambda *args, pf_: dyt.dyt_fwd(*args)
        kernels.dyt_bwd = lambda *args, pf_: dyt.dyt_bwd(*args)
    if (package / "pointwise.py").is_file() or (package / "dynamic_tanh.py").is_file():
        # the table argument, made per call as the launcher makes it (trees before tables: none)
        table_for = getattr(dyt, "table_for", None)
        kernels.dyt_table = (lambda x, grad: (table_for(x, grad),)) if table_for else (lambda x, grad: ())
    return kernels


def runner(K, op: str, n: int, d: int, dtype: torch.dtype, llama: bool = False, in_cache: bool = False,
           near: bool = False, mean: float = 0.0, ahead: int | None = None):
    """A no-argument callable that runs ``op`` of kernel module K on the next input set (with
    ``in_cache``, always the same one); ``near``: the next row always prefetched into L1;
    ``mean``: x's values centred there (dy's at 0); ``ahead``: the rows prefetched ahead (1: the
    next), at any row length, instead of what the launchers choose."""
    k = 1 if in_cache else rotation((n, d), dtype)
    as_arg = (lambda a: (a.ctypes.data, a.shape, np.empty(0, a.dtype))) if K.triples else (lambda a: a)
    # (x, dy) per input set; these arrays, kept with the callable (run.arrays), hold what triples point to
    arrays = [tuple(memory.as_numpy(torch.randn(n, d, dtype=dtype) + m) for m in (mean, 0.0))
              for _ in range(k)]
    sets = [(as_arg(x), as_arg(dy), x) for x, dy in arrays]  # (x, dy as passed, x's array)
    y_array = memory.as_numpy(torch.empty(n, d, dtype=dtype))
    w_array, b_array = torch.randn(d).numpy(), torch.randn(d).numpy()
    # the llama order's rms weight: in the output's dtype where the tree widens it in the kernel
    rw_array = memory.as_numpy(torch.randn(d).to(dtype)) if llama and K.triples else w_array
    y, w, b, rw = as_arg(y_array), as_arg(w_array), as_arg(b_array), as_arg(rw_array)
    stages, nt = C._stages(n * d * dtype.itemsize, n)
    rstd, mean, rnd = np.empty(n, np.float32), np.empty(n, np.float64), C._round_to(dtype, llama)
    dw, db = np.zeros(d, np.float32), np.zeros(d, np.float32)
    chunks = stages.shape[0]
    da_sum, dw_sum, db_sum = np.zeros(chunks), np.zeros((chunks, d)), np.zeros((chunks, d))
    # the launchers' ``far``: by the bytes of a row over the inputs a pass reads (x; x and dy);
    # their ``skip``: by the bytes of a row of x
    far1, far2 = (memory.prefetch_far(d * dtype.itemsize * k) and not near for k in (1, 2))
    skip = memory.prefetch_skip(d * dtype.itemsize) if ahead is None else ahead - 1
    pf1, pf2 = (far1, skip), (far2, skip)
    taken = K.far + K.skip
    fwd, bwd = pf1[:taken], pf2[:taken]
    # the backward reads rstd and mean as triples (tensors the forward saved); the forward writes
    # them as arrays
    rstd_in, mean_in = as_arg(rstd), as_arg(mean)
    if op == "rmsb":  # the statistics the backward reads
        K.rms_fwd(sets[0][0], rw, y, rstd, 1e-6, True, d, rnd, stages, nt, *fwd)
    if op == "lnb":
        K.ln_fwd(sets[0][0], w, b, y, mean, rstd, 1e-5, stages, nt, *fwd)
    calls = {
        "rms": lambda x, dy, xa: K.rms_fwd(x, rw, y, rstd, 1e-6, True, d, rnd, stages, nt, *fwd),
        "ln": lambda x, dy, xa: K.ln_fwd(x, w, b, y, mean, rstd, 1e-5, stages, nt, *fwd),
        "rmsb": lambda x, dy, xa: K.rms_bwd(dy, x, rw, rstd_in, None, y, dw, 1e-6, True, d, rnd, stages, nt,
                                            *bwd),
        "lnb": lambda x, dy, xa: K.ln_bwd(dy, x, w, mean_in, rstd_in, None, y, dw, db, stages, nt, *bwd),
        "dyt": lambda x, dy, xa: K.dyt_fwd(x, 0.5, w, b, y, stages, nt, *K.dyt_table(xa, False), pf_=pf1),
        "dytb": lambda x, dy, xa: K.dyt_bwd(dy, x, 0.5, w, y, da_sum, dw_sum, db_sum, stages, nt,
                                            *K.dyt_table(xa, True), pf_=pf2),
    }
    call, turn = calls[op], [0]

    def run():
        turn[0] += 1
        call(*sets[turn[0] % k])

    run.arrays = (arrays, y_array, w_array, b_array, rw_array, rstd, mean)  # what the triples point into
    return run


def copier(n: int, d: int, dtype: torch.dtype, in_cache: bool = False):
    k = 1 if in_cache else rotation((n, d), dtype)
    srcs = [torch.randn(n, d, dtype=dtype) for _ in range(k)]
    dst, turn = torch.empty(n, d, dtype=dtype), [0]

    def run():
        turn[0] += 1
        dst.copy_(srcs[turn[0] % k])

    return run


def batch(fn, calls: int = 5, in_cache: bool = False) -> float:
    if in_cache:  # calls of a few microseconds: time 200 together
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        return (time.perf_counter() - t0) / 200
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--ops", default="rms,ln,rmsb,lnb")
    parser.add_argument("--shapes", default="8192x1024,4096x4096,1024x16384")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--llama", action="store_true",
                        help="rms_norm in the llama cast order (gemma's otherwise)")
    parser.add_argument("--in-cache", action="store_true",
                        help="one input set, batches of 200 calls: the arithmetic without memory in the way "
                             "(with --threads 1 and shapes that fit the core's cache, e.g. 64x1024)")
    parser.add_argument("--prefetch-ab", action="store_true",
                        help="A prefetches the next row into L1 always, B where the launchers would into L2 "
                             "(give one tree twice: what memory.prefetch_far's rule buys on this CPU)")
    parser.add_argument("--ahead-ab", type=int, metavar="N",
                        help="A prefetches the next row, B the row N on, at every shape given (the "
                             "launchers do so only for short rows: give one tree twice: what "
                             "memory.SHORT_ROWS_AHEAD buys on this CPU)")
    parser.add_argument("--mean", type=float, default=0.0,
                        help="x's values centred here, not at 0 (LayerNorm's statistics then take "
                             "the shifted sums)")
    args = parser.parse_args()
    ic = args.in_cache
    # a tree whose tiers are built would load them: compare the code each tree compiles for this CPU
    os.environ.setdefault("NORMLAB_CPU_TIERS", "off")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    old = load(args.old, "normlab_ab_old")
    # one tree given twice (an A/A run, --prefetch-ab, --ahead-ab) runs the same code: compile it once
    new = old if Path(args.old).resolve() == Path(args.new).resolve() else load(args.new, "normlab_ab_new")
    if args.prefetch_ab and not (old.far and new.far):
        parser.error("--prefetch-ab: both trees' kernels must take `far` (7beb5e1 on)")
    if args.ahead_ab is not None and not (old.skip and new.skip and args.ahead_ab >= 1):
        parser.error("--ahead-ab N: N >= 1, and both trees' kernels must take `skip` (c03980f on)")
    near = args.prefetch_ab
    a_ahead, b_ahead = (1, args.ahead_ab) if args.ahead_ab is not None else (None, None)
    for op in args.ops.split(","):
        for shape in args.shapes.split(","):
            n, d = map(int, shape.split("x"))
            # Two sets of buffers, allocated A's first and B's first: whichever was allocated
            # second ran 5%-10% faster here (an A/A run read 1.1), so rounds alternate the sets.
            m = args.mean
            first = (runner(old, op, n, d, dtype, args.llama, ic, near, m, a_ahead),
                     runner(new, op, n, d, dtype, args.llama, ic, mean=m, ahead=b_ahead))
            second = tuple(reversed((runner(new, op, n, d, dtype, args.llama, ic, mean=m, ahead=b_ahead),
                                     runner(old, op, n, d, dtype, args.llama, ic, near, m, a_ahead))))
            cp = copier(n, d, dtype, ic)
            for f in (*first, *second, cp):
                f()  # compile, first touch
            scale = 1.5 if op.endswith("b") else 1.0  # a backward moves three tensors, a copy two
            fa, fb, gain = [], [], []
            for r in range(args.rounds):
                a, b = (first, second)[r // 2 % 2]
                c = batch(cp, in_cache=ic)
                if r % 2:
                    ta, tb = batch(a, in_cache=ic), batch(b, in_cache=ic)
                else:
                    tb, ta = batch(b, in_cache=ic), batch(a, in_cache=ic)
                fa.append(c / ta * scale)
                fb.append(c / tb * scale)
                gain.append(ta / tb)
            print(f"{op:5s} {shape:>10s}: x copy A {statistics.median(fa):.2f}  B "
                  f"{statistics.median(fb):.2f};  B speedup {statistics.median(gain):.3f} (range "
                  f"{min(gain):.2f}-{max(gain):.2f})", flush=True)


if __name__ == "__main__":
    main()
