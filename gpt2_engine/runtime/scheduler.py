"""Continuous batching, the planning half: slots, a waiting queue, and what each step runs. It never calls the model.

It imports data only (plan.py's types, requests, the pure sampling functions and the speculation policy): nothing
here loads the model, the runner or the native kernels.

`schedule()` admits waiting sequences into free slots and returns a Plan: the prompts to prefill alone (long ones,
and scored ones) and the passes to run, each a list of sequences whose rows share one pass over the weights (every
running sequence's next token at its own position, and the whole text of each new short prompt; at most
DECODE_ROWS rows a pass). `join(layer, rows)` says which waiting prompts may still join a pass that is open before
block `layer`. The runner (runner.py) executes; `update` and `after_prefill` consume its outputs (each row's greedy
pick and logsumexp, and the logits of the sequences that read them): they choose each sequence's next token and
return the Events, as data, to whoever drives the loop (loop.py). A finished or cancelled sequence frees its slot at
once. A plain greedy sequence (no penalty, bias, grammar or top logprobs) marks its segments `greedy`: its token is
the row's argmax and its logprob that logit less the logsumexp, so the runner never writes its logits.

Choosing tokens stays here, unlike vLLM's scheduler, whose sampler runs in the model runner on the GPU: a choice
decides what the plan does next (an accepted draft moves the sequence's position; a stop string or <|endoftext|>
frees its slot before the next admission), it reads per-sequence state the scheduler owns (penalty counts, the
seeded generator), and on the CPU it costs no device round trip. The detokenizer rides along for the same reason:
stop strings end sequences. What the model computes (the head, the argmaxes and the logsumexps) comes from the runner.

Speculative decoding (speculation.py): with a SpeculationPolicy, the plan also asks a drafter for K tokens for each
running sequence (`Plan.asks`, K adaptive per sequence unless fixed); the loop hands the drafts back (`drafted`),
and the sequence's next pass feeds its next token and the drafts as K + 1 rows; `update` accepts what the target
agrees with and emits every accepted token as an Event of its own, in order.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from typing import Any, NamedTuple

import numpy as np
import torch

from ..core.config import DECODE_ROWS, GPT2Config
from ..core.errors import GenerationError, one_line
from ..core.tokenizer import Detokenizer, Tokenizer
from .plan import (Draft, DraftAsk, Event, Finished, Output, Outputs, Plan, Prefill, Prefilled, Request, Segment,
                   SeqRef, TokenStats, check_request)
from .sampling import apply_penalties, choose
from .speculation import PAUSE_TOKENS, SpeculationPolicy, accept, next_k

log = logging.getLogger(__name__)


class SequenceState:
    """A request's state while it runs: its slot, position, generator, penalties' counts and detokenizer. `tag` and
    `index` are the caller's: whose request it is, and which of its sequences."""

    def __init__(self, request: Request, tokenizer: Tokenizer, vocab: int, tag: Any = None, index: int = 0,
                 id: int = 0) -> None:
        self.request, self.tag, self.index, self.id = request, tag, index, id
        self.generator = torch.Generator().manual_seed(request.seed)
        self.detok = Detokenizer(tokenizer, request.stop)
        self.tokens: list[int] = []
        self.slot = -1
        self.position = 0  # cache position of the next token to feed
        self.next_token: int | None = None  # chosen, not yet fed through the model
        self.started = False  # has run through the model (prefilled, or the prompt's rows in a pass)
        self.finished = False
        self.cancelled: str | None = None  # the reason, once cancelled
        self.draft: Draft | None = None  # drafted tokens riding in this step's pass, to be verified
        self.k = 0  # tokens to draft next (speculation: adaptive or fixed)
        self.resume_at = 0  # adaptive K at 0: len(tokens) from which a draft of 1 is tried again
        self.drafted = self.accepted = self.verified = 0  # drafted tokens, accepted ones, verify passes
        self.queued_at = time.perf_counter()  # when it started waiting for a slot
        s = request.sampling
        self.seen = self.counts = None
        if s.repetition_penalty != 1.0:  # prompt and generated tokens, as transformers counts them
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.seen[request.prompt] = True
        if s.presence_penalty or s.frequency_penalty:  # generated tokens only, as OpenAI counts them
            self.counts = torch.zeros(vocab)
        self.guide = request.constraint.guide() if request.constraint is not None else None  # its grammar's state
        self.banned = tokenizer.eot_id if request.ignore_eos else -1  # the token its argmax skips
        # ignore_eos: the logits the sampler reads, <|endoftext|> ruled out, written here at each step rather than
        # into a fresh copy (an allocation of 200 KB, and its page faults, every token); also a greedy sequence's,
        # whose first token comes from a prefill's logits (its later picks skip `banned` in the head)
        self.processed = torch.empty(vocab) if request.ignore_eos else None

    def segment(self) -> Segment:
        """This sequence's rows in its next pass: the whole prompt from position 0, or its next token (and its
        drafted tokens, each row's logits wanted)."""
        r = self.request
        if not self.started:
            return Segment(self.slot, 0, r.prompt, r.adapter, steering=r.steering, prompt_len=len(r.prompt),
                           greedy=self.argmax_only, banned=self.banned)
        ids = [self.next_token] + (self.draft.tokens if self.draft else [])
        return Segment(self.slot, self.position, ids, r.adapter, outputs=len(ids), steering=r.steering,
                       prompt_len=len(r.prompt), greedy=self.argmax_only, banned=self.banned)

    @property
    def argmax_only(self) -> bool:
        """Whether each token is the raw logits' argmax (skipping `banned`), its logprob all else it reports: greedy,
        with no penalty, logit bias, grammar or top logprobs reshaping or reading the logits."""
        r, s = self.request, self.request.sampling
        return (s.greedy and not s.logit_bias and self.seen is None and self.counts is None and self.guide is None
                and not r.top_logprobs)

    def context(self) -> list[int]:
        """The tokens at positions 0 .. position: the prompt, the generated tokens and the next one (not yet fed)."""
        return self.request.prompt + self.tokens

    @property
    def ref(self) -> SeqRef:
        return SeqRef(self.id, self.tag, self.index)

    def prefill(self) -> Prefill:
        """Its prompt as a prefill of its own (a long prompt, or a scored one)."""
        r = self.request
        return Prefill(self.id, self.slot, r.prompt, r.prompt_logprobs, r.top_logprobs, r.adapter, r.steering)

    def summary(self) -> Finished:
        return Finished(self.detok.text, list(self.tokens), len(self.request.prompt), self.drafted, self.accepted,
                        self.verified)


class Prediction(NamedTuple):
    """What the model gave for one next token of a sequence, as the scheduler reads it: the raw logits [V] (None for
    a greedy segment's row), the argmax skipping the sequence's banned token, that logit, and the logsumexp of the
    raw logits."""

    raw: torch.Tensor | None
    token: int
    logit: float
    lse: float

    def pick(self) -> int:
        """The greedy token; an error where the row had none (a NaN among its logits)."""
        if self.token < 0 or math.isnan(self.lse):
            raise ValueError("the model's logits hold NaN or no finite value; no token can be chosen")
        return self.token


class Scheduler:
    """Slots and a waiting queue over a cache of `slots` sequences of up to `max_len` positions."""

    def __init__(self, config: GPT2Config, tokenizer: Tokenizer, slots: int, max_len: int | None = None,
                 queue_timeout: float | None = None, speculation: SpeculationPolicy | None = None) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.speculation = speculation
        self.max_len = max_len or config.n_positions
        self.queue_timeout = queue_timeout  # seconds a sequence may wait for a slot (None: forever)
        self.slots: list[SequenceState | None] = [None] * slots
        self.waiting: deque[SequenceState] = deque()
        self.live: dict[int, SequenceState] = {}  # every sequence added and not yet finished, by id
        self.next_id = 0

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def idle(self) -> bool:
        return not self.waiting and self.running == 0

    def check(self, request: Request) -> None:
        """Raise GenerationError unless the request fits the model and this scheduler's cache."""
        check_request(request, self.config)
        if len(request.prompt) + max(request.max_new_tokens - 1, 0) > self.max_len:
            raise GenerationError(f"request needs more than this scheduler's {self.max_len} cache positions",
                                  param="max_new_tokens")

    def add(self, request: Request, tag: Any = None, index: int = 0) -> SeqRef:
        """Queue a request (check() it first); its events come out of the steps that run it, under the SeqRef
        returned."""
        seq = SequenceState(request, self.tokenizer, self.config.vocab_size, tag, index, self.next_id)
        self.next_id += 1
        if self.speculation is not None:
            seq.k = self.speculation.first_k()
        self.waiting.append(seq)
        self.live[seq.id] = seq
        return seq.ref

    def cancel(self, seq: int, reason: str = "cancelled") -> None:
        """Stop sequence `seq` (an id): it leaves its slot (or the queue) at the next schedule() with a final event
        of this reason."""
        if (s := self.live.get(seq)) is not None and not s.finished:
            s.cancelled = reason

    def schedule(self) -> Plan:
        """End what was cancelled or waited too long, admit what fits, and plan the step (see the module docstring)."""
        plan = Plan(finished=self._expire())
        work = [s for s in self.slots if s is not None]
        while self.waiting and None in self.slots:
            seq = self._place(self.waiting.popleft())
            if self._shares_pass(seq):
                work.append(seq)
            else:
                plan.prefills.append(seq.prefill())
        rows = 0
        for seq in work:  # passes of at most DECODE_ROWS rows
            segment = seq.segment()
            n = len(segment.ids)
            if k := self._draft_length(seq):
                plan.asks[seq.id] = self._ask(seq, k)
                n += k
            if not plan.passes or rows + n > DECODE_ROWS:
                plan.passes.append({})
                rows = 0
            plan.passes[-1][seq.id] = segment
            rows += n
        return plan

    def drafted(self, plan: Plan, drafts: list[Draft]) -> None:
        """The drafter's answers to the plan's asks, in their order: each rides in its sequence's segment of this
        step's pass (its rows follow the next token's)."""
        for (seq_id, ask), draft in zip(plan.asks.items(), drafts, strict=True):
            seq, n = self.live[seq_id], min(len(draft.tokens), ask.k)
            seq.draft = Draft(draft.tokens[:n], None if draft.q is None else draft.q[:n]) if n else None
            for segments in plan.passes:
                if seq_id in segments:
                    segments[seq_id] = seq.segment()

    def join(self, layer: int, rows: int) -> dict[int, Segment]:
        """Waiting prompts that join a pass of `rows` rows before its block `layer`, placed in free slots: their
        segments by sequence id.

        Only in the first half of the blocks: at 8 clients a request that arrives mid-pass would otherwise wait for
        the rest of the pass and then a pass of its own; later, catching up the earlier blocks alone would cost the
        running sequences more than the newcomer saves, and it waits for the next pass."""
        if 2 * layer >= self.config.n_layer:
            return {}
        joined = {}
        while (self.waiting and None in self.slots and self._shares_pass(self.waiting[0])
               and rows + len(self.waiting[0].request.prompt) <= DECODE_ROWS):
            seq = self._place(self.waiting.popleft())
            joined[seq.id] = seq.segment()
            rows += len(seq.request.prompt)
        return joined

    def update(self, segments: dict[int, Segment], out: Outputs) -> list[Output]:
        """Consume a pass's outputs (its segments as the plan gave them, by sequence id, in row order: each one's
        output rows' Picks, and their logits unless the segment was greedy): choose each next token. A sequence
        whose sampling fails ends with an 'error' event; the others go on."""
        with contextlib.ExitStack() as held:  # each grammar process once for the step's tokens: Guide.step
            for guide in {id(s.guide.worker): s.guide for s in map(self.live.get, segments) if s and s.guide}.values():
                held.enter_context(guide.step())
            return self._choose(segments, out)

    def _choose(self, segments: dict[int, Segment], out: Outputs) -> list[Output]:
        """update's work, the grammar processes held."""
        result, first, kept = [], 0, 0
        picks = out.picks
        for seq_id, seg in segments.items():
            seq, n = self.live[seq_id], seg.outputs
            rows = [Prediction(None if seg.greedy else out.logits[kept + i], picks.tokens[first + i],
                               picks.logit[first + i], picks.lse[first + i]) for i in range(n)]
            first, kept = first + n, kept + (0 if seg.greedy else n)
            if seq.draft is not None:
                result += self._verify(seq, seg, rows)
                continue
            seq.started, seq.position = True, seg.start + len(seg.ids)
            result.append(self._advance_or_fail(seq, rows[-1]))
        return result

    def after_prefill(self, seq_id: int, done: Prefilled) -> Output:
        """Consume a prefill: the next token's logits [V] and their logsumexp, the prompt's stats when it was scored,
        and how many of its prompt tokens the prefix cache held."""
        seq = self.live[seq_id]
        seq.started, seq.position = True, len(seq.request.prompt)
        if seq.request.max_new_tokens == 0:
            out = self._finish(seq, "length", Event(None, "", prompt_stats=done.stats))
        else:
            out = self._advance_or_fail(seq, Prediction(done.logits, -1, math.nan, done.lse), done.stats)
        out[1].cached_tokens = done.cached
        return out

    def fail(self, seq_ids: list[int], error: str) -> list[Output]:
        """End these sequences with finish reason 'error' (their step failed); their slots are free again."""
        return [self._finish(self.live[i], "error", Event(None, "", error=error)) for i in seq_ids if i in self.live]

    # --- internals ------------------------------------------------------------------------------------------------

    def _expire(self) -> list[Output]:
        """The final events of sequences cancelled, or waiting past the queue timeout; they leave queue and slots."""
        now, out = time.perf_counter(), []
        for seq in list(self.waiting):
            if self.queue_timeout is not None and not seq.cancelled and now - seq.queued_at > self.queue_timeout:
                seq.cancelled = "queue_timeout"
            if seq.cancelled:
                self.waiting.remove(seq)
                out.append(self._finish(seq, seq.cancelled))
        return out + [self._finish(seq, seq.cancelled) for seq in self.slots if seq is not None and seq.cancelled]

    def _ask(self, seq: SequenceState, k: int) -> DraftAsk:
        r = seq.request
        excluded = (self.tokenizer.eot_id,) if r.ignore_eos else ()
        return DraftAsk(seq.slot, seq.context(), k, r.sampling, seq.generator, excluded, r.steering, len(r.prompt))

    def _place(self, seq: SequenceState) -> SequenceState:
        seq.slot = self.slots.index(None)
        self.slots[seq.slot] = seq
        return seq

    @staticmethod
    def _shares_pass(seq: SequenceState) -> bool:
        """Whether a new sequence's prompt can run as rows of a shared pass (short, not scored, not cancelled)."""
        r = seq.request
        return (not seq.cancelled and len(r.prompt) <= DECODE_ROWS and not r.prompt_logprobs
                and r.max_new_tokens > 0)

    def _finish(self, seq: SequenceState, reason: str, event: Event | None = None) -> Output:
        seq.finished = True
        if seq.guide is not None:
            seq.guide.close()
        if 0 <= seq.slot and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None  # the slot is free for the next admissions
        self.live.pop(seq.id, None)
        event = event or Event(None, "")
        event.text += seq.detok.finish() if reason in ("eos", "stop", "length") else ""
        event.finish_reason = reason
        event.done = seq.summary()
        return seq.ref, event

    def _advance_or_fail(self, seq: SequenceState, row: Prediction, prompt_stats: TokenStats | None = None) -> Output:
        try:
            return self._advance(seq, row, prompt_stats)
        except Exception as e:  # noqa: BLE001 - one sequence's failure (a NaN row, a sampler bug) ends only it
            logged(e, "choosing the next token of a sequence failed")
            return self._finish(seq, "error", Event(None, "", error=describe(e)))

    def _advance(self, seq: SequenceState, row: Prediction, prompt_stats: TokenStats | None) -> Output:
        """Choose the next token from a row (its raw logits, or its greedy pick), and finish the sequence if done."""
        token = row.pick() if row.raw is None else choose(self._processed(seq, row.raw), seq.request.sampling,
                                                          seq.generator)
        return self._emit(seq, token, row, prompt_stats)

    def _processed(self, seq: SequenceState, raw: torch.Tensor) -> torch.Tensor:
        """Raw logits [V] -> what the sampler reads: a grammar's mask first (so that the penalties, the temperature
        and the filters work within the allowed tokens), the penalties, and <|endoftext|> ruled out with
        ignore_eos. `raw` itself is never written: the logprobs are the model's."""
        r = seq.request
        if seq.guide is not None:
            raw = seq.guide.mask(raw)
        processed = apply_penalties(raw, r.sampling, seq.seen, seq.counts)
        if seq.processed is not None:
            processed = seq.processed.copy_(processed)
            processed[self.tokenizer.eot_id] = -math.inf
        return processed

    def _verify(self, seq: SequenceState, seg: Segment, rows: list[Prediction]) -> list[Output]:
        """A verify pass's rows for the next token and K drafts: the accepted drafts and one token of the target's
        own, each an Output (speculation.accept's rule; fewer where the sequence finishes first)."""
        draft, seq.draft = seq.draft, None
        out, accepted = [], 0
        seq.started = True
        # counted before any token is emitted: the token that finishes the sequence takes its summary
        seq.drafted += len(draft.tokens)
        seq.verified += 1
        try:
            for i, row in enumerate(rows):
                if row.raw is None:  # greedy: a draft is accepted iff it is the argmax
                    token = row.pick()
                elif i < len(draft.tokens):
                    q = None if draft.q is None else draft.q[i]
                    token = accept(self._processed(seq, row.raw), seq.request.sampling, draft.tokens[i], q,
                                   seq.generator)
                else:
                    token = choose(self._processed(seq, row.raw), seq.request.sampling, seq.generator)
                if i < len(draft.tokens) and token == draft.tokens[i]:
                    accepted += 1
                    seq.accepted += 1
                out.append(self._emit(seq, token, row, None))
                if seq.finished or i == accepted:  # finished, or this token was the target's own
                    break
        except Exception as e:  # noqa: BLE001 - as _advance_or_fail: one sequence's failure ends only it
            logged(e, "verifying the drafts of a sequence failed")
            out.append(self._finish(seq, "error", Event(None, "", error=describe(e))))
        seq.position = seg.start + 1 + accepted
        if not self.speculation.draft_tokens:
            seq.k = next_k(seq.k, len(draft.tokens), accepted, self.speculation.limit())
            if seq.k == 0:
                seq.resume_at = len(seq.tokens) + PAUSE_TOKENS
        return out

    def _draft_length(self, seq: SequenceState) -> int:
        """How many tokens to draft for a running sequence this step (0: none): its K, within the tokens it still
        needs (a verify pass emits up to K + 1), while few enough sequences run."""
        spec = self.speculation
        if spec is None or not seq.started or len(seq.tokens) < spec.settle or (
                spec.max_running is not None and self.running > spec.max_running):
            return 0
        if seq.k == 0 and len(seq.tokens) >= seq.resume_at:
            seq.k = 1
        return min(seq.k, seq.request.max_new_tokens - len(seq.tokens) - 1)

    def _emit(self, seq: SequenceState, token: int, row: Prediction, prompt_stats: TokenStats | None) -> Output:
        """Record the chosen token (its row for the logprobs) and finish the sequence if done."""
        r, eot, raw, lse = seq.request, self.tokenizer.eot_id, row.raw, row.lse
        # in float32, as top_logprobs' values - lse are: the same token gets the same number in both lists
        logprob = float(np.float32(row.logit if raw is None else raw[token]) - np.float32(lse))
        top = rank = None
        if r.top_logprobs:
            values, ids = raw.topk(r.top_logprobs)
            top = list(zip(ids.tolist(), (values - lse).tolist()))
            rank = int((raw > raw[token]).sum())
        event = Event(token, "", logprob, top, rank=rank, prompt_stats=prompt_stats)
        if seq.guide is not None:
            seq.guide.accept(token)
        if token == eot:
            return self._finish(seq, "eos", event)
        seq.tokens.append(token)
        if seq.seen is not None:
            seq.seen[token] = True
        if seq.counts is not None:
            seq.counts[token] += 1
        if seq.detok.add(token):
            return self._finish(seq, "stop", event)
        if seq.guide is not None and seq.guide.finished:  # the grammar is complete: only its end may follow
            return self._finish(seq, "stop", event)
        if len(seq.tokens) == r.max_new_tokens:
            return self._finish(seq, "length", event)
        event.text = seq.detok.ready()
        seq.next_token = token
        return seq.ref, event


def logged(error: Exception, what: str) -> None:
    """Log a sequence's failure: the request's own fault (a GenerationError: its grammar over a limit, say) as one
    line at INFO (its caller gets the error itself: a 400, the command line's one line), anything else (a bug, a NaN
    row) with its traceback."""
    if isinstance(error, GenerationError):
        log.info("%s: %s", what, describe(error))
    else:
        log.error(what, exc_info=error)


def describe(error: BaseException) -> str:
    """An exception as one line: its type and its first 300 characters."""
    text = one_line(error, 300)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__

# Next: runtime/runner.py, which executes a Plan's passes and prefills on the weights and the KV cache.
