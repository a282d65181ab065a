#!/usr/bin/env python3
"""Train a small GPT-2 on offline text and write it in the exact layout of the official checkpoints.

    python scripts/train_fixture.py DIR [--steps N] [--seed S]

The model has 4 layers, 4 heads, 256 channels, 512 positions and the full 50,257-token vocabulary. It is trained by
transformers' GPT2LMHeadModel with a plain torch loop, independent of the engine, on the docstrings of Python's own
standard library (read from its source files with `ast`, so the text is there on every machine, offline). The last
5% of the documents are held out; the script prints their perplexity. Deterministic for a seed on a given machine.

Why the head is cheap: the head (50,257 x 256 per token) is most of a step's work, while the corpus uses ~4,400
distinct tokens. Every token the corpus never uses shares one learned embedding row u (they are never inputs, and
never targets), so their logits are all h.u and the full softmax's normaliser is sum(exp(used logits)) +
n_unused * exp(h.u): one extra logit, log(n_unused) + h.u, gives the exact full-vocabulary loss at the cost of the
used columns. The written checkpoint has u in every unused row of wte. Evaluation uses the full vocabulary.
"""

from __future__ import annotations

import argparse
import ast
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixture import write_trained  # noqa: E402

SHAPE = dict(n_layer=4, n_head=4, n_embd=256, n_positions=512)
SEQ, BATCH = 512, 1  # 512 tokens a step, at the full context so that every position is trained
HELD_OUT = 0.05
SHARE = 0.3  # of the docstrings, in file order: a narrower corpus, seen for several epochs in the time allowed


def corpus() -> list[str]:
    """The first SHARE of docstrings(): what the model trains on (all but the held-out part)."""
    docs = docstrings()
    return docs[: int(len(docs) * SHARE)]


def unseen() -> list[str]:
    """The docstrings past the SHARE that corpus() takes: never trained on, for quality measurements."""
    docs = docstrings()
    return docs[int(len(docs) * SHARE) :]


def docstrings() -> list[str]:
    """Docstrings (over 200 characters) of the standard library's top-level modules, in file and source order."""
    docs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    # Whitespace folded to single spaces: GPT-2's BPE spends a token on almost every space of an
                    # indented line, and a model this small would otherwise learn mostly indentation.
                    docs.append(" ".join(doc.split()))
    return docs


def encode(docs: list[str]) -> torch.Tensor:
    """One stream of token ids, each document followed by <|endoftext|> as in GPT-2's training data."""
    from gpt2_engine.core.tokenizer import load_tokenizer  # only the BPE: the trainer shares no model code with the engine

    tok = load_tokenizer()
    ids: list[int] = []
    for d in docs:
        ids += tok.encode(d) + [tok.eot_id]
    return torch.tensor(ids)


def split(docs: list[str]) -> tuple[list[str], list[str]]:
    """Every 20th document is held out, so both halves span the whole library."""
    every = round(1 / HELD_OUT)
    return [d for i, d in enumerate(docs) if i % every], [d for i, d in enumerate(docs) if not i % every]


def held_out_perplexity(model, data: torch.Tensor) -> float:
    """exp(mean NLL) over non-overlapping full-vocabulary windows of SEQ tokens."""
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(data) - 1, SEQ):
            x = data[i : i + SEQ + 1][None]
            logits = model(x[:, :-1]).logits
            nll += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
            count += x.shape[1] - 1
    model.train()
    return math.exp(nll / count)


def train(steps: int, seed: int, log=print):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    train_docs, test_docs = split(corpus())
    data, test = encode(train_docs), encode(test_docs)
    used = torch.unique(data)  # [U]
    unused = torch.ones(GPT2Config().vocab_size, dtype=torch.bool)
    unused[used] = False
    log_unused = math.log(int(unused.sum()))  # their share of the normaliser: n_unused * exp(h.u)
    log(f"corpus: {len(data):,} training tokens ({len(used):,} distinct), {len(test):,} held out")

    config = GPT2Config(**SHAPE, n_ctx=SHAPE["n_positions"], attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    model = GPT2LMHeadModel(config).train()
    warmup = max(1, steps // 20)
    wte = model.transformer.wte.weight
    shared = torch.nn.Parameter(torch.zeros(SHAPE["n_embd"]))  # u: the embedding of every unused token
    opt = torch.optim.AdamW([*model.parameters(), shared], lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))))
    t0 = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=g)
        x = torch.stack([data[s : s + SEQ + 1] for s in starts])  # [B, SEQ + 1]
        h = model.transformer(x[:, :-1]).last_hidden_state  # [B, SEQ, C], after ln_f
        logits = torch.cat([h @ wte[used].t(), h @ shared[:, None] + log_unused], -1)  # [B, SEQ, U + 1]
        target = torch.searchsorted(used, x[:, 1:].contiguous())  # index of each target within `used` (sorted by unique)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        smooth = loss.item() if step == 0 else 0.95 * smooth + 0.05 * loss.item()
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step + 1}/{steps}: loss {smooth:.3f} (moving average) ({time.perf_counter() - t0:.0f} s)")
    with torch.no_grad():
        wte[unused] = shared  # the checkpoint is an ordinary GPT-2: every unused row holds u
    ppl = held_out_perplexity(model, test)
    log(f"held-out perplexity (full vocabulary): {ppl:.2f}")
    return model, ppl


def sample_continuation(model, prompt: str = "Return a new") -> str:
    """Greedy continuation of a prompt, decoded, to see what the model learned."""
    from gpt2_engine.core.tokenizer import load_tokenizer

    tok = load_tokenizer()
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                                    pad_token_id=tok.eot_id)
    return tok.decode(out[0].tolist())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where to write the checkpoint (created; replaced only when done)")
    parser.add_argument("--steps", type=int, default=800, help="optimizer steps of 512 tokens (default 800)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, _ = train(args.steps, args.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"greedy: {sample_continuation(model)!r}", file=sys.stderr)
    write_trained(args.directory, SHAPE, model)
    print(f"wrote a trained {SHAPE['n_layer']}-layer GPT-2 checkpoint to {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
