"""Speculative decoding's policy: how many tokens to draft, when, and the rule that accepts them. Data and pure
functions only: the scheduler plans with these, and the drafters that run models live in drafters.py.

A verify pass feeds a running sequence's next token and its K drafted tokens as K + 1 rows of one pass
(plan.Segment with `outputs` = K + 1), and the scheduler accepts the longest agreeing prefix plus one token of the
target's own (scheduler.Scheduler._verify). Why a verified token is the very token plain decoding would produce:
up to config.DECODE_ROWS rows, every projection and the head run on the row-invariant native kernels (each
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

import torch

from ..core.errors import GenerationError
from .sampling import SamplingParams, argmax, probabilities

MAX_DRAFT_TOKENS = 16  # K at most: K + 1 rows must stay within the row-invariant kernels' DECODE_ROWS
ADAPTIVE_START = 4  # adaptive K's first draft length
ADAPTIVE_MAX = 8  # and its longest: past that, a miss wastes more than a hit gains
PAUSE_TOKENS = 16  # adaptive K at 0: plain decoding for this many tokens, then a draft of 1 again
SERVE_MAX_RUNNING = 2  # the server drafts only while at most this many sequences run: beyond, batching pays better
# and only from a sequence's 4th generated token: clients that send their next requests together would otherwise see
# the first arrival draft alone for a step while the others' prompts wait for its draft passes
SERVE_SETTLE_TOKENS = 4


@dataclass(frozen=True)
class SpeculationPolicy:
    """How a run speculates, whatever drafts: K (`draft_tokens`; None: adaptive), `max_running`: draft only while at
    most this many sequences run (None: always), since a pass that already has many rows gains more from batching
    than from drafting; `settle`: tokens a sequence generates before its first draft."""

    draft_tokens: int | None = None
    max_running: int | None = None
    settle: int = 0

    def first_k(self) -> int:
        return self.draft_tokens or ADAPTIVE_START

    def limit(self) -> int:
        return self.draft_tokens or ADAPTIVE_MAX


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


def check_draft_tokens(k: int | None, name: str = "draft_tokens") -> None:
    """K's bounds, for the API and both commands (`name`: the argument or flag, as the user wrote it)."""
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS):
        raise GenerationError(f"{name} must be an integer in [1, {MAX_DRAFT_TOKENS}] (or none: adaptive), got {k!r}",
                              param="draft_tokens")
