"""`gpt2 score`: perplexity, bits per byte and per-token surprisal of files, on the engine's scoring core.

Input: each FILE is one UTF-8 document, a `.jsonl` file holds one document per line in its "text" field, `-` is
stdin (documents.py reads them). The windows, the batching and the numbers are runtime/scoring.py's; this module
reports and writes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..formats.files import OutputFile, check_not_an_input, files_of, stops_held
from ..documents import InputError, expand_paths, read_documents
from ..options import (ModelOptions, add_model_options, add_steer_option, load_model, parse_steer_args, progress_bar,
                       steering_from_args)
from ..formats.shards import documents, read_shard, shard_files
from ..runtime.scoring import Score, ScoreSettings, score_documents

TOP_ALTERNATIVES = 5  # per token in --per-token output


def figures(s: Score) -> dict[str, Any]:
    """The JSON figures of a Score; NaN (nothing scored) becomes null."""
    def num(x: float) -> float | None:
        return None if math.isnan(x) else x

    return {"tokens": s.tokens, "bytes": s.bytes, "nll": s.nll, "ppl": num(s.ppl), "bpb": num(s.bpb)}


def per_token_records(s: Score, tokenizer: Any) -> Iterator[dict[str, Any]]:
    """One JSON record per scored token of a document."""
    st = s.stats
    if st is None:
        return
    ids = s.token_ids[s.first_scored :]
    text = tokenizer.token_text
    for j, (tok, lp, rank, ent, top_ids, top_lps) in enumerate(zip(
            ids, st.logprob.tolist(), st.rank.tolist(), st.entropy.tolist(), st.top_ids.tolist(), st.top_logprobs.tolist())):
        yield {"document": s.name, "index": s.first_scored + j, "token_id": tok, "token": text(tok), "logprob": lp,
               "rank": rank + 1, "entropy": ent,  # 1 = the most likely token, as gpt2 inspect and the server count
               "top": [{"token_id": t, "token": text(t), "logprob": lp_t} for t, lp_t in zip(top_ids, top_lps)]}


def print_table(scores: list[Score], total: Score, documents: int, seconds: float, out: IO[str]) -> None:
    """The per-document rows (none when they went to --output), the total, and the throughput."""
    width = max([len("document"), *(len(s.name) for s in scores)])
    width = min(width, 60)
    head = f"{'document':<{width}} {'tokens':>9} {'bytes':>10} {'nll':>12} {'ppl':>10} {'bpb':>7}"
    print(head, file=out)
    print("-" * len(head), file=out)
    for s in [*scores, total]:
        if s is total:
            print("-" * len(head), file=out)
        name = s.name if len(s.name) <= width else "…" + s.name[-(width - 1):]
        print(f"{name:<{width}} {s.tokens:>9,} {s.bytes:>10,} {s.nll:>12.2f} {s.ppl:>10.3f} {s.bpb:>7.4f}", file=out)
    rate = total.tokens / seconds if seconds > 0 else math.nan
    print(f"{documents} document(s), {total.tokens:,} tokens scored in {seconds:.2f} s ({rate:,.0f} tokens/s)", file=out)


class AtomicWriter:
    """A text file written beside its destination and renamed over it when complete: an interrupted run leaves the
    destination as it was (or absent), never half-written. A device, FIFO or /dev/stdout is written into instead
    (formats/files.py's OutputFile, whose errors name the destination)."""

    def __init__(self, dest: Path) -> None:
        self.dest, self.file = dest, OutputFile(dest)

    def write_json(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, ensure_ascii=False) + "\n")

    def commit(self) -> None:
        self.file.commit()

    def discard(self) -> None:
        self.file.discard()


class StdoutWriter:
    """`-` as an output file: the JSON lines go to stdout as they come (the report then goes to stderr)."""

    def write_json(self, record: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")

    def commit(self) -> None:
        sys.stdout.flush()

    def discard(self) -> None:
        sys.stdout.flush()


def open_writer(dest: Path) -> AtomicWriter | StdoutWriter:
    return StdoutWriter() if str(dest) == "-" else AtomicWriter(dest)


def checked_settings(args: argparse.Namespace, config: Any) -> ScoreSettings:
    context = args.context if args.context is not None else config.n_positions
    stride = args.stride if args.stride is not None else context // 2
    settings = ScoreSettings(context, stride, bos=not args.no_bos, batch_size=args.batch_size,
                             top=TOP_ALTERNATIVES if args.per_token else 0, details=args.per_token is not None,
                             prefix_cache_mb=args.prefix_cache_mb,
                             steering=steering_from_args(args.steer_specs, config))
    settings.check(config)
    return settings


def shard_documents(shards: list[Path], tokenizer: Any) -> Iterator[tuple[str, list[int], int]]:
    """(name, ids, UTF-8 bytes) of each document of the token shards, one at a time (`SHARD:N` for the N-th): each
    opens with its <|endoftext|>, which the scoring reads as context, as it would a prepended one."""
    eot = tokenizer.eot_id
    nbytes = np.array([0 if i == eot else len(tokenizer.token_bytes(i)) for i in range(tokenizer.n_vocab)])
    for path in shards:
        tokens = read_shard(path)
        for n, (lo, hi) in enumerate(documents(tokens, eot), start=1):
            ids = tokens[lo:hi]
            if len(ids) > 1 or ids[0] != eot:
                yield f"{path}:{n}", ids.astype(np.int64).tolist(), int(nbytes[ids].sum())


def local_scores(args: argparse.Namespace, progress: Any) -> tuple[Any, ScoreSettings, Iterator[Score]]:
    """(tokenizer, settings, scores in input order) on this machine."""
    args.steer_specs = parse_steer_args(args.steer)  # checked before the model loads
    shards = shard_files(args.files)
    if shards is not None:  # llm.c's token shards: read memory-mapped, document by document, nothing prepended
        model = load_model(ModelOptions.from_args(args))
        settings = replace(checked_settings(args, model.config), bos=False)
        return model.tokenizer, settings, score_documents(model.weights, model.config, model.tokenizer.eot_id,
                                                          shard_documents(shards, model.tokenizer), settings,
                                                          progress=progress.update)
    docs = read_documents(args.files, sys.stdin.buffer)  # every input is read and checked before the model loads
    if not docs:
        raise InputError("nothing to score: the input holds no documents")
    model = load_model(ModelOptions.from_args(args))
    settings = checked_settings(args, model.config)
    return model.tokenizer, settings, model.score_documents(docs, settings, progress=progress.update)


def ray_scores(args: argparse.Namespace) -> tuple[Any, ScoreSettings, Iterator[Score]]:
    """(None, settings, scores in input order) from Ray Data actors (distributed/score.py)."""
    from ..formats.checkpoints import checkpoint_config
    from ..distributed.score import score_on_ray

    args.steer_specs = parse_steer_args(args.steer)
    if shard_files(args.files) is not None:
        raise InputError("--ray scores text; score token shards without --ray (they are read memory-mapped)")
    stdin_docs = read_documents(["-"], sys.stdin.buffer) if "-" in args.files else []
    # the loader's error for a missing or empty checkpoint, before Ray starts
    settings = checked_settings(args, checkpoint_config(args.weights))
    return None, settings, score_on_ray(args, args.files, stdin_docs, settings)


def check_flags(args: argparse.Namespace) -> None:
    """The flag combinations that cannot work, refused before anything is read."""
    if not args.ray and (args.address is not None or args.workers is not None):
        raise InputError("--address and --workers need --ray")
    if args.workers is not None and args.workers < 1:
        raise InputError(f"--workers must be at least 1, got {args.workers}")
    if args.ray and args.per_token is not None:
        raise InputError("--per-token is not available with --ray; use --output for one line per document")
    if str(args.per_token) == str(args.output) == "-":
        raise InputError("--per-token and --output cannot both be - (stdout): give one of them a file")


@dataclass
class Totals:
    """What the scores add up to: each document's figures (unless they went to --output), the total, the count."""

    scores: list[Score] = field(default_factory=list)
    total: Score = field(default_factory=lambda: Score("total", 0, 0, 0.0))
    documents: int = 0

    def add(self, s: Score, listed: bool) -> None:
        if listed:
            self.scores.append(Score(s.name, s.tokens, s.bytes, s.nll))  # the figures only, not the details
        self.total = Score("total", self.total.tokens + s.tokens, self.total.bytes + s.bytes, self.total.nll + s.nll)
        self.documents += 1


def score_into(args: argparse.Namespace, writers: dict[str, AtomicWriter | StdoutWriter]) -> tuple[ScoreSettings, Totals]:
    """Score every document (locally or on Ray), its lines written as they come, behind a progress bar on stderr."""
    totals = Totals()
    bar = progress_bar(args.quiet, total=None, unit="tok", unit_scale=True, desc="scoring")
    with bar:
        tokenizer, settings, stream = ray_scores(args) if args.ray else local_scores(args, bar)
        for s in stream:
            if "per_token" in writers:
                for record in per_token_records(s, tokenizer):
                    writers["per_token"].write_json(record)
            if "output" in writers:
                writers["output"].write_json({"name": s.name, **figures(s)})
            totals.add(s, listed="output" not in writers)
            if args.ray:
                bar.update(s.tokens)
    if totals.total.tokens == 0:
        raise InputError("nothing to score: every document is empty" + (" or one token long (--no-bos scores "
                                                                         "from the second token on)" if args.no_bos else ""))
    return settings, totals


def report(args: argparse.Namespace, settings: ScoreSettings, totals: Totals, seconds: float, out: IO[str]) -> None:
    """The report: one JSON document, or the table and where the per-document figures went."""
    if args.json:
        doc = {"documents": [{"name": s.name, **figures(s)} for s in totals.scores], "total": figures(totals.total),
                  "settings": {"context": settings.context, "stride": settings.stride, "bos": not args.no_bos,
                               "dtype": args.dtype, "quantize": args.quantize, "weights": str(args.weights)}}
        if args.output is not None:  # the documents are in the file, not repeated here
            del doc["documents"]
            doc["output"] = str(args.output)
        print(json.dumps(doc, ensure_ascii=False), file=out)
        return
    print_table(totals.scores, totals.total, totals.documents, seconds, out)
    if args.output is not None and str(args.output) != "-":
        print(f"per-document figures: {args.output}", file=out)


def check_outputs(args: argparse.Namespace, inputs: list[Path]) -> None:
    """Refuse --per-token or --output that is one of the documents scored (writing would replace it), or the two
    naming one file."""
    files = [(flag, Path(dest)) for flag, dest in (("--per-token", args.per_token), ("--output", args.output))
             if dest is not None and str(dest) != "-"]
    read: dict[Path, str] = {**dict.fromkeys(inputs, ""), **files_of(args.weights, "the --weights checkpoint"),
                             **files_of(getattr(args, "lora", None), "the --lora adapter")}
    for flag, dest in files:
        check_not_an_input(dest, read, flag)
    if len(files) == 2 and files[0][1].resolve() == files[1][1].resolve():
        raise InputError(f"--per-token and --output are the same file ({args.output}): give each its own")


def run_score(args: argparse.Namespace) -> int:
    check_flags(args)
    if (shards := shard_files(args.files)) is None:  # token shards (a folder of them, too) are read as they are
        args.files = expand_paths(args.files)  # a folder is the text files under it, as gpt2 finetune reads it
    check_outputs(args, shards or [Path(f) for f in args.files if str(f) != "-"])
    writers: dict[str, AtomicWriter | StdoutWriter] = {}
    t0 = time.perf_counter()
    try:
        with stops_held():  # each file owned by the try that discards it before a stop can land
            writers.update((name, open_writer(dest)) for name, dest in (("per_token", args.per_token),
                                                                          ("output", args.output)) if dest is not None)
        out = sys.stderr if any(isinstance(w, StdoutWriter) for w in writers.values()) else sys.stdout  # the report
        settings, totals = score_into(args, writers)
        for writer in writers.values():
            writer.commit()
        writers.clear()
    finally:
        for writer in writers.values():
            writer.discard()
    report(args, settings, totals, time.perf_counter() - t0, out)
    return 0


def add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score", help="perplexity, bits per byte and per-token surprisal of text files",
        description="Score documents under the model: tokens, total negative log-likelihood (nats), perplexity and "
                    "bits per byte per document and in total. Long documents are scored in sliding windows; every "
                    "token is predicted exactly once.",
        epilog="examples:\n  gpt2 score book.txt\n  gpt2 score corpus.jsonl --json\n  cat a.txt | gpt2 score - "
               "--per-token tokens.jsonl\n  gpt2 score *.txt --context 512 --stride 256",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="a UTF-8 text file (one document), a .jsonl file (one document per line, in \"text\"), a folder "
                        "of them, or - for stdin")
    p.add_argument("--context", type=int, metavar="N", help="window length in tokens (default: n_positions)")
    p.add_argument("--stride", type=int, metavar="N",
                   help="tokens each window advances; 1..context-1 (default context // 2)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="windows per forward pass (default 8)")
    p.add_argument("--prefix-cache-mb", type=float, metavar="MB",
                   help="for documents that share a preamble: run windows one at a time and reuse the keys and "
                        "values of prompt blocks already computed, in at most MB of memory (default: off, since "
                        "documents that share nothing lose the batched windows)")
    p.add_argument("--no-bos", action="store_true",
                   help="do not prepend <|endoftext|>; the first token of each document is then not scored")
    p.add_argument("--per-token", type=Path, metavar="OUT.jsonl",
                   help="write one line per scored token: logprob, rank, entropy, top 5 alternatives (- for stdout)")
    p.add_argument("--output", type=Path, metavar="FILE.jsonl",
                   help="write one line per document (name, tokens, bytes, nll, ppl, bpb) to FILE instead of "
                        "listing them on stdout, for corpora too large to print (- for stdout)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    ray = p.add_argument_group("scaling out on Ray (pip install 'gpt2-engine[distributed]')")
    ray.add_argument("--ray", action="store_true",
                     help="score with Ray Data: files read by Ray tasks, documents scored by actors that load the model once")
    ray.add_argument("--address", metavar="ADDR",
                     help="a running Ray cluster to join (e.g. 10.0.0.1:6379; default: start Ray on this machine)")
    ray.add_argument("--workers", type=int, metavar="N",
                     help="scoring actors (default: the cluster's CPUs divided by --threads)")
    add_model_options(p)
    add_steer_option(p)
    p.set_defaults(run=run_score)
