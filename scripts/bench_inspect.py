#!/usr/bin/env python3
"""What caching every hook point costs: `model(ids)` against `model.run_with_cache(ids)` on the same ids.

    python scripts/bench_inspect.py [--weights DIR] [--tokens 1024] [--repeats 5]

Alternating runs in one process, medians; the table names the CPU. Default weights: the full-size random fixture
(GPT-2-small's shape; the time of a forward does not depend on the values).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fixtures  # noqa: E402

from gpt2_engine import GPT2  # noqa: E402
from gpt2_engine.core.kernels import cpu  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", type=Path, help="checkpoint directory (default: the full-size fixture)")
    p.add_argument("--tokens", type=int, default=1024, help="prompt length (default 1024)")
    p.add_argument("--repeats", type=int, default=5, help="alternating repeats; medians are reported (default 5)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = GPT2.from_pretrained(args.weights or fixtures.ensure("small"))
    if not 1 <= args.tokens <= model.config.n_positions:
        p.error(f"--tokens must be in 1..{model.config.n_positions}")
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    plain, cached, nbytes = [], [], 0
    model(ids), model.run_with_cache(ids)  # warm up
    for _ in range(args.repeats):
        t = time.perf_counter()
        model(ids)
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        _, cache = model.run_with_cache(ids)
        cached.append(time.perf_counter() - t)
        nbytes = cache.nbytes()
        del cache
    a, b = statistics.median(plain), statistics.median(cached)
    print(f"# {cpu().summary()}, {args.threads} threads, torch {torch.__version__}")
    print(f"# {model.config.n_layer} layers, {args.tokens} tokens, {args.repeats} alternating repeats, medians")
    print("| run | seconds | vs plain |")
    print("|---|---|---|")
    print(f"| model(ids) | {a:.3f} | 1.00x |")
    print(f"| run_with_cache(ids), all {len(cache_names(model))} hook points | {b:.3f} | {b / a:.2f}x |")
    print(f"cache: {nbytes / 2**20:,.0f} MiB ({nbytes / args.tokens / 2**10:,.0f} KiB per token)")
    return 0


def cache_names(model: GPT2) -> list[str]:
    from gpt2_engine.interp.hooks import hook_names

    return hook_names(model.config)


if __name__ == "__main__":
    sys.exit(main())
