"""What a training run costs before it runs: parameters, tokens, FLOPs and an estimated GPU time,
for `normlab compare --plan` (so that a cluster job can be budgeted before it is submitted).

FLOPs per training token are Kaplan et al. 2020's (Table 1): 6 N for the non-embedding
parameters' matrix multiplies (forward 2 N, backward 4 N) plus 6 L T d for attention's scores and
weighted sums over a context of T tokens (forward 2 L T d). Evaluation and the LM head's
embedding-sized multiply are left out, as in that count.

The time assumes an H100/H200-class GPU's dense bf16 peak of 989 TFLOP/s (NVIDIA's H100 SXM
datasheet, without sparsity) at a model-FLOPs utilization of 35%: what well-tuned PyTorch
training of ~100M-parameter models reaches (small models reach less; the estimate is a budget,
not a measurement).
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


def print_costs(pending: list, console) -> None:
    """Each planned run's parameters, tokens, training FLOPs and estimated GPU time, and each
    preset's totals (normlab.experiments.cost says how they are counted)."""
    from rich.table import Table

    table = Table(title=f"cost (FLOPs: 6ND + 6LTdD; GPU time at {MFU:.0%} MFU of {PEAK_FLOPS / 1e12:.0f} "
                        "TFLOP/s, an H100/H200-class GPU)")
    for col in ("preset", "run", "parameters", "tokens", "FLOPs", "GPU time"):
        table.add_column(col)
    totals: dict[str, list[float]] = {}
    for run in pending:
        c = run.cost
        if not c:
            continue
        table.add_row(run.preset, run.label, f"{c['parameters']:,}", f"{c['tokens']:,}", f"{c['flops']:.3g}",
                      _duration(c["gpu_s"]))
        t = totals.setdefault(run.preset, [0, 0.0, 0.0])
        t[0], t[1], t[2] = t[0] + 1, t[1] + c["flops"], t[2] + c["gpu_s"]
    for preset, (n, flops, seconds) in totals.items():
        table.add_row(f"[bold]{preset}[/bold]", f"[bold]total of {n} runs[/bold]", "", "",
                      f"[bold]{flops:.3g}[/bold]",
                      f"[bold]{_duration(seconds)}[/bold]")
    if len(totals) > 1:
        table.add_row("[bold]all[/bold]", "", "", "",
                      f"[bold]{sum(t[1] for t in totals.values()):.3g}[/bold]",
                      f"[bold]{_duration(sum(t[2] for t in totals.values()))}[/bold]")
    console.print(table)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.2g} s"
    return f"{seconds / 60:.3g} min" if seconds < 7200 else f"{seconds / 3600:.3g} h"
