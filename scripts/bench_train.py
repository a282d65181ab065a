#!/usr/bin/env python3
"""Training-step speed and memory: the engine's hand-written step against transformers + autograd + torch's AdamW.

    python scripts/bench_train.py [--shapes 4x64,4x512] [--rounds 2] [--steps 2] [--out FILE.json]

One full update (forward, backward, global-norm clipping at 1.0, AdamW) of GPT-2 small (the full-size fixture),
float32, dropout 0, on the same random batches for both sides. Each side runs in its own process (so that its peak
RSS is its own), and the processes alternate engine, transformers, engine, ... for --rounds rounds; a process
times --steps updates after one warm-up update. The table has medians over all timed updates, tokens/s, the ratio
engine / transformers, and each side's peak RSS (the largest over its processes). The CPU is named in the header.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(SCRIPTS.parent))


def batches(B: int, T: int, n: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        rows = torch.randint(0, vocab, (B, T + 1), generator=g)
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def run_engine(weights: Path, B: int, T: int, steps: int) -> list[float]:
    import torch

    from gpt2_engine.core.config import GPT2Config
    from gpt2_engine.core.optim import AdamW, AdamWSettings, clip_factor
    from gpt2_engine.core.training import Buffers, decayed, forward_loss, trainable_copy, zero_, zeros_like
    from gpt2_engine.core.weights import load_weights, named_tensors

    config = GPT2Config.from_json(weights / "config.json")
    w = trainable_copy(load_weights(weights, config), config)
    grads = zeros_like(w, config)
    params, grad_named = named_tensors(w), named_tensors(grads)
    opt = AdamW(params, {n for n in params if decayed(n)}, AdamWSettings(beta2=0.999, weight_decay=0.01))
    buf = Buffers.allocate(config, B, T)
    times = []
    with torch.no_grad():
        for ids, targets in batches(B, T, steps + 1, config.vocab_size):
            t0 = time.perf_counter()
            zero_(grads)
            forward_loss(w, config, buf, ids, targets, grads=grads, grad_scale=1.0 / (B * T))
            _, factor = clip_factor(grad_named, 1.0)
            opt.step(grad_named, 1e-4, factor)
            times.append(time.perf_counter() - t0)
    return times[1:]


def run_transformers(weights: Path, B: int, T: int, steps: int, fused: bool) -> list[float]:
    import torch
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = GPT2LMHeadModel.from_pretrained(weights, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0).train()
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n and "wpe" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "wte" not in n and "wpe" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-4, fused=fused or None)
    V = model.config.vocab_size
    times = []
    for ids, targets in batches(B, T, steps + 1, V):
        t0 = time.perf_counter()
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, V), targets.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


def child(args: argparse.Namespace) -> None:
    B, T = args.shape
    if args.side == "engine":
        times = run_engine(args.weights, B, T, args.steps)
    else:
        times = run_transformers(args.weights, B, T, args.steps, args.fused)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB
    print(json.dumps({"times": times, "peak_rss_mb": rss}))


def shape(text: str) -> tuple[int, int]:
    b, t = text.lower().split("x")
    return int(b), int(t)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4x64,4x512", help="BxT shapes, comma-separated (default 4x64,4x512)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument("--steps", type=int, default=2, help="timed updates per process (default 2)")
    parser.add_argument("--fused", action="store_true", help="transformers side: torch.optim.AdamW(fused=True)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--child", choices=["engine", "transformers"], dest="side", help=argparse.SUPPRESS)
    parser.add_argument("--shape", type=shape, help=argparse.SUPPRESS)
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.side:
        child(args)
        return 0

    import fixtures
    import torch

    from gpt2_engine.core.kernels import cpu

    weights = fixtures.ensure("small")
    threads = args.threads or torch.get_num_threads()
    print(f"# training step, GPT-2 small (124M), float32, dropout 0 | {cpu().summary()} | {threads} threads | "
          f"torch {torch.__version__} | medians of {args.rounds} x {args.steps} updates, alternating")
    rows = []
    for text in args.shapes.split(","):
        B, T = shape(text)
        found: dict[str, dict] = {"engine": {"times": [], "rss": 0.0}, "transformers": {"times": [], "rss": 0.0}}
        for _ in range(args.rounds):
            for side in ("engine", "transformers"):
                cmd = [sys.executable, __file__, "--child", side, "--shape", f"{B}x{T}", "--weights", str(weights),
                       "--steps", str(args.steps)] + (["--fused"] if args.fused else []) + (
                       ["--threads", str(args.threads)] if args.threads else [])
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                found[side]["times"] += r["times"]
                found[side]["rss"] = max(found[side]["rss"], r["peak_rss_mb"])
        e, h = (statistics.median(found[s]["times"]) for s in ("engine", "transformers"))
        row = {"B": B, "T": T, "engine_s": e, "transformers_s": h, "engine_tok_s": B * T / e,
               "transformers_tok_s": B * T / h, "speedup": h / e, "engine_rss_mb": found["engine"]["rss"],
               "transformers_rss_mb": found["transformers"]["rss"],
               "rss_ratio": found["engine"]["rss"] / found["transformers"]["rss"],
               "engine_times": found["engine"]["times"], "transformers_times": found["transformers"]["times"]}
        rows.append(row)
        print(f"B={B} T={T}: engine {row['engine_tok_s']:.0f} tok/s ({e:.2f} s/update), transformers "
              f"{row['transformers_tok_s']:.0f} tok/s ({h:.2f} s) -> {row['speedup']:.2f}x | peak RSS "
              f"{row['engine_rss_mb']:,.0f} MB vs {row['transformers_rss_mb']:,.0f} MB -> {row['rss_ratio']:.2f}x",
              flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu().summary(), "threads": threads, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
