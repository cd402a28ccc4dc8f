"""``normlab compare``: one comparison, the size ladder (with its tokenizer conditions), the
pilot (--tune) and the plan (--plan); experiments/ holds the presets and the Lab, report.py the
report."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape


def key_values(items: list[str]) -> dict:
    """key=value command-line items as a dict (values stay strings: the configs parse them)."""
    pairs = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        pairs[key.strip()] = value.strip()
    return pairs


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_compare(args: argparse.Namespace, console: Console) -> int:
    from normlab import experiments

    names = [a for a in args.items if "=" not in a]
    overrides = key_values([a for a in args.items if "=" in a])
    if not names:
        raise ValueError(f"name a preset: {', '.join(list(experiments.PRESETS) + list(experiments.GROUPS))}")
    experiments.expand(names)  # an unknown preset fails here, before any note
    if sum((args.plan, args.collect, args.jobs > 1)) > 1:
        raise ValueError("--plan, --collect and --jobs N are alternatives: plan the runs, collect them, or "
                         "train them here N at a time")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    if getattr(args, "time_here", False) and not args.plan:
        raise ValueError("--time-here estimates the runs of a plan: add --plan")
    from normlab.experiments.design import PILOT_SEEDS

    if args.seed_start < 0:
        raise ValueError(f"--seed-start must be 0 or more, got {args.seed_start}")
    if args.seed_start and args.tune:
        raise ValueError("--seed-start picks the test seeds; the pilot (--tune) trains at its own seeds "
                         f"{', '.join(map(str, PILOT_SEEDS))}")
    settings = experiments.Settings(out=args.out, size="quick" if args.quick else args.size, seeds=args.seeds,
                                    seed_start=args.seed_start, data=args.data, steps=args.steps,
                                    overrides=overrides, quiet=args.quiet,
                                    lrs=experiments.parse_lrs(args.lrs),
                                    per_claim=args.per_claim, design=args.design,
                                    tune_arms=_arm_patterns(args))
    command = _compare_argv(args)
    if args.tokenizers and not args.ladder:
        raise ValueError("--tokenizers is a condition of the ladder: add --ladder (or set tokenizer=... for "
                         "every run)")
    if args.ladder:
        return _ladder(args, names, settings, command, console)
    if args.tune:
        return _tune(names, settings, command, console)
    if args.plan:
        return _plan(args, settings, command)
    if settings.size in ("full", "gpu") and "demo" not in names and not cuda() and not args.collect:
        console.print(f"[yellow]note:[/yellow] {settings.size} sizes on a CPU take "
                      f"{'hours' if settings.size == 'full' else 'days'}; --plan prints what each run costs; "
                      "--quick fits 2 cores in minutes (finished runs are kept either way: stop with Ctrl-C "
                      "and rerun to resume)")
    return _compare_once(args, names, settings, command, console)


def _arm_patterns(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--arms: the comma-separated arm patterns --tune pilots (None: every arm)."""
    if args.arms is None:
        return None
    if not args.tune:
        raise ValueError("--arms picks the arms --tune pilots: add --tune")
    patterns = tuple(p.strip() for p in args.arms.split(",") if p.strip())
    if not patterns:
        raise ValueError(f"--arms must name at least one arm or pattern (e.g. 'derf*'), got {args.arms!r}")
    return patterns


def _compare_once(args: argparse.Namespace, names: list[str], settings, command: str, console: Console,
                  results_file: str = "results.json", render_to: Path | None = None) -> int:
    """Train (here, or --jobs N at a time) or --collect, then measure, judge and report."""
    from normlab import experiments, report

    render_to = render_to or Path(args.out)
    try:
        if args.jobs > 1:
            from normlab.experiments import sweep

            pending = experiments.plan_presets(names, settings)
            failed = sweep.execute(pending, args.jobs, Path(args.out) / "logs", console, args.quiet)
            for run, log in failed:
                console.print(f"[red]failed:[/red] {run.label}: see {log}")
            settings.mode = "collect"
        elif args.collect:
            settings.mode = "collect"
        results = experiments.run_presets(names, settings, console, command=command,
                                          results_file=results_file)
    except experiments.RunsMissing as err:
        console.print(f"[yellow]{len(err.pending)} training run(s) have not finished[/yellow] (nothing was "
                      "trained: --collect only measures and writes what has finished):")
        for run in err.pending:
            console.print(f"  {run.label}  ({run.folder})")
        console.print(f"Train them with the command lines of `{command} --plan`, or run `{command}` to train "
                      "them here.")
        if err.results["presets"]:
            report.render(err.results, render_to)
        return 1
    except (experiments.Interrupted, KeyboardInterrupt) as err:
        return _interrupted(err, args.out, console)
    _print_verdicts(results, experiments.expand(names), report.render(results, render_to), render_to, console)
    return 0


def _ladder(args: argparse.Namespace, names: list[str], settings, command: str, console: Console) -> int:
    """--ladder: each rung as its own compare (results-rung<i>.json, a report in rung<i>/), the
    runs shared in one --out, then the trend claims (ladder.json, ladder.md, plots)."""
    import dataclasses

    from normlab import experiments, ladder_report
    from normlab.experiments import ladder

    if args.tune:
        raise ValueError("--tune runs at the preset's own size; --ladder transfers its learning rates "
                         f"({ladder.LR_RULE})")
    conditions = _tokenizers(args, settings)
    runs = [(rung, c, dataclasses.replace(settings, rung=rung,
                                          overrides=ladder.condition_overrides(c, settings.overrides))
             if c else dataclasses.replace(settings, rung=rung)) for c in conditions
            for rung in range(len(ladder.WIDTHS))]
    if args.plan:
        pending = [run for _, _, s in runs for run in experiments.plan_presets(names, s)]
        for run in pending:
            print(run.command)
        print(f"{command} --collect")
        notes = Console(stderr=True)
        _costs(pending, notes, args)
        _plan_note(pending, notes, args.out)
        return 0
    for rung, c, rung_settings in runs:
        suffix = _suffix(c)
        console.print(f"[bold magenta]ladder rung {rung}: d_model x{ladder.WIDTHS[rung]:g}"
                      f"{f', {c} tokens' if c else ''}[/bold magenta]")
        rc = _compare_once(args, names, rung_settings, command, console,
                           results_file=experiments.rung_file(rung, suffix),
                           render_to=Path(args.out) / f"rung{rung}{'-' + suffix if suffix else ''}")
        if rc:
            return rc
    suffixes = tuple(dict.fromkeys(_suffix(c) for c in conditions))
    paths = ladder_report.render_ladder(
        experiments.ladder_results(names, args.out, settings.per_claim, suffixes), args.out)
    console.print(f"ladder: {paths['html']} and {paths['markdown'].name} (trend claims), ladder.json "
                  f"and plots in {args.out}")
    return 0


def _suffix(condition: str | None) -> str | None:
    """A tokenizer condition's suffix on its rung files: none for characters, the presets' own."""
    return None if condition in (None, "char") else condition


def _tokenizers(args: argparse.Namespace, settings) -> list[str | None]:
    """--tokenizers: the ladder's tokenizer conditions (None: the runs' own tokenizer, one condition)."""
    from normlab.experiments import ladder

    if not args.tokenizers:
        return [None]
    names = [t.strip() for t in args.tokenizers.split(",") if t.strip()]
    bad = [t for t in names if t not in ladder.TOKENIZERS]
    if bad or not names:
        raise ValueError(f"--tokenizers takes a comma-separated list of {', '.join(ladder.TOKENIZERS)}; got "
                         f"{args.tokenizers!r}")
    if "tokenizer" in settings.overrides:
        raise ValueError("--tokenizers sets each condition's tokenizer: drop tokenizer=... or --tokenizers")
    return list(dict.fromkeys(names))


def _compare_argv(args: argparse.Namespace) -> str:
    """The compare command as typed, normalized (quoted for a shell), without --plan/--collect/--jobs."""
    import shlex

    flags = [x for k, v in (("seeds", args.seeds), ("data", args.data), ("steps", args.steps),
                            ("lrs", args.lrs), ("out", args.out))
             if v is not None for x in (f"--{k}", str(v))]
    flags += ["--seed-start", str(args.seed_start)] if getattr(args, "seed_start", 0) else []
    flags += (["--quick"] if args.quick else []) + (["--size", args.size] if args.size != "full" else [])
    flags += ["--per-claim"] if args.per_claim else []
    flags += ["--design", args.design] if args.design else []
    flags += ["--ladder"] if getattr(args, "ladder", False) else []
    flags += ["--tokenizers", args.tokenizers] if getattr(args, "tokenizers", None) else []
    return shlex.join(["normlab", "compare", *args.items, *flags])


def _interrupted(err: BaseException, out: str, console: Console) -> int:
    """Ctrl-C (or a run stopped by a signal): say what is kept and how to resume; exit 130."""
    if isinstance(err, KeyboardInterrupt):
        console.print(f"[yellow]interrupted.[/yellow] Finished runs and measurements are kept in {out}: "
                      "run the same command again to resume.")
    else:
        console.print(f"[yellow]interrupted:[/yellow] {escape(str(err))}. Finished runs are kept: run the "
                      "same command again to resume.")
    return 130


def _tune(names: list[str], settings, command: str, console: Console) -> int:
    """--tune: the pilot runs, then each arm's learning rate and each preset's seeds."""
    from rich.table import Table

    from normlab import experiments

    try:
        design = experiments.tune_presets(names, settings, console, command=f"{command} --tune")
    except (experiments.Interrupted, KeyboardInterrupt) as err:
        return _interrupted(err, settings.out, console)
    from normlab.experiments.lab import design_key
    from normlab.train import split_overrides

    size = "quick" if "demo" in names and settings.size != "tiny" else settings.size  # demo implies quick
    size = design_key(size, split_overrides(settings.overrides)[0])  # and the tokenizer, where not characters
    table = Table(title="pilot: each arm's learning rate (seeds "
                        f"{', '.join(map(str, design[size]['pilot_seeds']))})")
    for col in ("preset", "arm", "learning rate", "grid", "mean pilot loss"):
        table.add_column(col)
    for arm, a in design[size]["arms"].items():
        losses = ", ".join("-" if v is None else f"{v:.4g}" for v in a["mean_loss"])
        table.add_row(a["preset"], arm, f"{a['lr']:g}" + (" (edge)" if a["at_edge"] else ""),
                      ", ".join(f"{x:g}" for x in a["grid"]),
                      losses)
    console.print(table)
    for preset, s in design[size]["seeds"].items():
        for p in s["pairs"]:
            console.print(f"{preset}: {p['a']} vs {p['b']} within {p['margin']:.0%}: pilot spread "
                          f"{p['pilot_sd_log_ratio'] or 0:.2%}, {p['seeds']} seeds for {p['power']:.0%} "
                          f"power at {p['alpha_per_test']:.2g} per test")
    console.print(f"design: {Path(settings.out) / 'design.json'} (commit it as "
                  "src/normlab/experiments/design.json, or pass --design to use it)")
    return 0


def _plan(args: argparse.Namespace, settings, command: str) -> int:
    """--plan: the `normlab train` lines on stdout (one run each, for a job array or GNU parallel),
    then the line that collects; what they are goes to stderr."""
    from normlab import experiments

    notes = Console(stderr=True)
    pending = experiments.plan_presets([a for a in args.items if "=" not in a], settings)
    for run in pending:
        print(run.command)
    print(f"{command} --collect")
    _costs(pending, notes, args)
    _plan_note(pending, notes, args.out)
    return 0


def _plan_note(pending: list, notes: Console, out: str) -> None:
    if not pending:  # gradients, precision, eps, stability, speed: measurements only
        notes.print(f"Nothing to train: these presets measure without training runs. The last line measures "
                    f"them, judges the claims and writes the report into {out}.")
        return
    notes.print(f"{len(pending)} training run(s) to train (one `normlab train` line each), then the line "
                f"that collects the results into {out}: measurements, verdicts and the report.")


def _costs(pending: list, console: Console, args: argparse.Namespace) -> None:
    """The plan's cost table; with --time-here, each run's training time measured here."""
    from normlab.experiments import cost

    if not getattr(args, "time_here", False):
        cost.print_costs(pending, console)
        return
    import torch
    from rich.progress import Progress

    from normlab.experiments import timing

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("timing each model's steps here", total=None)
        seconds = timing.run_seconds_here([run.argv for run in pending],
                                          lambda done, total: bar.update(task, completed=done, total=total))
    for run, s in zip(pending, seconds):
        run.cost["here_s"] = s
    cost.print_costs(pending, console, here_threads=torch.get_num_threads())


def _print_verdicts(results: dict, done: list[str], paths: dict, out: str, console: Console) -> None:
    from rich.table import Table

    family = next((s.get("family") for n, s in results["presets"].items() if n in done and s.get("family")),
                  None) or {}
    how = (f"family-wise: Holm over {family.get('size')} tests at 5%" if family.get("method") == "holm"
           else "per claim, unadjusted for the number of claims")
    table = Table(title=f"claims (verdicts computed from the numbers by each claim's rule; {how})")
    for col in ("preset", "claim", "verdict", "alone (95%)"):
        table.add_column(col)
    colours = {"holds": "green", "does not hold": "red", "inconclusive": "yellow"}
    for name, section in results["presets"].items():
        if name in done:
            for c in section["claims"]:
                alone = c.get("verdict_plain", c["verdict"])
                table.add_row(name, c["claim"], f"[{colours[c['verdict']]}]{c['verdict']}[/]",
                              f"[{colours[alone]}]{alone}[/]")
    console.print(table)
    console.print(f"report: {paths['html']} (and report.md, results.json, plots) in {out}")
