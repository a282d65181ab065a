"""`gpt2 score`: perplexity, bits per byte and per-token surprisal of files, on the engine's scoring core.

Input: each FILE is one UTF-8 document, a `.jsonl` file holds one document per line in its "text" field, `-` is
stdin. The windows, the batching and the numbers are core/scoring.py's; this module reads, reports and writes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from .core.errors import GPT2EngineError
from .core.scoring import Score, ScoreSettings, score_documents

TOP_ALTERNATIVES = 5  # per token in --per-token output


class InputError(GPT2EngineError):
    """An input file that cannot be read as documents."""


def decode_utf8(data: bytes, name: str, base: int = 0) -> str:
    """`data` as text; invalid UTF-8 is an InputError that names the file and the byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{name}: invalid UTF-8 at byte offset {base + e.start} (expected UTF-8 text)") from None


def read_bytes(path: str, stdin: IO[bytes]) -> bytes:
    if path == "-":
        return stdin.read()
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a text or .jsonl file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})") from None


def read_documents(paths: list[str], stdin: IO[bytes]) -> list[tuple[str, str]]:
    """(name, text) of every document, in input order: `PATH:N` for line N of a .jsonl file, `-` for stdin."""
    docs: list[tuple[str, str]] = []
    for path in paths:
        data = read_bytes(path, stdin)
        if not path.endswith(".jsonl"):
            docs.append((path, decode_utf8(data, path)))
            continue
        offset = 0
        for n, line in enumerate(data.split(b"\n"), start=1):
            where, base, offset = f"{path}:{n}", offset, offset + len(line) + 1
            if not line.strip():
                continue
            try:
                record = json.loads(decode_utf8(line, path, base))
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: not valid JSON ({e.msg}); expected one JSON object per line") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise InputError(f"{where}: expected a JSON object with a string \"text\" field")
            docs.append((where, record["text"]))
    return docs


def score_texts(model: Any, docs: list[tuple[str, str]], settings: ScoreSettings,
                progress: Any = None) -> Iterator[Score]:
    """Tokenize (name, text) documents and score them with the model's weights; Scores in input order."""
    encoded = [(name, model.tokenizer.encode(text), len(text.encode("utf-8"))) for name, text in docs]
    return score_documents(model.weights, model.config, model.tokenizer.eot_id, encoded, settings,
                           progress=progress.update if progress is not None else None)


def total_of(scores: list[Score]) -> Score:
    return Score("total", sum(s.tokens for s in scores), sum(s.bytes for s in scores), sum(s.nll for s in scores))


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
    def text(t: int) -> str:
        return tokenizer.token_bytes(t).decode("utf-8", errors="replace")

    for j, (tok, lp, rank, ent, top_ids, top_lps) in enumerate(zip(
            ids, st.logprob.tolist(), st.rank.tolist(), st.entropy.tolist(), st.top_ids.tolist(), st.top_logprobs.tolist())):
        yield {"document": s.name, "index": s.first_scored + j, "token_id": tok, "token": text(tok), "logprob": lp,
               "rank": rank, "entropy": ent,
               "top": [{"token_id": t, "token": text(t), "logprob": l} for t, l in zip(top_ids, top_lps)]}


def print_table(scores: list[Score], total: Score, seconds: float, out: IO[str]) -> None:
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
    print(f"{len(scores)} document(s), {total.tokens:,} tokens scored in {seconds:.2f} s ({rate:,.0f} tokens/s)", file=out)


def run_score(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .cli import load_model

    docs = read_documents(args.files, sys.stdin.buffer)  # every input is read and checked before the model loads
    if not docs:
        raise InputError("nothing to score: the input holds no documents")
    model = load_model(args)
    context = args.context if args.context is not None else model.config.n_positions
    stride = args.stride if args.stride is not None else context // 2
    settings = ScoreSettings(context, stride, bos=not args.no_bos, batch_size=args.batch_size,
                             top=TOP_ALTERNATIVES if args.per_token else 0, details=args.per_token is not None)
    settings.check(model.config)
    out_tmp = None
    if args.per_token is not None:  # written beside the destination and renamed when complete
        directory = args.per_token.parent if str(args.per_token.parent) else Path(".")
        try:
            fd, out_tmp = tempfile.mkstemp(prefix=args.per_token.name + ".", suffix=".part", dir=directory)
        except OSError as e:
            raise InputError(f"{args.per_token}: cannot write ({e.strerror or e})") from None
    scores: list[Score] = []
    t0 = time.perf_counter()
    try:
        per_token = os.fdopen(fd, "w", encoding="utf-8") if out_tmp else None
        bar = tqdm(total=None, unit="tok", unit_scale=True, file=sys.stderr, desc="scoring",
                   disable=args.quiet or not sys.stderr.isatty())
        with bar:
            for s in score_texts(model, docs, settings, progress=bar):
                if per_token is not None:
                    for record in per_token_records(s, model.tokenizer):
                        per_token.write(json.dumps(record, ensure_ascii=False) + "\n")
                s.stats = None  # the per-token details are written; keep only the figures
                scores.append(s)
        if per_token is not None:
            per_token.close()
            os.replace(out_tmp, args.per_token)
            out_tmp = None
    finally:
        if out_tmp is not None:
            Path(out_tmp).unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    total = total_of(scores)
    if total.tokens == 0:
        raise InputError("nothing to score: every document is empty" + (" or one token long (--no-bos scores from the "
                                                                         "second token on)" if args.no_bos else ""))
    if args.json:
        print(json.dumps({
            "documents": [{"name": s.name, **figures(s)} for s in scores], "total": figures(total),
            "settings": {"context": context, "stride": stride, "bos": not args.no_bos, "dtype": args.dtype,
                         "quantize": args.quantize, "weights": str(args.weights)}}, ensure_ascii=False))
    else:
        print_table(scores, total, seconds, sys.stdout)
    return 0


def add_score(sub: argparse._SubParsersAction) -> None:
    from .cli import add_model_options

    p = sub.add_parser(
        "score", help="perplexity, bits per byte and per-token surprisal of text files",
        description="Score documents under the model: tokens, total negative log-likelihood (nats), perplexity and "
                    "bits per byte per document and in total. Long documents are scored in sliding windows; every "
                    "token is predicted exactly once.",
        epilog="examples:\n  gpt2 score book.txt\n  gpt2 score corpus.jsonl --json\n  cat a.txt | gpt2 score - "
               "--per-token tokens.jsonl\n  gpt2 score *.txt --context 512 --stride 256",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="a UTF-8 text file (one document), a .jsonl file (one document per line, in \"text\"), or - for stdin")
    p.add_argument("--context", type=int, metavar="N", help="window length in tokens (default: n_positions)")
    p.add_argument("--stride", type=int, metavar="N",
                   help="tokens each window advances; 1..context-1 (default context // 2)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="windows per forward pass (default 8)")
    p.add_argument("--no-bos", action="store_true",
                   help="do not prepend <|endoftext|>; the first token of each document is then not scored")
    p.add_argument("--per-token", type=Path, metavar="OUT.jsonl",
                   help="write one line per scored token: logprob, rank, entropy, top 5 alternatives")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_options(p)
    p.set_defaults(run=run_score)
