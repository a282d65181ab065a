"""`gpt2 tokenize DATA --out DIR`: a corpus tokenized once into llm.c's token shards (formats/shards.py), which
`gpt2 finetune` and `gpt2 score` then memory-map: any corpus size, bounded memory.

Documents are read one at a time (a .jsonl file line by line), encoded in batches on every core (tiktoken's BPE
releases the GIL), and each is written as <|endoftext|> followed by its tokens, as llm.c's data scripts write them.
A shard closes at the document that would overflow it (a document longer than a shard is a shard of its own). After
each shard, DIR/tokenize.json records how many documents the written shards hold: a killed run, started again with
the same arguments, goes on from there and writes the same shards as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from itertools import islice
from pathlib import Path

import numpy as np

from ..formats.files import atomic_write, output_directory
from ..formats.shards import write_shard
from ..core.tokenizer import load_tokenizer
from ..documents import expand_paths, iter_documents
from ..options import UsageError, positive_int, progress_bar

STATE = "tokenize.json"
BATCH = 256  # documents encoded together


def shard_name(prefix: str, i: int) -> str:
    return f"{prefix}_{i:06d}.bin"


def tokenize_corpus(paths: list[str], out: Path, shard_tokens: int, prefix: str = "shard", workers: int = 1,
                    progress: bool = True) -> dict:
    """Write the documents of `paths` as shards of at most `shard_tokens` tokens into `out` (see the module
    docstring); returns the final state: documents, shards, tokens."""
    output_directory(out)
    settings = {"inputs": paths, "shard_tokens": shard_tokens, "prefix": prefix}
    state = {"settings": settings, "documents": 0, "shards": 0, "tokens": 0, "done": False}
    if (out / STATE).is_file():
        found = json.loads((out / STATE).read_text(encoding="utf-8"))
        if found.get("settings") != settings:
            raise UsageError(f"{out}: holds shards of other inputs or settings ({STATE}); give another --out or "
                             f"delete it")
        state = found
        if state["done"]:
            return state
    tokenizer = load_tokenizer(None)
    eot = tokenizer.eot_id
    docs = islice(iter_documents(paths, sys.stdin.buffer), state["documents"], None)  # what the shards hold: skipped
    pending: list[np.ndarray] = []
    count, consumed = 0, state["documents"]
    bar = progress_bar(not progress, desc="tokenize", unit=" tokens", unit_scale=True, initial=state["tokens"])

    def flush() -> None:
        nonlocal pending, count
        write_shard(out / shard_name(prefix, state["shards"]), np.concatenate(pending))
        state.update(documents=consumed, shards=state["shards"] + 1, tokens=state["tokens"] + count)
        save(out, state)
        pending, count = [], 0

    with bar:  # closed before an error's line, not after it (a full disk)
        while batch := list(islice(docs, BATCH)):
            for ids in tokenizer.encode_batch([text for _, text in batch], workers):
                doc = np.asarray([eot, *ids], dtype=np.uint16)
                if count and count + doc.size > shard_tokens:
                    flush()
                pending.append(doc)
                count += doc.size
                consumed += 1
                bar.update(doc.size)
        if pending:
            flush()
        state["done"] = True
        save(out, state)
    return state


def save(out: Path, state: dict) -> None:
    atomic_write(out / STATE, lambda tmp: Path(tmp).write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8"))


def add_tokenize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenize", help="tokenize a corpus once into llm.c token shards",
                       description="Tokenize text (files, .jsonl, folders) into llm.c's token shards: each document "
                                   "as <|endoftext|> + its GPT-2 tokens, uint16, behind llm.c's 1024-byte header. "
                                   "gpt2 finetune and gpt2 score read the shards memory-mapped. Resumable: run it "
                                   "again with the same arguments after an interruption.",
                       epilog="example: gpt2 tokenize corpus/ --out shards/ && gpt2 finetune shards/ --out runs/x")
    p.add_argument("data", nargs="+", metavar="DATA", help="text or .jsonl files, or folders of them")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the shards go")
    p.add_argument("--shard-tokens", type=positive_int, default=100_000_000, metavar="N",
                   help="tokens per shard (default 100,000,000, llm.c's FineWeb shards)")
    p.add_argument("--prefix", default="shard", help="shard file names: PREFIX_000000.bin, ... (default shard)")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1, metavar="N",
                   help="threads that encode (default: every core)")
    p.set_defaults(run=run_tokenize)


def run_tokenize(args: argparse.Namespace) -> int:
    if "-" in args.data:
        raise UsageError("gpt2 tokenize reads files (a resumable run needs to read its input again), not stdin")
    if not args.prefix or "/" in args.prefix:
        raise UsageError(f"--prefix {args.prefix!r}: expected a file-name prefix")
    state = tokenize_corpus(expand_paths(args.data), args.out, args.shard_tokens, args.prefix, args.workers)
    print(f"gpt2 tokenize: {state['documents']:,} documents, {state['tokens']:,} tokens in {state['shards']} shard(s) "
          f"in {args.out}", file=sys.stderr)
    return 0
