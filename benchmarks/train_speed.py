"""Training tokens/s of a preset with normlab's fused norms against the same model with torch's
own nn.RMSNorm / nn.LayerNorm, in one run (interleaved, median step time).

    python benchmarks/train_speed.py [--preset small] [--batch 16] [--steps 20] [--rounds 3]

Each round trains every variant for --steps AdamW steps on random tokens (the model's speed,
not the data pipeline's); the first 3 steps of a round are warm-up.
"""

import argparse
import statistics
import time

import torch

from normlab.env import environment
from normlab.model import Decoder, ModelConfig

VARIANTS = [("rmsnorm", "normlab"), ("rmsnorm", "torch"), ("layernorm", "normlab"), ("layernorm", "torch")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    models = {}
    for norm, impl in VARIANTS:
        torch.manual_seed(0)
        m = Decoder(ModelConfig.preset(args.preset, norm=norm, norm_impl=impl))
        models[(norm, impl)] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4))
    cfg = next(iter(models.values()))[0].cfg
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.max_seq_len + 1), generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]
    times = {k: [] for k in models}
    for _ in range(args.rounds):
        for key, (m, opt) in models.items():
            for step in range(args.steps):
                t0 = time.perf_counter()
                _, loss = m(x, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if step >= 3:
                    times[key].append(time.perf_counter() - t0)
    env = environment()
    tokens = args.batch * cfg.max_seq_len
    print(f"{env['date']}  {env['processor']}, {env['torch_threads']} threads, torch {env['torch']}, numba "
          f"{env.get('numba')}")
    print(f"preset {args.preset}: {Decoder(cfg).num_parameters():,} parameters, batch {args.batch} x "
          f"{cfg.max_seq_len} tokens")
    print(f"{'norm':<10} {'implementation':<15} {'step ms':>8} {'tokens/s':>9}")
    base = {}
    for (norm, impl), ts in times.items():
        ms = statistics.median(ts) * 1e3
        base.setdefault(norm, {})[impl] = ms
        print(f"{norm:<10} {impl:<15} {ms:8.1f} {tokens / ms * 1e3:9.0f}")
    for norm, d in base.items():
        print(f"{norm}: normlab trains {d['torch'] / d['normlab']:.2f}x as fast as torch's module")


if __name__ == "__main__":
    main()
