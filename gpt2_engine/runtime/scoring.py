"""Scoring text: the log-probability of every token under the model, over sliding windows for long documents.

A document of N token ids (with <|endoftext|> prepended when bos is on, so that its first real token is scored too)
is cut into windows of at most `context` consecutive positions. A window is fed as a sequence of its own (positions
from 0) and scores positions from its own earlier tokens:
- the first window is [0, min(context, N)) and scores positions 1 .. end - 1;
- each next window ends `stride` positions after the previous one (or at N), starts `context` positions before its
  end (or at 0), and scores the positions from the previous window's end to its own end - 1.
So every position after the first is scored exactly once, with at least context - stride tokens of context outside
the first window. This is transformers' sliding-window perplexity recipe with its off-by-one made exact.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from ..core.config import GPT2Config
from ..core.errors import GPT2EngineError
from ..core.model import KVCache, residual_stream
from ..core.pages import check_batch_fits
from ..interp.spec import Steering, check_steering
from ..interp.steering import batch_tap, check_scoring
from ..core.weights import GPT2Weights
from .plan import TokenStats
from .prefix import PrefixCache, check_capacity, prefill
from .stats import token_stats


@dataclass(frozen=True)
class Window:
    """Positions [begin, end) of a document fed as one sequence; positions [first, end) are scored."""

    begin: int
    end: int
    first: int


def windows(n: int, context: int, stride: int) -> list[Window]:
    """The windows that score positions 1 .. n-1 of an n-token sequence exactly once (none when n < 2)."""
    if not 1 <= stride < context:
        raise ValueError(f"stride must be in 1..context-1 = 1..{context - 1}, got {stride}")
    if n < 2:
        return []
    end = min(context, n)
    out = [Window(0, end, 1)]
    while end < n:
        new_end = min(end + stride, n)
        out.append(Window(max(0, new_end - context), new_end, end))
        end = new_end
    return out


def token_logprobs(w: GPT2Weights, config: GPT2Config, ids: torch.Tensor,
                   steering: tuple[Steering, ...] = ()) -> torch.Tensor:
    """ids [B, T] -> [B, T-1]: the log-probability of each next token given the tokens before it; `steering`:
    edits on every position."""
    B, T = ids.shape
    x = residual_stream(w, config, ids, tap=batch_tap(w, config, steering, B * T))[:, :-1]  # [B, T-1, C]
    return token_stats(w, config, x.reshape(-1, x.shape[-1]), ids[:, 1:].reshape(-1),
                       tap=batch_tap(w, config, steering, B * (T - 1))).logprob.view(B, T - 1)


@dataclass
class Score:
    """One document's score. tokens counts the scored tokens; bytes its UTF-8 length; nll is in nats."""

    name: str
    tokens: int
    bytes: int
    nll: float
    token_ids: list[int] = field(default_factory=list, repr=False)  # the document's ids, <|endoftext|> excluded
    first_scored: int = 0  # index into token_ids of the first scored token (1 with bos off, else 0)
    stats: TokenStats | None = field(default=None, repr=False)  # per scored token, when asked for

    @property
    def ppl(self) -> float:
        """Perplexity exp(nll / tokens); NaN when nothing was scored."""
        return math.exp(self.nll / self.tokens) if self.tokens else math.nan

    @property
    def bpb(self) -> float:
        """Bits per UTF-8 byte: nll / ln 2 / bytes; NaN for an empty document."""
        return self.nll / math.log(2) / self.bytes if self.bytes else math.nan


@dataclass(frozen=True)
class ScoreSettings:
    context: int
    stride: int
    bos: bool = True  # prepend <|endoftext|> so that the first token is scored too (as lm-eval does)
    batch_size: int = 8  # windows per forward pass
    top: int = 0  # alternatives kept per token (with details)
    details: bool = False  # rank, entropy and alternatives per token
    prefix_cache_mb: float | None = None  # run windows one at a time, reusing shared prefixes (runtime/prefix.py)
    steering: tuple[Steering, ...] = ()  # edits on every position (interp/steering.py), as lm-eval's steered model

    def check(self, config: GPT2Config) -> None:
        for name in ("bos", "details"):  # "no" would be true
            if not isinstance(getattr(self, name), bool):
                raise GPT2EngineError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        for name in ("context", "stride", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise GPT2EngineError(f"{name}: expected an integer, got {value!r}")
        if not 2 <= self.context <= config.n_positions:
            raise GPT2EngineError(f"context must be in 2..{config.n_positions} (the model's n_positions), got {self.context}")
        if not 1 <= self.stride < self.context:
            raise GPT2EngineError(f"stride must be in 1..context-1 = 1..{self.context - 1}, got {self.stride}")
        if self.batch_size < 1:
            raise GPT2EngineError(f"batch size must be at least 1, got {self.batch_size}")
        if self.prefix_cache_mb is not None and not self.prefix_cache_mb > 0:  # NaN too
            raise GPT2EngineError(f"prefix cache size must be a positive number of MB, got {self.prefix_cache_mb}")
        self.check_memory(config)
        check_steering(self.steering, config)
        check_scoring(self.steering)

    def check_memory(self, config: GPT2Config) -> None:
        """Refuse, before anything is allocated, a batch of windows or a prefix cache larger than the memory this
        process has: a forward pass of `batch_size` windows holds, per token, the residual stream, q, k, v and the
        MLP's hidden layer (about 12 x n_embd floats) and a row of attention scores per head."""
        if self.prefix_cache_mb is not None:
            check_capacity(self.prefix_cache_mb, "--prefix-cache-mb")
        check_batch_fits(self.batch_size, self.context, config)


@dataclass
class _Pending:
    score: Score
    seq: list[int]  # what the windows index: [eot] + ids with bos, else ids
    windows: list[Window]
    results: dict[int, TokenStats] = field(default_factory=dict)


POOL = 8  # batches' worth of windows sorted by length together, so that short documents share a batch


def score_documents(w: GPT2Weights, config: GPT2Config, eot_id: int, documents: Iterable[tuple[str, list[int], int]],
                    settings: ScoreSettings, progress: Callable[[int], None] | None = None) -> Iterator[Score]:
    """Score (name, token ids, UTF-8 bytes) documents; yields one Score per document, in input order.

    Windows of different documents share a forward pass, right-padded: under the causal mask a real token never
    attends to the padding after it, so each row equals running that window alone (up to float32 rounding of the
    larger matmuls). Only the scored positions go through the head. With settings.prefix_cache_mb, windows run one at
    a time instead, and a window that starts with blocks an earlier one computed (a shared preamble) runs only the
    rest; its stats equal the batched ones within float32 rounding (runtime/prefix.py says where bits differ).
    """
    settings.check(config)
    pending: list[_Pending] = []  # documents not yet yielded, in input order
    pool: list[tuple[_Pending, int]] = []  # (document, window index) not yet run
    prefix = view = None
    if settings.prefix_cache_mb is not None:
        prefix = PrefixCache(config, settings.prefix_cache_mb)
        view = KVCache.allocate(config, 1, settings.context, device=w.wpe.device)  # [n_layer, 1, nh, context, hs]

    def run(jobs: list[tuple[_Pending, int]]) -> None:
        if prefix is not None:
            _run_cached(w, config, view, prefix, settings, jobs, progress)
        else:
            _run_batched(w, config, eot_id, settings, jobs, progress)

    def drain(all_of_it: bool) -> Iterator[Score]:
        pool.sort(key=lambda job: job[0].windows[job[1]].end - job[0].windows[job[1]].begin, reverse=True)
        while len(pool) >= settings.batch_size or (all_of_it and pool):
            batch, pool[:] = pool[: settings.batch_size], pool[settings.batch_size :]
            run(batch)
        while pending and len(pending[0].results) == len(pending[0].windows):
            d = pending.pop(0)
            parts = [d.results[i] for i in range(len(d.windows))]
            if parts:
                d.score.stats = TokenStats.cat(parts)
                d.score.nll = -float(d.score.stats.logprob.double().sum())
                d.score.tokens = len(d.score.stats.logprob)
            if not (settings.details or settings.top):
                d.score.stats = None
            yield d.score

    for name, ids, nbytes in documents:
        seq = [eot_id, *ids] if settings.bos else list(ids)
        d = _Pending(Score(name, 0, nbytes, 0.0, list(ids), 0 if settings.bos else 1), seq,
                     windows(len(seq), settings.context, settings.stride))
        pending.append(d)
        pool.extend((d, i) for i in range(len(d.windows)))
        if len(pool) >= POOL * settings.batch_size:
            yield from drain(False)
    yield from drain(True)


def _run_cached(w: GPT2Weights, config: GPT2Config, view: KVCache, prefix: PrefixCache, settings: ScoreSettings,
                jobs: list[tuple[_Pending, int]], progress: Callable[[int], None] | None) -> None:
    """Each window alone through prefix.prefill: a window that starts with cached blocks runs only the rest."""
    for d, i in jobs:
        win = d.windows[i]
        done = prefill(w, config, view, d.seq[win.begin : win.end], scored=True, top=settings.top,
                       details=settings.details, prefix=prefix, steering=settings.steering)
        # stats row j is the target at local index j + 1: the scored positions [first, end)
        lo, hi = win.first - win.begin - 1, win.end - win.begin - 1
        d.results[i] = done.stats.rows(lo, hi)
        if progress is not None:
            progress(hi - lo)


def _run_batched(w: GPT2Weights, config: GPT2Config, eot_id: int, settings: ScoreSettings,
                 jobs: list[tuple[_Pending, int]], progress: Callable[[int], None] | None) -> None:
    """Windows of several documents as the rows of one right-padded pass; only the scored positions reach the head."""
    L = max(d.windows[i].end - d.windows[i].begin for d, i in jobs)
    ids = torch.full((len(jobs), L), eot_id, dtype=torch.long)  # [B, L], right-padded
    rows, targets = [], []
    for b, (d, i) in enumerate(jobs):
        win = d.windows[i]
        ids[b, : win.end - win.begin] = torch.tensor(d.seq[win.begin : win.end])
        # the logits at local index p - begin - 1 predict the token at position p
        rows.append(b * L + torch.arange(win.first - win.begin - 1, win.end - win.begin - 1))
        targets.extend(d.seq[win.first : win.end])
    with torch.inference_mode():
        tap = batch_tap(w, config, settings.steering, ids.numel())
        x = residual_stream(w, config, ids, tap=tap).view(-1, config.n_embd)  # [B * L, C]
        picked = torch.cat(rows)
        stats = token_stats(w, config, x[picked.to(x.device)], torch.tensor(targets), top=settings.top,
                            details=settings.details, tap=None if tap is None else tap.select(picked))
    offset = 0
    for d, i in jobs:
        n = d.windows[i].end - d.windows[i].first
        d.results[i] = stats.rows(offset, offset + n)
        offset += n
    if progress is not None:
        progress(offset)
