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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    console = Console()
    try:
        return int(args.func(args, console) or 0)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
