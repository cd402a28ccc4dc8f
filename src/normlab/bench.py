"""``normlab bench``: kernel speed against the memory-bandwidth ceiling and against peers.

Norms are memory-bound, so every result is reported as GB/s over the bytes the op must move
(forward: read x, write y; backward: read x and dy, write dx; the add variants also read the
residual and write the sum, or read the sum's gradient) and as a fraction of a copy of the same
tensor measured in the same run (``y.copy_(x)`` into a preallocated ``y``).

How it measures: cases that share a dtype and shape form a group with one pool of inputs,
rotated over rounds. Within a group the cases run round-robin, one call each per round, with the
copy among them, and each case reports its median: a machine whose bandwidth drifts (a shared
host) shifts every case of a round alike instead of favouring whichever ran in a quiet moment.
Each round starts one case later than the last, so no case always follows the same one (on a
Zen 5 the case right after the copy ran up to 0.15 ms slower in some runs, scrub or not).
Before each timed call (and between a backward's untimed forward and the backward), a buffer of
ROTATE_BYTES is read, untimed: every call starts with none of its inputs in the last-level cache
and no dirty lines of the call before it left to write back. Without it, the cases of a round
read the round's input after the first had brought it into the cache, and the case after the
copy wrote back the copy's output: results then depended on the cases' order (docs/cpu-kernels.md,
"How the bench clears the cache"). Warm-up calls (and any compilation) come first, not timed.

Peers: torch eager (``torch``: F.rms_norm / F.layer_norm; ``torch-module``: nn.RMSNorm /
nn.LayerNorm), Hugging Face's LlamaRMSNorm math written out (``hf``), torch.compile of the
reference (``compile``), normlab's own reference (``reference``), Liger-Kernel / apex when
they are importable (CUDA only), and Intel Extension for PyTorch's fused CPU norms (``ipex``,
forward only: they are for inference; IPEX pins its own torch, so benchmarks/ipex_peer.sh runs
it in an environment of its own).
"""

from __future__ import annotations

import ctypes
import importlib
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import torch.nn.functional as TF

from normlab import functional as F
from normlab import runs

OPS = ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm", "prms_norm", "dyt", "derf")
PASSES = ("fwd", "bwd", "fwdbwd")
ALLOCS = ("alloc", "prealloc")
# Rounds are round-robin over a group's cases, so drift in the machine's memory bandwidth (2x
# within minutes on the 2-core CI machine) hits every case alike. 30 rounds of the fast cases
# (normlab, the copy) cost little: a slow peer sits out after 3 rounds and CASE_SECONDS. Against
# 10 rounds and 1 s, a default run took 1m53s-2m05s instead of 2m20s. Runs still differ by
# 0.1-0.2 in fractions of copy: the bandwidth moves between groups, and the bf16 kernels, near
# their compute limit, fall behind a copy that runs fast.
REPEAT = 30
CASE_SECONDS = 0.5
PEERS = ("normlab", "reference", "torch", "torch-module", "hf", "compile", "liger", "apex", "quack", "ipex")
FORWARD_ONLY = {"ipex": "its fused norms are for inference (with autograd they fall back to torch ops)"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHAPES = ("8192x1024", "4096x4096", "1024x16384")
EPS = 1e-6
INTERRUPTED = "interrupted (Ctrl-C)"  # the note a bench stopped by Ctrl-C leaves, with the groups it kept
PARTIAL = 0.0625

# Fused peers importable on CUDA machines: (name in notes, module, RMSNorm class, LayerNorm class).
FUSED_PEERS = {
    "liger": ("Liger-Kernel", "liger_kernel.transformers", "LigerRMSNorm", "LigerLayerNorm"),
    "apex": ("apex", "apex.normalization", "FusedRMSNorm", "FusedLayerNorm"),
}

# Inputs rotate over at least this many bytes, and the scrub between timed calls reads as many:
# four times a 32 MiB last-level cache.
ROTATE_BYTES = 128 << 20


@dataclass
class Peer:
    """A way to run an op: ``fn(x, residual)`` returns the output(s); ``params`` are the weight
    tensors it differentiates; ``out_fn(x, residual, out)`` writes into ``out`` (prealloc)."""

    fn: Callable
    params: list[torch.Tensor]
    out_fn: Callable | None = None


@dataclass
class Case:
    op: str
    backend: str
    dtype: str
    shape: str
    pass_: str
    alloc: str
    nbytes: int
    run: Callable[[int], object] = field(repr=False)
    times: list[float] = field(default_factory=list, repr=False)

    @property
    def grad_mode(self) -> bool:
        """Autograd on for the backward passes, off for forwards and the copy. Set around each
        call, outside its timing: a `with torch.no_grad()` inside it cost ~35 us after the cache
        read, which the copy's call did not pay (docs/cpu-kernels.md, "A shorter path")."""
        return self.pass_ in ("bwd", "fwdbwd")


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) < 2:
        raise ValueError(f"shape must look like ROWSxHIDDEN (e.g. 8192x1024), got {text!r}")
    if any(s < 1 for s in shape):
        raise ValueError(f"shape {text!r}: rows and hidden size must each be at least 1")
    return shape


def _is_add(op: str) -> bool:
    return op.startswith("add_")


def _norm_kind(op: str) -> str:
    return "pointwise" if op in ("dyt", "derf") else "layer" if "layer" in op else "rms"


def moved_bytes(op: str, pass_: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes the op must move: the floor a memory-bound kernel is measured against."""
    n = math.prod(shape)
    e = torch.finfo(dtype).bits // 8
    d = shape[-1]
    params = (1 if _norm_kind(op) == "rms" else 2) * d * e  # weight, and bias (LayerNorm, DyT, Derf)
    fwd = (4 if _is_add(op) else 2) * n * e + params
    bwd = (4 if _is_add(op) else 3) * n * e + 2 * params  # read weights, write their grads
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[pass_]


# ------------------------------------------------------------------------------------ peers


def _weights(op: str, d: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    w = torch.ones(d, dtype=dtype, device=device, requires_grad=True)
    if _norm_kind(op) == "pointwise":  # alpha, (Derf's shift,) weight, bias
        scalars = [torch.full((1,), v, device=device, requires_grad=True)
                   for v in ((0.5,) if op == "dyt" else (0.5, 0.1))]
        return [*scalars, w, torch.zeros(d, dtype=dtype, device=device, requires_grad=True)]
    if _norm_kind(op) == "layer":
        return [w, torch.zeros(d, dtype=dtype, device=device, requires_grad=True)]
    return [w]


def _reference_call(op: str, backend: str | None) -> Callable:
    """The op through normlab's functional API on ``backend`` (None: auto)."""

    def call(x, r, w, *more):
        if op == "dyt":  # (alpha, weight, bias)
            return F.dyt(x, w, *more, backend=backend)
        if op == "derf":  # (alpha, shift, weight, bias)
            return F.derf(x, w, *more, backend=backend)
        b = more[0] if more else None
        if op == "rms_norm":
            return F.rms_norm(x, w, EPS, backend=backend)
        if op == "prms_norm":
            return F.rms_norm(x, w, EPS, partial=PARTIAL, backend=backend)
        if op == "layer_norm":
            return F.layer_norm(x, w, b, EPS, backend=backend)
        if op == "add_rms_norm":
            return F.add_rms_norm(x, r, w, EPS, backend=backend)
        return F.add_layer_norm(x, r, w, b, EPS, backend=backend)

    return call


def _hf_llama_rms(x, w):
    # transformers' LlamaRMSNorm.forward, written out
    hs = x.to(torch.float32)
    variance = hs.pow(2).mean(-1, keepdim=True)
    hs = hs * torch.rsqrt(variance + EPS)
    return w * hs.to(x.dtype)


def make_peer(name: str, op: str, d: int, dtype: torch.dtype, device: torch.device) -> Peer | str:
    """The peer, or a string saying why it cannot run this op here."""
    params = _weights(op, d, dtype, device)
    add = _is_add(op)
    if name in ("normlab", "reference"):
        call = _reference_call(op, None if name == "normlab" else "reference")
        out_fn = None
        if name == "normlab" and not add and _norm_kind(op) != "pointwise":
            def out_fn(x, r, out):  # called with autograd off (Case.grad_mode)
                if op == "layer_norm":
                    return F.layer_norm(x, params[0], params[1], EPS, out=out)
                return F.rms_norm(x, params[0], EPS, partial=PARTIAL if op == "prms_norm" else None, out=out)
        return Peer(lambda x, r: call(x, r, *params), params, out_fn)
    if name == "compile":
        # One compiled function per (op, dtype, shape, grad mode): past dynamo's default limit
        # of 8 recompiles it silently falls back to eager, which would be measured as "compile".
        import torch._dynamo as dynamo

        # cache_size_limit before torch 2.7
        limit = "recompile_limit" if hasattr(dynamo.config, "recompile_limit") else "cache_size_limit"
        setattr(dynamo.config, limit, max(getattr(dynamo.config, limit), 512))
        call = torch.compile(_reference_call(op, "reference"), dynamic=False)
        return Peer(lambda x, r: call(x, r, *params), params)
    if op == "prms_norm":
        return "no partial RMSNorm"
    if op == "dyt":
        if name != "torch":
            return "no DyT of its own (torch: the paper's module math in eager torch)"
        alpha, weight, bias = params
        return Peer(lambda x, r: weight * torch.tanh(alpha * x) + bias, params)
    if op == "derf":
        if name != "torch":
            return "no Derf of its own (torch: the paper's module math in eager torch)"
        alpha, shift, weight, bias = params
        return Peer(lambda x, r: weight * torch.erf(alpha * x + shift) + bias, params)
    if name == "torch":
        if _norm_kind(op) == "rms":
            norm = lambda s: TF.rms_norm(s, (d,), params[0], EPS)  # noqa: E731
        else:
            norm = lambda s: TF.layer_norm(s, (d,), params[0], params[1], EPS)  # noqa: E731
    elif name == "torch-module":
        module = (torch.nn.RMSNorm(d, eps=EPS) if _norm_kind(op) == "rms"
                  else torch.nn.LayerNorm(d, eps=EPS)).to(device, dtype)
        params = list(module.parameters())
        norm = module
    elif name == "hf":
        if _norm_kind(op) != "rms":
            return "HF's LayerNorm is nn.LayerNorm (see torch-module)"
        norm = lambda s: _hf_llama_rms(s, params[0])  # noqa: E731
    elif name == "quack":  # Dao-AILab's CuTe-DSL kernels (pip install quack-kernels): an RMSNorm function
        if _norm_kind(op) != "rms":
            return "quack has no LayerNorm"
        if device.type != "cuda":
            return "quack runs on CUDA only"
        try:
            from quack import rmsnorm as quack_rmsnorm
        except ImportError:
            return "quack is not installed"
        norm = lambda s: quack_rmsnorm(s, params[0], EPS)  # noqa: E731
    elif name == "ipex":  # Intel Extension for PyTorch: ipex.llm.functional's fused CPU norms
        if device.type != "cpu":
            return "ipex's fused norms here are its CPU ones"
        try:
            import intel_extension_for_pytorch as ipex
        except ImportError:
            return ("intel_extension_for_pytorch is not installed "
                    "(it pins its own torch: benchmarks/ipex_peer.sh)")
        if _norm_kind(op) == "rms":
            norm = lambda s: ipex.llm.functional.rms_norm(s, params[0], EPS)  # noqa: E731
        else:
            norm = lambda s: ipex.llm.functional.fast_layer_norm(s, (d,), params[0], params[1],
                                                                 EPS)  # noqa: E731
    elif name in FUSED_PEERS:
        label, module_name, rms_cls, ln_cls = FUSED_PEERS[name]
        if device.type != "cuda":
            return f"{label} runs on CUDA only"
        try:
            lib = importlib.import_module(module_name)
        except ImportError:
            return f"{label} is not installed"
        cls = getattr(lib, rms_cls if _norm_kind(op) == "rms" else ln_cls)
        module = cls(d, eps=EPS).to(device, dtype)
        params = list(module.parameters())
        norm = module
    else:
        raise ValueError(f"unknown backend {name!r}; choose from {', '.join(PEERS)}")
    if add:
        def fn(x, r):
            s = x + r
            return norm(s), s
        return Peer(fn, params)
    return Peer(lambda x, r: norm(x), params)


# ---------------------------------------------------------------------------------- groups


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rotation(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    nbytes = math.prod(shape) * (torch.finfo(dtype).bits // 8)
    return max(2, min(8, math.ceil(ROTATE_BYTES / nbytes)))


def _build_group(ops, peers, passes, allocs, dtype_name, shape, device, gen,
                 scrub) -> tuple[list[Case], list[str]]:
    """The cases for one (dtype, shape) group, plus notes on peers that cannot run."""
    dtype = DTYPES[dtype_name]
    d = shape[-1]
    k = rotation(shape, dtype)

    def rand():
        return [torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
                for _ in range(k)]

    xs, rs, dys, dss = rand(), rand(), rand(), rand()
    shape_s = "x".join(map(str, shape))
    out = torch.empty(shape, dtype=dtype, device=device)
    copy_bytes = 2 * math.prod(shape) * (torch.finfo(dtype).bits // 8)
    cases = [Case("copy", "torch", dtype_name, shape_s, "copy", "prealloc", copy_bytes,
                  lambda i: out.copy_(xs[i % k]))]
    notes = []
    for op in ops:
        for name in peers:
            peer = make_peer(name, op, d, dtype, device)
            if isinstance(peer, str):
                notes.append(f"{name} skipped for {op}: {peer}")
                continue
            for pass_ in passes:
                if pass_ != "fwd" and name in FORWARD_ONLY:
                    note = f"{name}: forward only ({FORWARD_ONLY[name]})"
                    if note not in notes:
                        notes.append(note)
                    continue
                nbytes = moved_bytes(op, pass_, shape, dtype)
                if pass_ == "fwd":
                    for alloc in allocs:
                        if alloc == "prealloc" and peer.out_fn is None:
                            continue
                        cases.append(Case(op, name, dtype_name, shape_s, pass_, alloc, nbytes,
                                          _fwd_runner(peer, alloc, xs, rs, out)))
                else:
                    cases.append(Case(op, name, dtype_name, shape_s, pass_, "alloc", nbytes,
                                      _bwd_runner(peer, pass_, xs, rs, dys, dss, device, scrub)))
    return cases, notes


def _fwd_runner(peer: Peer, alloc: str, xs, rs, out):
    k = len(xs)
    if alloc == "prealloc":
        return lambda i: peer.out_fn(xs[i % k], rs[i % k], out)
    return lambda i: peer.fn(xs[i % k], rs[i % k])  # with autograd off (Case.grad_mode)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> None:
    """Have glibc keep what this process frees for its next allocations (for good: call it first).

    By default glibc maps each large block afresh and returns it to the OS on free, so a peer's
    fresh output faults its pages in inside every timed call; normlab's buffer pool keeps its
    outputs' pages. With this, the peers' times are their kernels' too, not the page faults
    (jemalloc does not help: above 8 MiB its oversize arena returns pages at once)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        raise RuntimeError("--keep-freed-memory sets glibc's malloc options; this process does not run "
                           f"on glibc ({platform.system()}, {platform.libc_ver()[0] or 'another C library'})")
    libc = ctypes.CDLL(None)
    # blocks up to 1 GiB from the heap, which is trimmed past 2 GiB free and grows 256 MiB at a time
    for param, value in ((_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 2**31 - 1),
                         (_M_TOP_PAD, 256 << 20)):
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            raise RuntimeError(f"glibc refused mallopt({param}, {value})")


def scrubber(device: torch.device) -> Callable[[], None]:
    """What runs before each timed call: on CPU, a read of ROTATE_BYTES (it evicts the last
    call's inputs and writes back its dirty lines; a read leaves no dirty lines of its own). On
    CUDA nothing: the input rotation already exceeds the GPU's L2, and the writes are posted."""
    if device.type != "cpu":
        return lambda: None
    buf = torch.ones(ROTATE_BYTES // 4)
    return lambda: buf.sum()


def _bwd_runner(peer: Peer, pass_: str, xs, rs, dys, dss, device, scrub: Callable[[], None] = lambda: None):
    """fwdbwd: times forward + backward. bwd: builds the graph untimed, scrubs the cache, then
    times the backward alone and returns that duration (a fresh graph each call: no retain_graph,
    which compiled backwards with donated buffers refuse)."""
    k = len(xs)
    leaves = [(x.detach().clone().requires_grad_(), r.detach().clone().requires_grad_())
              for x, r in zip(xs, rs)]

    def forward(j):
        x, r = leaves[j]
        outs = peer.fn(x, r)
        outs = outs if isinstance(outs, tuple) else (outs,)
        grads = (dys[j], dss[j])[: len(outs)]
        inputs = [x, r] if len(outs) == 2 else [x]
        return outs, grads, inputs + peer.params

    def run(i):
        j = i % k
        if pass_ == "fwdbwd":
            outs, grads, inputs = forward(j)
            return torch.autograd.grad(outs, inputs, grads)
        outs, grads, inputs = forward(j)
        scrub()
        _sync(device)
        t0 = time.perf_counter()
        torch.autograd.grad(outs, inputs, grads)
        _sync(device)
        return time.perf_counter() - t0

    return run


# ------------------------------------------------------------------------------------- run


def run_bench(
    *,
    ops=("rms_norm", "layer_norm"),
    backends=("normlab", "torch", "torch-module", "hf", "compile", "liger", "apex"),
    dtypes=("fp32", "bf16"),
    shapes=DEFAULT_SHAPES,
    passes=("fwd", "bwd"),
    allocs=ALLOCS,
    repeat: int = REPEAT,
    warmup: int = 2,
    case_seconds: float = CASE_SECONDS,
    device: str = "cpu",
    progress=None,
    seed: int = 0,
    scrub: bool = True,
    keep_on_ctrl_c: bool = False,
) -> tuple[list[dict], list[str]]:
    """Measure every (op, backend, dtype, shape, pass, alloc) case; returns (records, notes).

    Each case runs in up to ``repeat`` rounds; a case that has had 3 rounds and spent
    ``case_seconds`` sits out the rest (slow peers need fewer samples to be told apart).
    ``scrub=False`` leaves the cache as the last call left it (the method of records before
    the scrub). ``keep_on_ctrl_c``: Ctrl-C returns the groups finished so far, with a note (the
    command line's choice; a caller that judges the records, as the lab does, gets the
    KeyboardInterrupt)."""
    for value, valid, what in ((ops, OPS, "op"), (backends, PEERS, "backend"),
                               (dtypes, tuple(DTYPES), "dtype"),
                               (passes, PASSES, "pass"), (allocs, ALLOCS, "alloc")):
        bad = [v for v in value if v not in valid]
        if bad:
            raise ValueError(f"unknown {what} {', '.join(map(repr, bad))}; choose from {', '.join(valid)}")
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1 (timed rounds per case), got {repeat}")
    if not case_seconds >= 0:
        raise ValueError(f"case_seconds must be a number >= 0, got {case_seconds}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
    parsed = [parse_shape(s) for s in shapes]
    gen = torch.Generator().manual_seed(seed)
    records: list[dict] = []
    notes: list[str] = []
    clear = scrubber(dev) if scrub else (lambda: None)
    groups = [(dt, sh) for dt in dtypes for sh in parsed]
    task = progress.add_task("bench", total=len(groups)) if progress else None
    try:
        for dt, sh in groups:
            if progress:
                progress.update(task, description=f"{dt} {'x'.join(map(str, sh))}")
            records.extend(_measure_group(ops, backends, passes, allocs, dt, sh, dev, gen, clear, warmup,
                                          repeat,
                                          case_seconds, notes))
            if progress:
                progress.advance(task)
    except KeyboardInterrupt:  # the groups measured so far are kept; the one under way is left out
        if not (keep_on_ctrl_c and records):
            raise
        done = len({(r["dtype"], r["shape"]) for r in records})
        notes.append(f"{INTERRUPTED}: {done} of {len(groups)} dtype and shape groups measured, the rest left "
                     "out")
    return records, notes


def _measure_group(ops, backends, passes, allocs, dt: str, sh: tuple, dev, gen, clear, warmup: int,
                   repeat: int,
                   case_seconds: float, notes: list[str]) -> list[dict]:
    """One dtype and shape: every case warmed up, then timed round-robin with the copy."""
    cases, group_notes = _build_group(ops, backends, passes, allocs, dt, sh, dev, gen, clear)
    notes.extend(n for n in group_notes if n not in notes)
    for case in cases:  # warm-up, compilation included
        with torch.set_grad_enabled(case.grad_mode):
            for i in range(warmup):
                case.run(i)
    _sync(dev)
    for i in range(repeat):
        start = i % len(cases)  # each round starts one case later: none always runs right after the same one
        for case in cases[start:] + cases[:start]:
            if len(case.times) >= 3 and sum(case.times) >= case_seconds:
                continue
            with torch.set_grad_enabled(case.grad_mode):
                clear()
                _sync(dev)
                t0 = time.perf_counter()
                result = case.run(warmup + i)
                _sync(dev)
                # a runner that times itself (the backward alone) returns its duration
                case.times.append(result if isinstance(result, float) else time.perf_counter() - t0)
            del result
    return _records(cases, dev)


def _records(cases: list[Case], device: torch.device) -> list[dict]:
    copy = cases[0]
    copy_gbps = copy.nbytes / statistics.median(copy.times) / 1e9
    out = []
    for c in cases:
        ms = statistics.median(c.times) * 1e3
        gbps = c.nbytes / (ms / 1e3) / 1e9
        out.append({
            "op": c.op, "backend": c.backend, "dtype": c.dtype, "shape": c.shape, "pass": c.pass_,
            "alloc": c.alloc,
            "ms": float(f"{ms:.4g}"), "gbps": float(f"{gbps:.4g}"),
            "frac_of_copy": float(f"{gbps / copy_gbps:.3g}"),
            "bytes": c.nbytes, "runs": len(c.times), "device": str(device),
            # one per round, for intervals over rounds
            "times_ms": [float(f"{t * 1e3:.4g}") for t in c.times],
        })
    return out


def write_json(path: str, records: list[dict], env: dict, scrub: bool = True,
               notes: list[str] | None = None, freed_memory: str = "returned") -> None:
    """``method.scrub_bytes``: what was read before each timed call (0: nothing, the method of
    records made before the scrub, which have no ``method``). ``method.grad_mode``: "untimed"
    where autograd's mode is set outside each timed call (Case.grad_mode); records without it
    timed a `torch.no_grad()` block inside each forward. ``notes``: the run's notes (peers left
    out, an interruption), when there are any. ``method.freed_memory``: "kept" when the run
    called keep_freed_memory, else "returned" (glibc's default)."""
    method = {"scrub_bytes": ROTATE_BYTES if scrub else 0, "grad_mode": "untimed",
              "freed_memory": freed_memory}
    runs.write_json(path, {"environment": env, "method": method, "records": records,
                           **({"notes": notes} if notes else {})})
