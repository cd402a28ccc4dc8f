"""The ``normlab`` command (also ``python -m normlab``)."""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys

from rich.console import Console
from rich.table import Table


def _version_of(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except ImportError:
        return None


def info_rows() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """(software versions, backends with their status) for ``normlab info``."""
    import torch

    import normlab
    from normlab import kernels

    versions = [
        ("normlab", normlab.__version__),
        ("python", platform.python_version()),
        ("platform", f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"),
    ]
    for module in ("torch", "numpy", "numba", "triton", "transformers", "tokenizers"):
        versions.append((module, _version_of(module) or "not installed"))
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    versions.append(("CUDA device", cuda))
    backends = []
    for name in kernels.BACKENDS:
        reason = kernels.unavailable_reason(name)
        backends.append((name, "available" if reason is None else "unavailable", reason or ""))
    return versions, backends


def cmd_info(args: argparse.Namespace, console: Console) -> int:
    import torch

    from normlab import kernels

    versions, backends = info_rows()
    table = Table(title="normlab info", show_header=False)
    for key, value in versions:
        table.add_row(key, value)
    console.print(table)
    bt = Table(title="backends")
    bt.add_column("backend")
    bt.add_column("status")
    bt.add_column("why not")
    for row in backends:
        bt.add_row(*row)
    console.print(bt)
    picks = [f"CPU tensors -> {kernels.resolve('auto', torch.device('cpu'))}"]
    if torch.cuda.is_available():
        picks.append(f"CUDA tensors -> {kernels.resolve('auto', torch.device('cuda'))}")
    console.print("auto picks: " + "; ".join(picks))
    if kernels.unavailable_reason("cpu") is None:
        from normlab.kernels import cpu

        status = cpu.cache_status()
        state = "warm" if status["warm"] else "cold (the first call of each kernel compiles it, then caches it)"
        console.print(f"numba cache: {state}; {status['dir']}")
    return 0


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from normlab import bench

    backends = _csv(args.backends)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} groups"),
                  TimeElapsedColumn(), console=console, disable=args.quiet) as progress:
        records, notes = bench.run_bench(
            ops=_csv(args.ops), backends=backends, dtypes=_csv(args.dtypes), shapes=_csv(args.shapes),
            passes=_csv(args.passes), allocs=_csv(args.alloc), repeat=args.repeat, device=args.device, progress=progress,
            case_seconds=args.case_seconds,
        )
    env = bench.environment()
    if args.json:
        bench.write_json(args.json, records, env)
    table = Table(title=f"normlab bench: {env['processor']}, {env['torch_threads']} threads, torch {env['torch']}")
    for col in ("op", "pass", "alloc", "dtype", "shape", "backend", "ms", "GB/s", "x copy", "x normlab"):
        table.add_column(col, justify="right" if col in ("ms", "GB/s", "x copy", "x normlab") else "left")
    for r in bench.summary_rows(records):
        style = "bold green" if r["backend"] == "normlab" else ("dim" if r["op"] == "copy" else None)
        xn = "" if r["x_normlab"] is None else f"{r['x_normlab']:.2f}"
        table.add_row(r["op"], r["pass"], r["alloc"], r["dtype"], r["shape"], r["backend"], f"{r['ms']:.3f}",
                      f"{r['gbps']:.1f}", f"{r['frac_of_copy']:.2f}", xn, style=style)
    console.print(table)
    console.print("x copy: GB/s as a fraction of y.copy_(x) on the same tensor in the same run; "
                  "x normlab: time / normlab's allocating call (> 1: normlab is faster)")
    for note in notes:
        console.print(f"[dim]{note}[/dim]")
    if args.json:
        console.print(f"records written to {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from normlab import __version__

    parser = argparse.ArgumentParser(
        prog="normlab",
        description="Normalization layers for transformer LMs: fused kernels and a lab that reproduces the claims.",
    )
    parser.add_argument("--version", action="version", version=f"normlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("info", help="versions, and which backends run on this machine (and why not the others)")
    p.set_defaults(func=cmd_info)

    from normlab import bench

    p = sub.add_parser("bench", help="kernel speed in GB/s against a memory copy and against peers",
                       description=(bench.__doc__ or "").split("\n\n")[0])
    p.add_argument("--ops", default="rms_norm,layer_norm", help=f"comma-separated, from {','.join(bench.OPS)}")
    p.add_argument("--backends", default="normlab,torch,torch-module,hf,compile,liger,apex",
                   help=f"comma-separated, from {','.join(bench.PEERS)} (peers that cannot run are skipped with a note)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, from fp32,bf16,fp16")
    p.add_argument("--shapes", default=",".join(bench.DEFAULT_SHAPES), help="comma-separated ROWSxHIDDEN")
    p.add_argument("--passes", default="fwd,bwd", help="comma-separated, from fwd,bwd,fwdbwd")
    p.add_argument("--alloc", default="alloc,prealloc", help="alloc (the call users make), prealloc (into out=)")
    p.add_argument("--repeat", type=int, default=10, help="timed rounds per case (median reported)")
    p.add_argument("--case-seconds", type=float, default=1.0,
                   help="a case that has run 3 rounds and this many seconds sits out the rest")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu", help="cpu or cuda")
    p.add_argument("--json", metavar="PATH", help="write one record per measurement to PATH")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)
    return parser


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        return int(args.func(args, console) or 0)
    except ValueError as err:  # bad option values: say what was wrong, no traceback
        console.print(f"[red]error:[/red] {err}")
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
