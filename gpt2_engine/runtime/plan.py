"""The data the runtime hands around: what a pass runs (Segment), what comes back (Outputs, Prefilled, TokenStats),
what a drafter is asked and answers (DraftAsk, Draft), and what a step produced for a sequence (Event).

Nothing here computes: the scheduler (scheduler.py) plans in these types without importing the runner or the model,
and the runner (runner.py) and the drafters (drafters.py) execute them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from .sampling import SamplingParams

if TYPE_CHECKING:
    from ..interp.steering import Steering


class Segment(NamedTuple):
    """A sequence's rows in a pass: `ids` are fed at positions [start, start + len(ids)) of cache slot `slot`, with
    LoRA adapter `adapter` of the weights (-1: the base; None: adapter 0, a model with one). The pass returns the
    logits after its last `outputs` rows (a speculative verify pass needs every row's: runtime/speculation.py).
    `steering`: the sequence's edits (interp/steering.py), which read each row's position against `prompt_len`.
    `greedy`: the sequence needs only each output row's argmax (skipping token `banned`, -1: none) and logsumexp,
    not its logits, which the pass then never writes (Picks)."""

    slot: int
    start: int
    ids: list[int]
    adapter: int | None = None
    outputs: int = 1
    steering: tuple[Steering, ...] = ()
    prompt_len: int = 0
    greedy: bool = False
    banned: int = -1


class Picks(NamedTuple):
    """What a greedy step needs of each output row of a pass: the argmax (skipping its banned token; -1 where the row
    has no value above -inf, or a NaN), that logit, and the logsumexp of the whole row (NaN where the row holds one)."""

    tokens: list[int]
    logit: list[float]
    lse: list[float]


class Outputs(NamedTuple):
    """A pass's results for its n output rows (each segment's last `outputs` rows, segment by segment): the logits
    of the rows of segments that are not `greedy` [k, V], in order, and for every row its Picks (the argmax skipping
    its segment's banned token, that logit, and the logsumexp), each row reduced alone in a fixed order
    (projection.reduce_rows, RowHead.select), so that a token and its logprob never depend on what else shared the
    pass."""

    logits: torch.Tensor
    picks: Picks


@dataclass
class TokenStats:
    """What the model thought of N actual next tokens: each a row of the next-token distribution and its target."""

    logprob: torch.Tensor  # [N] float32, natural log
    rank: torch.Tensor | None = None  # [N] long: how many tokens scored strictly higher (0 = the argmax, as GLTR)
    entropy: torch.Tensor | None = None  # [N] nats, of the full distribution
    top_ids: torch.Tensor | None = None  # [N, k] the k most likely tokens
    top_logprobs: torch.Tensor | None = None  # [N, k]

    def rows(self, lo: int, hi: int) -> TokenStats:
        """Rows [lo, hi) of every field."""
        return TokenStats(*(None if t is None else t[lo:hi] for t in
                            (self.logprob, self.rank, self.entropy, self.top_ids, self.top_logprobs)))

    @staticmethod
    def cat(parts: list[TokenStats]) -> TokenStats:
        def join(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if not values or values[0] is None else torch.cat(values)

        return TokenStats(*(join(n) for n in ("logprob", "rank", "entropy", "top_ids", "top_logprobs")))


class Prefilled(NamedTuple):
    """A prompt run into a cache slot: the next token's logits [V], the prompt's stats when scored (targets 1..T-1),
    and how many of its tokens' keys and values came from the prefix cache."""

    logits: torch.Tensor
    lse: float  # the logits' logsumexp (projection.reduce_rows), for the next token's logprob
    stats: TokenStats | None
    cached: int


class DraftAsk(NamedTuple):
    """What a drafter is asked for one sequence: `k` tokens to follow `context`, the sequence's tokens at positions
    0 .. len(context) - 1 of cache slot `slot` (prompt, generated text, and the next token, not yet fed); `excluded`:
    tokens the sequence may not produce (<|endoftext|> with ignore_eos), which a draft of them would only waste;
    `steering` and `prompt_len`: the sequence's (Segment's)."""

    slot: int
    context: list[int]
    k: int
    sampling: SamplingParams
    generator: torch.Generator
    excluded: tuple[int, ...] = ()
    steering: tuple[Steering, ...] = ()  # the sequence's edits, which a draft model of the target's shape applies too
    prompt_len: int = 0


class Draft(NamedTuple):
    """Drafted tokens (at most the k asked; maybe none) and, for each, the distribution it was drawn from (q [n, V]);
    q None: chosen deterministically (a point mass)."""

    tokens: list[int]
    q: torch.Tensor | None = None


@dataclass
class Event:
    """What one step produced for one sequence: its new token (None for the prompt-scoring event), the text that
    became final, and, on its last event, why it finished ('eos', 'stop', 'length', 'cancelled', 'queue_timeout',
    'shutdown', or 'error' with `error` saying what failed)."""

    token: int | None
    text: str
    logprob: float | None = None  # log p(token) under the raw distribution
    top: list[tuple[int, float]] | None = None  # the most likely alternatives (token id, logprob)
    rank: int | None = None  # with top_logprobs: how many tokens were likelier (0 = the argmax, as GLTR counts)
    finish_reason: str | None = None
    prompt_stats: TokenStats | None = None  # with prompt_logprobs, on the first event: one row per prompt token after the first
    error: str | None = None  # with finish_reason 'error': what failed, in one line
    cached_tokens: int = 0  # on a prefilled sequence's first event: its prompt tokens the prefix cache held
