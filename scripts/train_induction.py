#!/usr/bin/env python3
"""Train a 2-layer GPT-2 to copy a repeated run of tokens, and write it in the official layout.

    python scripts/train_induction.py DIR [--steps N] [--seed S]

Each training sequence is <|endoftext|>, a random prefix of 0..PREFIX tokens, then a run of RUN_LENGTHS distinct
random tokens, twice, then random filler up to SEQ tokens; all drawn from POOL, 200 ordinary token ids. The loss is
taken only where the second run can be predicted (its second token onwards). Varied run lengths and prefixes keep the
model from solving the task with a fixed positional offset.

It trains on a vocabulary of POOL + <|endoftext|> only (the full vocabulary's embedding and its optimizer state
would be most of every step), then writes an ordinary full-vocabulary GPT-2: the trained rows at their token ids, and
every other row at the initialisation's scale, far below the trained rows' (the held-out loss printed at the end is
over the full vocabulary).

The inspection tests (tests/test_inspect.py) find, with the engine's tools alone, which heads the copying depends on.
Trained by transformers' GPT2LMHeadModel with a plain torch loop, independent of the engine; deterministic for a
seed on a given machine; about two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixture import write_trained  # noqa: E402

SHAPE = dict(n_layer=2, n_head=4, n_embd=128, n_positions=64)
SEQ = 64  # the longest sequence (1 + 12 + 2 * 20) and random filler after it
POOL = torch.arange(1000, 1200)  # 200 ordinary BPE tokens
PREFIX = 12
RUN_LENGTHS = (4, 20)  # inclusive
EOT = 50256
BATCH = 64
TARGET_LOSS = 0.15  # training stops once the moving average of the second-run loss is below this (nats)


def batch(g: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [size, SEQ], scored [size, SEQ] bool: True where the NEXT token is a predictable second-run token)."""
    ids = POOL[torch.randint(0, len(POOL), (size, SEQ), generator=g)]  # filler everywhere, then overwritten
    scored = torch.zeros(size, SEQ, dtype=torch.bool)
    ids[:, 0] = EOT
    for b in range(size):
        n = int(torch.randint(RUN_LENGTHS[0], RUN_LENGTHS[1] + 1, (1,), generator=g))
        start = 1 + int(torch.randint(0, PREFIX + 1, (1,), generator=g))  # first token of the first run
        run = POOL[torch.randperm(len(POOL), generator=g)[:n]]
        ids[b, start : start + n] = run
        ids[b, start + n : start + 2 * n] = run
        scored[b, start + n : start + 2 * n - 1] = True  # predicting the second run's tokens 2..n
    return ids, scored


def second_run_loss(logits: torch.Tensor, ids: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL over the scored positions; logits [B, SEQ, V] over the full vocabulary."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)  # [B, SEQ - 1, V]
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]  # [B, SEQ - 1]
    return nll[scored[:, :-1]].mean()


def train(steps: int, seed: int, log=print):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    vocab = torch.cat([POOL, torch.tensor([EOT])])  # the training vocabulary, as full-vocabulary ids
    column = torch.full((EOT + 1,), -1, dtype=torch.long)
    column[vocab] = torch.arange(len(vocab))  # full id -> training id
    config = GPT2Config(**SHAPE, vocab_size=len(vocab), n_ctx=SEQ, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    model = GPT2LMHeadModel(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    t0 = time.perf_counter()
    for step in range(steps):
        ids, scored = batch(g, BATCH)
        ids = column[ids]  # [B, SEQ] training ids
        h = model.transformer(ids).last_hidden_state  # [B, SEQ, C], after ln_f
        logits = model.lm_head(h[:, :-1][scored[:, :-1]])  # [N, |vocab|]: only the scored positions
        loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:][scored[:, :-1]])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        smooth = loss.item() if step == 0 else 0.9 * smooth + 0.1 * loss.item()
        if step % 100 == 0 or step == steps - 1 or smooth < TARGET_LOSS:
            log(f"step {step + 1}/{steps}: second-run loss {smooth:.3f} (moving average) ({time.perf_counter() - t0:.0f} s)")
        if smooth < TARGET_LOSS:
            break
    full = GPT2LMHeadModel(GPT2Config(**SHAPE, n_ctx=SEQ)).eval()  # full vocabulary, initialised rows everywhere
    state = model.state_dict()
    with torch.no_grad():
        wte = full.transformer.wte.weight.clone()
        wte[vocab] = state["transformer.wte.weight"]
        state["transformer.wte.weight"] = state["lm_head.weight"] = wte
        full.load_state_dict(state)
        ids, scored = batch(torch.Generator().manual_seed(seed + 1), 256)
        loss = second_run_loss(full(ids).logits, ids, scored)
    log(f"held-out second-run loss (full vocabulary): {loss:.4f} nats")
    return full


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where to write the checkpoint (created; replaced only when done)")
    parser.add_argument("--steps", type=int, default=3000,
                        help=f"optimizer steps of {BATCH} sequences at most; training stops earlier once the second-run "
                             f"loss is below {TARGET_LOSS} nats (default 3000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = train(args.steps, args.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    write_trained(args.directory, SHAPE, model)
    print(f"wrote a 2-layer copying GPT-2 checkpoint to {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
