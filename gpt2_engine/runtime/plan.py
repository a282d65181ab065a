"""The data the runtime hands around: a step's Plan (the prompts to prefill alone, the drafts to ask for, the passes
to run, each keyed by the scheduler's sequence id), what a pass runs (Segment), what comes back (Outputs,
Prefilled, TokenStats), what a drafter is asked and answers (DraftAsk, Draft), and what a step produced for a
sequence (Event, with a Finished summary on its last one).

Nothing here computes: the scheduler (scheduler.py) plans in these types without importing the runner or the model,
the runner (runner.py) and the drafters (drafters.py) execute them, and the loop (loop.py) carries them from one to
the other, reading only these types, never the scheduler's own records (as vLLM v1's SchedulerOutput).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..core.config import GPT2Config
from ..core.errors import GenerationError
from .sampling import SamplingParams

if TYPE_CHECKING:  # the types only: the plan carries a request's grammar and edits, and never runs them
    from ..interp.spec import Steering
    from .constraints import Compiled


@dataclass(frozen=True)
class Request:
    """One sequence to generate. `top_logprobs` alternatives are reported per generated token (0: none);
    `prompt_logprobs` scores the prompt's tokens too (OpenAI's echo + logprobs)."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int = 0
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    adapter: int | None = None  # which of the weights' LoRA adapters (-1: the base; None: the model's own)
    constraint: Compiled | None = None  # the grammar the text must match (runtime/constraints.py)
    steering: tuple[Steering, ...] = ()  # edits on the activations while it runs (interp/steering.py)


def check_request(request: Request, config: GPT2Config) -> None:
    """Raise GenerationError unless the request fits the model: valid ids, and prompt + max_new_tokens - 1 positions
    (the last new token is never fed back) within the context."""
    if not request.prompt:
        raise GenerationError("the prompt is empty (an empty text prompt starts from <|endoftext|>)", param="prompt")
    if any(not 0 <= t < config.vocab_size for t in request.prompt):
        raise GenerationError(f"prompt token ids must be in [0, {config.vocab_size})", param="prompt")
    need = len(request.prompt) + max(request.max_new_tokens - 1, 0)
    if need > config.n_positions:
        raise GenerationError(
            f"prompt of {len(request.prompt)} tokens + max_new_tokens {request.max_new_tokens} exceeds the context of "
            f"{config.n_positions} tokens; shorten the prompt or lower max_new_tokens", param="max_new_tokens")



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
    done: Finished | None = None  # on the last event: what the sequence came to


class Finished(NamedTuple):
    """What a sequence came to, on its last Event: its text (the stop string and what follows it cut), its generated
    tokens (<|endoftext|> not among them), its prompt's length, and its speculation counts (drafted tokens, accepted
    ones, verify passes)."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    drafted: int = 0
    accepted: int = 0
    verified: int = 0


class SeqRef(NamedTuple):
    """Whose an Event is: the scheduler's id of the sequence, and the caller's `tag` and `index` given with it."""

    id: int
    tag: Any = None
    index: int = 0


Output = tuple[SeqRef, Event]


class Prefill(NamedTuple):
    """A prompt the runner runs alone into its cache slot (a long one, or one scored): ModelRunner.prefill's
    arguments, for sequence `seq`."""

    seq: int
    slot: int
    prompt: list[int]
    scored: bool = False
    top: int = 0
    adapter: int | None = None
    steering: tuple[Steering, ...] = ()


@dataclass
class Plan:
    """One step, as data: sequences that ended before running (cancelled, timed out), prompts to prefill alone, drafts
    to ask for (by sequence id; the answers go back through Scheduler.drafted, which puts them into the passes), and
    the passes, each the segments that share one pass over the weights, by sequence id, in row order."""

    finished: list[Output] = field(default_factory=list)
    prefills: list[Prefill] = field(default_factory=list)
    asks: dict[int, DraftAsk] = field(default_factory=dict)
    passes: list[dict[int, Segment]] = field(default_factory=list)
