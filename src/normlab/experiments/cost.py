"""What a training run costs before it runs: parameters, tokens, FLOPs and an estimated GPU time,
for `normlab compare --plan` (so that a cluster job can be budgeted before it is submitted).

FLOPs per training token are Kaplan et al. 2020's (Table 1): 6 N for the non-embedding
parameters' matrix multiplies (forward 2 N, backward 4 N) plus 6 L T d for attention's scores and
weighted sums over a context of T tokens (forward 2 L T d). Evaluation and the LM head's
embedding-sized multiply are left out, as in that count.

The time assumes an H100/H200-class GPU's dense bf16 peak of 989 TFLOP/s (NVIDIA's H100 SXM
datasheet, without sparsity) at a model-FLOPs utilization of 35%: what well-tuned PyTorch
training of ~100M-parameter models reaches (small models reach less; the estimate is a budget,
not a measurement). ``--plan --time-here`` adds the time the runs' training would take on this
machine, from steps of each model timed here (experiments.timing.run_seconds_here).
"""

from __future__ import annotations

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16
MFU = 0.35


def training_flops(parameters: int, n_layers: int, d_model: int, seq_len: int, tokens: int) -> float:
    """6 N D + 6 L T d D (see the module's text)."""
    return 6.0 * parameters * tokens + 6.0 * n_layers * seq_len * d_model * tokens


def gpu_seconds(flops: float, mfu: float = MFU, peak: float = PEAK_FLOPS) -> float:
    return flops / (mfu * peak)


def run_cost(parameters: int, n_layers: int, d_model: int, seq_len: int, steps: int, batch_size: int,
             grad_accum: int = 1) -> dict:
    tokens = steps * batch_size * grad_accum * seq_len
    flops = training_flops(parameters, n_layers, d_model, seq_len, tokens)
    return {"parameters": parameters, "tokens": tokens, "flops": flops, "gpu_s": gpu_seconds(flops)}


def print_costs(pending: list, console, here_threads: int | None = None) -> None:
    """Each planned run's parameters, tokens, training FLOPs and estimated GPU time, and each
    preset's totals (normlab.experiments.cost says how they are counted). With ``here_threads``,
    also the time measured here (``run.cost["here_s"]``, experiments.timing.run_seconds_here; "not
    timed": a resumed run, or a model too large for this machine, left out of the totals)."""
    from rich.table import Table

    here = here_threads is not None
    table = Table(title=f"cost (FLOPs: 6ND + 6LTdD; GPU time at {MFU:.0%} MFU of {PEAK_FLOPS / 1e12:.0f} "
                        "TFLOP/s, an H100/H200-class GPU"
                        + (f"; here: training only, one run at a time on {here_threads} threads, from "
                           "steps timed on this machine" if here else "") + ")")
    for col in ("preset", "run", "parameters", "tokens", "FLOPs", "GPU time") + (("here",) if here else ()):
        table.add_column(col)
    totals: dict[str, list[float]] = {}
    for run in pending:
        c = run.cost
        if not c:
            continue
        here_s = c.get("here_s")
        table.add_row(run.preset, run.label, f"{c['parameters']:,}", f"{c['tokens']:,}", f"{c['flops']:.3g}",
                      _duration(c["gpu_s"]), *((_duration(here_s) if here_s is not None else "not timed",)
                                               if here else ()))
        t = totals.setdefault(run.preset, [0, 0.0, 0.0, 0.0])
        t[0], t[1], t[2], t[3] = t[0] + 1, t[1] + c["flops"], t[2] + c["gpu_s"], t[3] + (here_s or 0.0)
    rows = list(totals.items())
    if len(totals) > 1:
        rows.append(("all", [sum(t[i] for t in totals.values()) for i in range(4)]))
    for preset, (n, flops, seconds, here_total) in rows:
        table.add_row(f"[bold]{preset}[/bold]", f"[bold]total of {n} runs[/bold]", "", "",
                      f"[bold]{flops:.3g}[/bold]", f"[bold]{_duration(seconds)}[/bold]",
                      *((f"[bold]{_duration(here_total)}[/bold]",) if here else ()))
    console.print(table)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.2g} s"
    return f"{seconds / 60:.3g} min" if seconds < 7200 else f"{seconds / 3600:.3g} h"
