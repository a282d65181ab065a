"""Speculative decoding: drafters that propose a sequence's next tokens, and the rule that accepts them.

A verify pass feeds a running sequence's next token and its K drafted tokens as K + 1 rows of one pass
(runner.Segment with `outputs` = K + 1), and the scheduler accepts the longest agreeing prefix plus one token of the
target's own (scheduler.Scheduler._verify). Why a verified token is the very token plain decoding would produce:
up to projection.DECODE_ROWS rows, every projection and the head run on the row-invariant native kernels (each
output element is reduced in a fixed order whatever the number of rows), layer norm, GELU and the residual adds act
row by row, and the attention kernel writes every row's key and value first, then lets each row attend to its
slot's positions up to its own, in a fixed order. So row i's logits are the bits of a one-row decode step at its
position, after the tokens before it.

Greedy: a drafted token is accepted iff it is the argmax the target's row gives; the first one that is not is
replaced by that argmax. The ids equal plain greedy decoding's. Sampling: speculative sampling (Leviathan et al.
2023, Chen et al. 2023): drafted x (drawn from q) is accepted with probability min(1, p(x) / q(x)), else the token
is drawn from max(0, p - q) normalised; when all K are accepted, one more is drawn from p. p is exactly what plain
sampling draws from (penalties, temperature, top-k, top-p: sampling.probabilities), so the tokens are distributed
exactly as the target's; the randomness is the sequence's generator, so a seed reproduces the run (with other draws
than plain sampling's).

The KV cache: the rows of rejected drafts are written at positions the sequence has not reached yet. Its position
stays right after the last accepted token, so those entries are overwritten before anything reads them (a row
attends to positions up to its own only): the cache up to the position holds what plain decoding writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch

from .config import GPT2Config
from .errors import GenerationError, WeightsError
from .quantize import FORMATS, quantize_weights
from .runner import ModelRunner, Segment
from .sampling import SamplingParams, argmax, probabilities
from .tokenizer import Tokenizer, load_tokenizer
from .weights import CONFIG, GPT2Weights, load_weights

MAX_DRAFT_TOKENS = 16  # K at most: K + 1 rows must stay within the row-invariant kernels' DECODE_ROWS
ADAPTIVE_START = 4  # adaptive K's first draft length
ADAPTIVE_MAX = 8  # and its longest: past that, a miss wastes more than a hit gains
PAUSE_TOKENS = 16  # adaptive K at 0: plain decoding for this many tokens, then a draft of 1 again
NGRAM_MAX, NGRAM_MIN = 4, 1  # prompt lookup matches the last 4 tokens, else 3, 2, 1
SERVE_MAX_RUNNING = 2  # the server drafts only while at most this many sequences run: beyond, batching pays better
# and only from a sequence's 4th generated token: clients that send their next requests together would otherwise see
# the first arrival draft alone for a step while the others' prompts wait for its draft passes
SERVE_SETTLE_TOKENS = 4


class DraftAsk(NamedTuple):
    """What a drafter is asked for one sequence: `k` tokens to follow `context`, the sequence's tokens at positions
    0 .. len(context) - 1 of cache slot `slot` (prompt, generated text, and the next token, not yet fed); `excluded`:
    tokens the sequence may not produce (<|endoftext|> with ignore_eos), which a draft of them would only waste."""

    slot: int
    context: list[int]
    k: int
    sampling: SamplingParams
    generator: torch.Generator
    excluded: tuple[int, ...] = ()


class Draft(NamedTuple):
    """Drafted tokens (at most the k asked; maybe none) and, for each, the distribution it was drawn from (q [n, V]);
    q None: chosen deterministically (a point mass)."""

    tokens: list[int]
    q: torch.Tensor | None = None


class Drafter(Protocol):
    def propose(self, asks: list[DraftAsk]) -> list[Draft]:
        """One Draft per ask, in order."""
        ...


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last n tokens (n from
    NGRAM_MAX down to NGRAM_MIN), in the prompt and the text so far. No model; strong where the output quotes its
    input (extraction, edits, summaries)."""

    def propose(self, asks: list[DraftAsk]) -> list[Draft]:
        drafts = []
        for ask in asks:
            tokens = lookup(ask.context, ask.k)
            cut = [i for i, t in enumerate(tokens) if t in ask.excluded]  # a token the target would refuse: stop there
            drafts.append(Draft(tokens[: cut[0]] if cut else tokens))
        return drafts


def lookup(context: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching tail of `context`. Where
    that continuation runs into the end of the context (a repeating stretch), it goes on by the same rule over the
    context and the tokens drafted so far."""
    ids = np.asarray(context, dtype=np.int64)
    draft: list[int] = []
    while len(draft) < k:
        more = match(ids, k - len(draft))
        if not more:
            break
        draft += more
        ids = np.concatenate([ids, np.asarray(more, dtype=np.int64)])
    return draft


def match(ids: np.ndarray, k: int) -> list[int]:
    """lookup()'s one step: the tokens after the latest earlier occurrence of the longest matching tail of ids."""
    for n in range(min(NGRAM_MAX, len(ids) - 1), NGRAM_MIN - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [L - n, n]: every earlier n-gram
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            after = int(hits[-1]) + n
            return ids[after : after + k].tolist()
    return []


class ModelDrafter:
    """A draft model (the target quantized, or a smaller GPT-2) with a KV cache of its own, slot for slot the
    target's. Each slot remembers the tokens it has fed, so a call feeds only what is new (after a rejection, from the
    first token that differs), then draws k tokens one pass at a time, all asks' rows sharing each pass."""

    def __init__(self, weights: GPT2Weights, config: GPT2Config, slots: int, max_len: int) -> None:
        self.runner = ModelRunner(weights, config, slots, max_len)
        self.fed: list[list[int]] = [[] for _ in range(slots)]

    def propose(self, asks: list[DraftAsk]) -> list[Draft]:
        tokens: list[list[int]] = [[] for _ in asks]
        qs: list[list[torch.Tensor]] = [[] for _ in asks]
        try:
            segments, rows = [], []  # the first pass: each slot caught up to its context
            for i, ask in enumerate(asks):
                fed = self.fed[ask.slot]
                same = common_prefix(fed, ask.context)
                start = min(same, len(ask.context) - 1)  # at least the last token, for its logits
                self.fed[ask.slot] = list(ask.context)
                if start == 0 and len(ask.context) > 1:  # a new sequence: its prompt as a prefill of its own
                    logits = self.runner.prefill(ask.slot, ask.context).logits
                    self._draw(ask, logits, tokens[i], qs[i])
                else:
                    segments.append(Segment(ask.slot, start, ask.context[start:]))
                    rows.append(i)
            if segments:
                for i, row in zip(rows, self._run(segments)):
                    self._draw(asks[i], row, tokens[i], qs[i])
            while live := [i for i, ask in enumerate(asks) if len(tokens[i]) < ask.k]:
                segments = [Segment(asks[i].slot, len(self.fed[asks[i].slot]), [tokens[i][-1]]) for i in live]
                for i in live:
                    self.fed[asks[i].slot].append(tokens[i][-1])
                for i, row in zip(live, self._run(segments)):
                    self._draw(asks[i], row, tokens[i], qs[i])
        except BaseException:
            for ask in asks:  # what these slots hold is unknown now: feed them from the start next time
                self.fed[ask.slot] = []
            raise
        return [Draft(t, torch.stack(q) if q else None) for t, q in zip(tokens, qs)]

    def _run(self, segments: list[Segment]) -> torch.Tensor:
        run = self.runner.open(segments)
        while not run.done:
            run.run_block()
        return run.logits()  # [n, V]

    @staticmethod
    def _draw(ask: DraftAsk, logits: torch.Tensor, tokens: list[int], qs: list[torch.Tensor]) -> None:
        """The next draft token from the draft model's raw logits [V]: its argmax for a greedy sequence, else a draw
        from its temperature / top-k / top-p distribution q (kept for the acceptance test)."""
        if ask.excluded:
            logits = logits.clone()
            logits[list(ask.excluded)] = -torch.inf
        if ask.sampling.greedy:
            tokens.append(argmax(logits))
            return
        q = probabilities(logits, ask.sampling)
        tokens.append(int(torch.multinomial(q, 1, generator=ask.generator)))
        qs.append(q)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    return int(np.flatnonzero(x != y)[0])


def accept(processed: torch.Tensor, params: SamplingParams, drafted: int, q: torch.Tensor | None,
           generator: torch.Generator) -> int:
    """The token at a drafted position, from the target's penalised logits [V] there: `drafted` if accepted, else
    its replacement (see the module docstring). q [V]: the distribution `drafted` was drawn from (None: a point
    mass on it)."""
    if params.greedy:
        return argmax(processed)
    p = probabilities(processed, params)  # [V]
    q_x = 1.0 if q is None else float(q[drafted])
    if float(torch.rand((), generator=generator)) * q_x < float(p[drafted]):  # u < p(x) / q(x)
        return drafted
    if q is None:
        residual = p.clone()
        residual[drafted] = 0.0  # max(0, p - onehot(x))
    else:
        residual = (p - q).clamp(min=0)  # [V]
    if not float(residual.sum()) > 0:  # only rounding can leave nothing (a rejection needs q(x) > p(x))
        residual = p
    return int(torch.multinomial(residual, 1, generator=generator))


def next_k(k: int, drafted: int, accepted: int, limit: int) -> int:
    """Adaptive K after a verify pass: one longer while every draft is accepted, else as long as what was accepted
    (at most half the last), down to 0 (no speculation, for PAUSE_TOKENS tokens)."""
    if drafted and accepted == drafted:
        return min(k + 1, limit)
    return min(accepted, k // 2)


@dataclass(frozen=True)
class Speculation:
    """How a run speculates: `source` as the user named it ('int4', 'int8', 'ngram' or a checkpoint directory), the
    draft model's weights and config (None for ngram), K (`draft_tokens`; None: adaptive) and `max_running`: draft
    only while at most this many sequences run (None: always), since a pass that already has many rows gains more
    from batching than from drafting; `settle`: tokens a sequence generates before its first draft."""

    source: str
    weights: GPT2Weights | None
    config: GPT2Config | None
    draft_tokens: int | None = None
    max_running: int | None = None
    settle: int = 0

    def drafter(self, slots: int, max_len: int) -> Drafter:
        """A drafter for a cache of `slots` sequences of up to `max_len` positions."""
        if self.weights is None:
            return NgramDrafter()
        return ModelDrafter(self.weights, self.config, slots, max_len)

    def first_k(self) -> int:
        return self.draft_tokens or ADAPTIVE_START

    def limit(self) -> int:
        return self.draft_tokens or ADAPTIVE_MAX


def check_draft_tokens(k: int | None, name: str = "draft_tokens") -> None:
    """K's bounds, for the API and both commands (`name`: the argument or flag, as the user wrote it)."""
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS):
        raise GenerationError(f"{name} must be an integer in [1, {MAX_DRAFT_TOKENS}] (or none: adaptive), got {k!r}",
                              param="draft_tokens")


def load_speculation(source: str | Path, weights: GPT2Weights, config: GPT2Config, tokenizer: Tokenizer, *,
                     draft_tokens: int | None = None, max_running: int | None = None) -> Speculation:
    """The Speculation `source` names for a target model: 'int8' / 'int4' (the target's own float32 weights,
    quantized: self-speculation), 'ngram' (prompt lookup), or a GPT-2 checkpoint directory with the target's
    tokenizer and vocabulary (e.g. gpt2 drafting for gpt2-medium)."""
    check_draft_tokens(draft_tokens)
    source = str(source)
    if source == "ngram":
        return Speculation(source, None, None, draft_tokens, max_running)
    if source in FORMATS:
        if any(not isinstance(t, torch.Tensor) or t.dtype != torch.float32 for t in (weights.wte, weights.blocks[0].c_fc.weight)):
            raise GenerationError(f"speculate={source!r} quantizes the target's float32 weights; this model is already "
                                  "quantized or bfloat16 (use 'ngram' or a draft checkpoint)", param="speculate")
        return Speculation(source, quantize_weights(weights, source), config, draft_tokens, max_running)
    directory = Path(source)
    draft_config = check_draft_checkpoint(directory, config, tokenizer)
    return Speculation(source, load_weights(directory, draft_config), draft_config, draft_tokens, max_running)


def check_draft_checkpoint(directory: Path, config: GPT2Config, tokenizer: Tokenizer) -> GPT2Config:
    """The config of a draft checkpoint, after checking that it can draft for this target (its weights unread)."""
    if not (directory / CONFIG).is_file():
        raise GenerationError(f"speculate: expected 'int4', 'int8', 'ngram' or a GPT-2 checkpoint directory, got "
                              f"{str(directory)!r} (no {CONFIG} there)", param="speculate")
    draft_config = GPT2Config.from_json(directory / CONFIG)
    if draft_config.vocab_size != config.vocab_size:
        raise WeightsError(f"{directory}: the draft model's vocabulary has {draft_config.vocab_size} tokens, the "
                           f"target's {config.vocab_size}; a drafter needs the same vocabulary")
    draft_tokenizer = load_tokenizer(directory)
    if not same_tokenizer(draft_tokenizer, tokenizer):
        raise WeightsError(f"{directory}: the draft model's tokenizer (vocab.json / merges.txt) differs from the "
                           "target's; a drafter needs the same tokenizer")
    if draft_config.n_positions < config.n_positions:
        raise WeightsError(f"{directory}: the draft model's context ({draft_config.n_positions}) is shorter than the "
                           f"target's ({config.n_positions})")
    return draft_config


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers map the same ids to the same bytes (and so split text alike: the BPE merges are
    ranked by id)."""
    if a.n_vocab != b.n_vocab or a.eot_id != b.eot_id:
        return False
    try:
        return all(a.token_bytes(i) == b.token_bytes(i) for i in range(a.n_vocab) if i != a.eot_id)
    except KeyError:  # an id one of them does not have
        return False
