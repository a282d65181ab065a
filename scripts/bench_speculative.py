#!/usr/bin/env python3
"""Speculative decoding against the engine's plain float32 decoding (`make bench-speculative`).

    python scripts/bench_speculative.py [--rounds 3] [--new-tokens 256] [--drafters int4,int8,ngram] [--checkpoints trained,small]

Batch 1, greedy, --new-tokens new tokens (ignore_eos), float32 target. Two sets of prompts: "text" (the opening of
standard-library docstrings: the kind of text the trained checkpoint was trained on) and "quoting" (a docstring,
then its first words again: the continuation quotes the prompt, as in extraction, editing or "repeat the
following" prompts). For each prompt, plain decoding and each drafter (adaptive K) run alternating, --rounds times;
a cell is the median of the decode tokens/s (new tokens after the first, over their time; the prompt's prefill is
the same for both). Every speculative run's token ids are checked against plain decoding's. Prints per prompt and
per set: tokens/s, ratio to plain, acceptance rate, tokens per verify pass; writes JSON. Checkpoints: the trained
one (4 layers, 256 channels, trained on docstrings: drafts are accepted as a real model's would be) and the
full-size random one (GPT-2 small's shape; acceptance is what random weights give).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

SOURCES = [str.join, str.split, dict.get, list.sort, open, sorted, zip, enumerate, isinstance, print]
MODULE_DOCS = ["json.dumps", "os.path.join", "re.sub", "textwrap.dedent", "functools.reduce", "shutil.copyfile"]


def docstrings() -> list[str]:
    import importlib

    found = []
    for name in MODULE_DOCS:
        module, attr = name.rsplit(".", 1)
        found.append(inspect.getdoc(getattr(importlib.import_module(module), attr)) or "")
    return [d for d in found if d]


def prompts(tokenizer, new_tokens: int, context: int) -> dict[str, list[list[int]]]:
    """{'text': openings of docstrings, 'quoting': a docstring then its first words again}, as token ids that leave
    room for new_tokens within the context."""
    docs = docstrings()
    text = [tokenizer.encode(d)[:24] for d in docs[:4]]
    quoting = []
    room = context - new_tokens
    for d in docs[:4]:
        ids = tokenizer.encode(d)[: room - 16]
        quoting.append(ids + tokenizer.encode("\n\n") + ids[:12])
    return {"text": text, "quoting": quoting}


def decode_rate(model, ids: list[int], new_tokens: int, speculate: str | None) -> tuple[float, list[int], object]:
    run = model.generation([ids], max_new_tokens=new_tokens, temperature=0, ignore_eos=True, speculate=speculate)
    out = run.run()[0].token_ids
    return run.stats.decode_tokens_per_second, out, run.stats


def bench(name: str, weights: Path, drafters: list[str], rounds: int, new_tokens: int) -> list[dict]:
    from gpt2_engine import GPT2

    model = GPT2.from_pretrained(weights)
    for d in drafters:
        model.speculation(d)  # the draft models load before the clock
    sets = prompts(model.tokenizer, new_tokens, model.config.n_positions)
    rows = []
    for kind, items in sets.items():
        for p, ids in enumerate(items):
            plain, expected = [], None
            rates: dict[str, list[float]] = {d: [] for d in drafters}
            stats: dict[str, object] = {}
            decode_rate(model, ids, 8, None)  # warm the kernels and the caches
            for _ in range(rounds):
                rate, expected, _ = decode_rate(model, ids, new_tokens, None)
                plain.append(rate)
                for d in drafters:
                    rate, out, st = decode_rate(model, ids, new_tokens, d)
                    if out != expected:
                        raise SystemExit(f"bench-speculative: {name} {kind} prompt {p} with {d}: the tokens differ from "
                                         "plain decoding's")
                    rates[d].append(rate)
                    stats[d] = st
            base = statistics.median(plain)
            row = {"checkpoint": name, "set": kind, "prompt": p, "prompt_tokens": len(ids), "plain": base}
            for d in drafters:
                st = stats[d]
                row[d] = {"tok_s": statistics.median(rates[d]), "ratio": statistics.median(rates[d]) / base,
                          "acceptance": st.acceptance_rate, "tokens_per_verify": st.tokens_per_verify}
            rows.append(row)
            cells = " | ".join(f"{d} {row[d]['tok_s']:.0f} ({row[d]['ratio']:.2f}x, acc {row[d]['acceptance']:.2f}, "
                               f"{row[d]['tokens_per_verify']:.2f}/pass)" for d in drafters)
            print(f"{name:8} {kind:8} #{p} ({len(ids):3} tok) | plain {base:6.0f} tok/s | {cells}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--drafters", default="int4,int8,ngram")
    parser.add_argument("--checkpoints", default="trained,small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "artifacts" / "bench-speculative.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from fixtures import ensure

    from gpt2_engine.core.kernels import cpu

    drafters = args.drafters.split(",")
    print(f"# speculative decoding vs plain float32 decoding | batch 1, greedy, {args.new_tokens} new tokens, "
          f"median of {args.rounds} alternating | {cpu().summary()} | {args.threads} threads | torch {torch.__version__}")
    rows = []
    for name in args.checkpoints.split(","):
        rows += bench(name, ensure(name), drafters, args.rounds, args.new_tokens)
    print("\nper set: geometric mean of the prompts' ratios (lowest prompt)")
    for name in args.checkpoints.split(","):
        for kind in ("text", "quoting"):
            sel = [r for r in rows if r["checkpoint"] == name and r["set"] == kind]
            cells = []
            for d in drafters:
                ratios = [r[d]["ratio"] for r in sel]
                acc = statistics.mean(r[d]["acceptance"] for r in sel)
                cells.append(f"{d} {statistics.geometric_mean(ratios):.2f}x (min {min(ratios):.2f}x, acc {acc:.2f})")
            print(f"{name:8} {kind:8} | " + " | ".join(cells))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cpu": cpu().summary(), "threads": args.threads, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
