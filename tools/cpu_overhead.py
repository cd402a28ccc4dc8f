"""The fixed cost of a CPU call: what a small tensor pays around the kernel.

    python tools/cpu_overhead.py [--shape 8x1024] [--dtype bf16] [--calls 3000] [--cold]

For rms_norm and layer_norm it times, per call (median of ``--calls`` after a warm-up): the
numba kernel alone, the launcher (allocation, argument conversion, the kernel, the weight
gradient's chunk sum; the forward's as a call without a graph runs it, no statistics kept), the
public function without and with autograd's graph, and the backward through
``torch.autograd.grad`` (what a training step pays). A do-nothing autograd.Function
gives the floor of the last one, torch's eager function (no grad) and a copy of x the yardsticks.
At a large shape the kernel's time swamps these; at the shapes of small models, and in decode,
they are the call. ``--cold`` reads the bench's 128 MiB before each timed call (code and data
then start from memory, as after a large matmul); use a few hundred calls there.
"""

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as TF

import normlab.functional as F
from normlab.bench import parse_shape, scrubber
from normlab.kernels.cpu import launch as C
from normlab.kernels.cpu import layernorm, layernorm_bwd, memory, rmsnorm

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _no_scrub() -> None:
    pass


def median_us(fn, calls: int, scrub=_no_scrub) -> float:
    for _ in range(calls // 10):
        fn()
    times = []
    for _ in range(calls):
        scrub()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def timed_backward(make_output, inputs, dy, scrub=_no_scrub):
    """A callable that builds the graph untimed and returns the backward's own duration."""

    def run():
        y = make_output()
        scrub()
        t = time.perf_counter()
        torch.autograd.grad(y, inputs, dy)
        return time.perf_counter() - t

    return run


def median_self_timed_us(run, calls: int) -> float:
    for _ in range(calls // 10):
        run()
    return 1e6 * statistics.median(run() for _ in range(calls))


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.detach()

    @staticmethod
    def backward(ctx, dy):
        ctx.saved_tensors  # unpacked, as a real backward does: part of the floor
        return dy, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8x1024")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--cold", action="store_true", help="read 128 MiB before each timed call")
    args = parser.parse_args()
    shape, dtype, calls = parse_shape(args.shape), DTYPES[args.dtype], args.calls
    scrub = scrubber(torch.device("cpu")) if args.cold else _no_scrub
    n, d = int(np.prod(shape[:-1])), shape[-1]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, dtype=dtype)
    w = torch.randn(d, dtype=dtype, requires_grad=True)
    b = torch.randn(d, dtype=dtype, requires_grad=True)

    # the kernels' arguments as the launchers pass them (launch._at triples), made once
    rows_, keep = (n, d), [x.detach().view(n, d), dy.view(n, d), torch.empty(n, d, dtype=dtype),
                           w.detach().float(), b.detach().float()]
    xn, dyn, out, wn, bn = (C._at(t, rows_ if t.dim() == 2 else (d,)) for t in keep)
    stages, nt = C._stages(n * d * dtype.itemsize, n)
    # (far, skip) as the launchers pass them: far by a row of x; of x and dy
    skip = memory.prefetch_skip(d * dtype.itemsize)
    far, far2 = memory.prefetch_far(d * dtype.itemsize), memory.prefetch_far(2 * d * dtype.itemsize)
    mean, rstd = np.empty(n), np.empty(n, np.float32)
    # the backward reads the saved statistics (tensors) as triples, as its launcher does
    mean_at, rstd_at = C._at(torch.from_numpy(mean), (n,)), C._at(torch.from_numpy(rstd), (n,))
    dw = np.zeros(d, np.float32)
    rnd = C._round_to(dtype, False)
    _, _, rstd_t = C.rms_fwd_launch(x.detach(), w, 1e-6, True, False, 0.0, d)
    _, _, mean_t, lrstd_t = C.ln_fwd_launch(x.detach(), w, b, 1e-5)
    layernorm.ln_fwd(xn, wn, bn, out, mean, rstd, 1e-5, stages, nt, far, skip)

    rows = {
        "rms_norm": {
            "kernel fwd": lambda: rmsnorm.rms_fwd(xn, wn, out, rstd, 1e-6, True, d, rnd, stages, nt, far,
                                                  skip),
            "kernel bwd": lambda: rmsnorm.rms_bwd(dyn, xn, wn, rstd_at, None, out, dw, 1e-6, True, d, rnd,
                                                  stages, nt, far2, skip),
            "launcher fwd": lambda: C.rms_fwd_launch(x.detach(), w, 1e-6, True, False, 0.0, d, stats=False),
            "launcher bwd": lambda: C.rms_bwd_launch(dy, x.detach(), w, rstd_t, None, 1e-6, True, False, 0.0,
                                                     d),
            "fwd, no grad": lambda: F.rms_norm(x.detach(), w.detach(), backend="cpu"),
            "fwd, with graph": lambda: F.rms_norm(x, w, backend="cpu"),
            "bwd (autograd.grad)": timed_backward(lambda: F.rms_norm(x, w, backend="cpu"), [x, w], dy, scrub),
            "torch eager fwd": lambda: TF.rms_norm(x.detach(), (d,), w.detach(), 1e-6),
        },
        "layer_norm": {
            "kernel fwd": lambda: layernorm.ln_fwd(xn, wn, bn, out, mean, rstd, 1e-5, stages, nt, far, skip),
            "kernel bwd": lambda: layernorm_bwd.ln_bwd(dyn, xn, wn, mean_at, rstd_at, None, out, dw,
                                                       dw.copy(), stages, nt, far2, skip),
            "launcher fwd": lambda: C.ln_fwd_launch(x.detach(), w, b, 1e-5, stats=False),
            "launcher bwd": lambda: C.ln_bwd_launch(dy, x.detach(), w, mean_t, lrstd_t, None),
            "fwd, no grad": lambda: F.layer_norm(x.detach(), w.detach(), b.detach(), backend="cpu"),
            "fwd, with graph": lambda: F.layer_norm(x, w, b, backend="cpu"),
            "bwd (autograd.grad)": timed_backward(lambda: F.layer_norm(x, w, b, backend="cpu"), [x, w, b], dy,
                                                  scrub),
            "torch eager fwd": lambda: TF.layer_norm(x.detach(), (d,), w.detach(), b.detach(), 1e-5),
        },
    }
    floor = median_self_timed_us(timed_backward(lambda: _Nothing.apply(x, w), [x], dy, scrub), calls)
    copy = median_us(lambda: x.detach().clone(), calls, scrub)
    cache = "after a 128 MiB read each" if args.cold else "in a loop"
    print(f"shape {args.shape} {args.dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"median of {calls} calls {cache} (us)")
    print(f"{'':22s}" + "".join(f"{op:>12s}" for op in rows))
    for name in rows["rms_norm"]:
        cells = []
        for op in rows:
            fn = rows[op][name]
            us = median_self_timed_us(fn, calls) if name.startswith("bwd") else median_us(fn, calls, scrub)
            cells.append(f"{us:12.1f}")
        print(f"{name:22s}" + "".join(cells))
    print(f"{'do-nothing Function bwd':22s}{floor:12.1f}")
    print(f"{'copy of x (clone)':22s}{copy:12.1f}")


if __name__ == "__main__":
    main()
