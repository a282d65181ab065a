"""`gpt2 tokenize DATA --out DIR`: a corpus tokenized once into llm.c's token shards (formats/shards.py), which
`gpt2 finetune` and `gpt2 score` then memory-map: any corpus size, bounded memory.

Documents are read one at a time (a .jsonl file line by line), encoded in batches on every core (tiktoken's BPE
releases the GIL), and each is written as <|endoftext|> followed by its tokens, as llm.c's data scripts write them.
A shard closes at the document that would overflow it (a document longer than a shard is a shard of its own). After
each shard, DIR/tokenize.json records how many documents the written shards hold: a killed run, started again with
the same arguments, goes on from there and writes the same shards as an uninterrupted one. The state records each
input's size and mtime_ns too, so that a run on an edited corpus is refused rather than left with the old shards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from ..core.config import read_json
from ..core.errors import InputError, one_line
from ..formats.files import atomic_write, check_not_an_input, output_directory, what_is
from ..formats.shards import ShardError, shard_length, write_shard
from ..core.tokenizer import load_tokenizer
from ..documents import expand_paths, file_stamps, iter_documents
from ..options import UsageError, positive_int, progress_bar

STATE = "tokenize.json"
BATCH = 256  # documents encoded together, at most
BATCH_BYTES = 16 << 20  # and at most about this much text: tiktoken returns Python ints, ~40 bytes a token


def shard_name(prefix: str, i: int) -> str:
    return f"{prefix}_{i:06d}.bin"


def check_outputs(paths: list[str], out: Path, prefix: str) -> None:
    """Refuse an input that is one of the files the run writes: a shard of `prefix` or the state in `out`."""
    if not out.is_dir():
        return
    shard = re.compile(rf"{re.escape(prefix)}_\d{{6,}}\.bin")
    for dest in sorted(out.iterdir()):
        if dest.name == STATE or shard.fullmatch(dest.name):
            check_not_an_input(dest, [Path(p) for p in paths], "--out")


def not_a_state(path: Path, what: str) -> UsageError:
    return UsageError(f"{path}: not a tokenize state ({what}); delete it or give another --out")


def read_state(out: Path, settings: dict) -> dict | None:
    """DIR/tokenize.json where it is a state of this run's inputs and settings, each field checked (None where there
    is none); UsageError in one line where it is of other inputs or settings, or not a tokenize state."""
    path = out / STATE
    kind = what_is(path)
    if kind is None:
        return None
    if kind != "a regular file":  # a FIFO would hang the reader, then be written into
        raise not_a_state(path, kind)
    try:
        found = read_json(path, "a tokenize state")
    except InputError as e:  # larger than any state
        raise not_a_state(path, str(e).removeprefix(f"{path}: ")) from None
    except OSError as e:
        raise not_a_state(path, f"cannot read it: {e.strerror or e}") from None
    except ValueError as e:
        raise not_a_state(path, f"not JSON: {one_line(e)}") from None
    if not isinstance(found, dict):
        raise not_a_state(path, f"{json.dumps(found)[:40]}, not a JSON object")
    if not isinstance(found.get("settings"), dict):
        raise not_a_state(path, f"\"settings\" is {json.dumps(found.get('settings'))[:40]}; expected an object")
    if found["settings"] != settings:
        raise UsageError(f"{out}: holds shards of other inputs or settings ({STATE}: "
                         f"{changed(found['settings'], settings)}); give another --out or delete it")
    check_counts(path, found)
    return found


def changed(saved: dict, settings: dict) -> str:
    """What differs between a saved run's settings and this run's, as the command line names it."""
    inputs = saved.get("inputs")
    if isinstance(inputs, list) and inputs and all(isinstance(i, str) for i in inputs):
        return "written by an older gpt2 tokenize, which did not record its inputs' sizes and times"
    what = [f"{flag} was {json.dumps(saved.get(key))[:40]}" for key, flag in (("shard_tokens", "--shard-tokens"),
                                                                               ("prefix", "--prefix"))
            if saved.get(key) != settings[key]]
    if inputs != settings["inputs"]:
        what += changed_inputs(inputs, settings["inputs"])
    return ", ".join(what) or "other settings"


def changed_inputs(saved: Any, inputs: list[dict]) -> list[str]:
    """The inputs that changed since a saved run, by path (at most three), or "other input files"."""
    paths = [i["path"] for i in inputs]
    if isinstance(saved, list) and [i.get("path") if isinstance(i, dict) else None for i in saved] == paths:
        return [f"{now['path']} changed since it was tokenized" for now, then in zip(inputs, saved) if now != then][:3]
    return ["other input files"]


def check_counts(path: Path, state: dict) -> None:
    """UsageError where a state's counts are not what a run writes: whole numbers with shards <= documents <= tokens
    (each document is at least its <|endoftext|>), "done" true or false, and each shard counted on disk."""
    counts = [state.get(name) for name in ("documents", "shards", "tokens")]
    for name, value in zip(("documents", "shards", "tokens"), counts):
        if type(value) is not int or not 0 <= value < 2**63:  # bool is no count; islice takes at most 2^63 - 1
            raise not_a_state(path, f"\"{name}\" is {value!r:.40}; expected a count")
    if type(state.get("done")) is not bool:
        raise not_a_state(path, f"\"done\" is {state.get('done')!r:.40}; expected true or false")
    documents, shards, tokens = counts
    if not shards <= documents <= tokens or (shards == 0) != (documents == 0):
        raise not_a_state(path, f"{documents:,} documents and {tokens:,} tokens in {shards:,} shard(s) do not add up")
    check_shards(path, state["settings"]["prefix"], shards)


def check_shards(path: Path, prefix: str, shards: int) -> None:
    """UsageError unless each of the `shards` a state counts is there, its header matching its size (a damaged
    shard would be kept, and trained on)."""
    for name in (shard_name(prefix, i) for i in range(shards)):
        shard = path.parent / name
        if not shard.is_file():
            raise not_a_state(path, f"it counts {shards:,} shard(s), and {name} is missing")
        try:
            shard_length(shard)
        except ShardError as e:
            raise not_a_state(path, f"its shard {name} is damaged: {str(e).removeprefix(f'{shard}: ')}") from None


def starting_state(paths: list[str], out: Path, shard_tokens: int, prefix: str) -> dict:
    """The state a run of these inputs and settings starts from: DIR/tokenize.json's, once checked, or a new one.
    Errors, in one line, before anything is written: an input that is one of the run's outputs, a state of other
    inputs or settings, a state that is not one."""
    check_outputs(paths, out, prefix)
    settings = {"inputs": file_stamps(paths), "shard_tokens": shard_tokens, "prefix": prefix}
    return read_state(out, settings) or {"settings": settings, "documents": 0, "shards": 0, "tokens": 0,
                                         "done": False}


def tokenize_corpus(paths: list[str], out: Path, shard_tokens: int, prefix: str = "shard", workers: int = 1,
                    progress: bool = True, state: dict | None = None) -> dict:
    """Write the documents of `paths` as shards of at most `shard_tokens` tokens into `out` (see the module
    docstring), going on from `state` (default: starting_state's); returns the final state: documents, shards,
    tokens."""
    state = starting_state(paths, out, shard_tokens, prefix) if state is None else state
    if state["done"]:
        return state
    output_directory(out)
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
        for batch in batches(docs):
            for ids in tokenizer.encode_batch(batch, workers):
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


def batches(docs: Iterator[tuple[Any, str]]) -> Iterator[list[str]]:
    """The documents' texts in batches of at most BATCH documents and, past the first, BATCH_BYTES of text (a
    folder of large files was held whole: 2.3 GB for 130 MB of text), in order: the shards do not change."""
    batch: list[str] = []
    size = 0
    for _, text in docs:
        if batch and (len(batch) == BATCH or size + len(text) > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(text)
        size += len(text)
    if batch:
        yield batch


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
    paths = expand_paths(args.data)
    state = starting_state(paths, args.out, args.shard_tokens, args.prefix)
    done = f"{state['documents']:,} documents, {state['tokens']:,} tokens in {state['shards']} shard(s)"
    if state["done"]:
        print(f"gpt2 tokenize: already tokenized ({args.out / STATE}): {done}; nothing to do", file=sys.stderr)
        return 0
    if state["documents"]:
        print(f"gpt2 tokenize: resuming from {args.out / STATE}: {done} already written", file=sys.stderr)
    state = tokenize_corpus(paths, args.out, args.shard_tokens, args.prefix, args.workers, state=state)
    print(f"gpt2 tokenize: {state['documents']:,} documents, {state['tokens']:,} tokens in {state['shards']} shard(s) "
          f"in {args.out}", file=sys.stderr)
    return 0
