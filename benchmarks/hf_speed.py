"""Training and decoding time of transformers models with and without normlab's norms, in one process.

    python benchmarks/hf_speed.py [--archs llama,gemma2] [--dtypes fp32,bf16] [--hidden 1024] [--layers 4]
                                  [--batch 2] [--seq 256] [--rounds 5] [--decode 32] [--json PATH]

Random-weight models from the transformers configs (normlab.hf.tiny_model at the given size;
nothing is downloaded). Each round times one forward+backward unpatched and one patched (then
with fuse_residual), alternating, so a drifting machine does not favour either; medians reported.
Then, with ``--decode N`` (0: skip), the same models in eval mode generate N tokens greedily after
a 16-token prompt (batch 1, KV cache): one row of each norm per token, where a call's fixed cost
is most of its time; the time per token, the modes alternating in each round as above.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from normlab import hf
from normlab.env import environment


def step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()


def interleaved(model, timed, rounds: int) -> dict[str, float]:
    """The median of ``timed()`` (milliseconds) for the model unpatched, patched and patched with
    fuse_residual, the three alternating within each round after one warm-up call each."""
    modes = {"unpatched": lambda: hf.unpatch(model), "patched": lambda: (hf.unpatch(model), hf.patch(model)),
             "patched+fused": lambda: (hf.unpatch(model), hf.patch(model, fuse_residual=True))}
    times = {m: [] for m in modes}
    for setup in modes.values():  # warm-up
        setup()
        timed()
    for _ in range(rounds):
        for mode, setup in modes.items():
            setup()
            times[mode].append(timed())
    hf.unpatch(model)
    return {m: statistics.median(t) for m, t in times.items()}


def _speedups(ms: dict[str, float]) -> dict:
    return {"speedup": round(ms["unpatched"] / ms["patched"], 3),
            "speedup_fused": round(ms["unpatched"] / ms["patched+fused"], 3)}


def measure(arch: str, dtype: torch.dtype, args) -> dict:
    model = hf.tiny_model(arch, hidden=args.hidden, layers=args.layers, heads=args.heads,
                          ff=args.ff).to(dtype)
    model.train()
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def step_ms() -> float:
        t0 = time.perf_counter()
        step(model, ids)
        return (time.perf_counter() - t0) * 1e3

    ms = interleaved(model, step_ms, args.rounds)
    return {"arch": arch, "dtype": str(dtype).replace("torch.", ""),
            **{f"{m}_ms": round(v, 1) for m, v in ms.items()}, **_speedups(ms)}


def measure_decode(arch: str, dtype: torch.dtype, args) -> dict:
    model = hf.tiny_model(arch, hidden=args.hidden, layers=args.layers, heads=args.heads,
                          ff=args.ff).to(dtype).eval()
    prompt = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(0))

    def ms_per_token() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=args.decode, min_new_tokens=args.decode, do_sample=False)
        return (time.perf_counter() - t0) * 1e3 / args.decode

    ms = interleaved(model, ms_per_token, args.rounds)
    return {"arch": arch, "dtype": str(dtype).replace("torch.", ""), "decode_tokens": args.decode,
            **{f"{m}_ms_per_token": round(v, 2) for m, v in ms.items()}, **_speedups(ms)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", default="llama,gemma2")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ff", type=int, default=2816)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode", type=int, default=32, help="tokens per timed generation (0: no decode)")
    p.add_argument("--json", help="write the rows and the environment here")
    args = p.parse_args()
    cases = [(arch, {"fp32": torch.float32, "bf16": torch.bfloat16}[name])
             for arch in args.archs.split(",") for name in args.dtypes.split(",")]
    rows, decode = [], []
    for arch, dtype in cases:
        rows.append(measure(arch, dtype, args))
        print(rows[-1], flush=True)
    for arch, dtype in cases if args.decode else ():
        decode.append(measure_decode(arch, dtype, args))
        print(decode[-1], flush=True)
    print("| arch | dtype | unpatched ms | patched ms | patched+fused ms | speedup | speedup fused |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arch']} | {r['dtype']} | {r['unpatched_ms']} | {r['patched_ms']} | "
              f"{r['patched+fused_ms']} | {r['speedup']:.2f} | {r['speedup_fused']:.2f} |")
    if decode:
        print("\n| arch | dtype | unpatched ms/token | patched ms/token | patched+fused ms/token | speedup | "
              "speedup fused |")
        print("|---|---|---|---|---|---|---|")
        for r in decode:
            print(f"| {r['arch']} | {r['dtype']} | {r['unpatched_ms_per_token']} | "
                  f"{r['patched_ms_per_token']} | {r['patched+fused_ms_per_token']} | {r['speedup']:.2f} | "
                  f"{r['speedup_fused']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "args": vars(args), "rows": rows, "decode": decode}, f,
                      indent=1)


if __name__ == "__main__":
    main()
