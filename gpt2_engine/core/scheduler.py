"""Continuous batching: one loop owns the model and a slot-based KV cache; sequences join and leave between steps.

Each step admits waiting sequences into free slots, then runs one pass over the weights (model.forward_segments; one
per DECODE_ROWS rows) with every running sequence's next token at its own position and the whole text of each new
short prompt; a new prompt may also join a pass during its first half of the blocks (see Scheduler.step). A prompt
longer than DECODE_ROWS, or one whose tokens are scored, is prefilled alone. Projections and the head are
row-invariant and attention stays within each sequence's slot, so a sequence's tokens depend only on its own prompt,
parameters and seed, never on what else shares the steps. A finished or cancelled sequence frees its slot at once.

The scheduler is single-threaded: `gpt2 generate` drives it directly, the server from its engine thread.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import GPT2Config
from .errors import GenerationError
from .model import KVCache, forward, forward_segments, logits, residual_stream
from .projection import DECODE_ROWS
from .sampling import SamplingParams, apply_penalties, choose
from .scoring import TokenStats, token_stats
from .tokenizer import Tokenizer
from .weights import GPT2Weights


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


@dataclass
class Event:
    """What one step produced for one sequence: its new token (None for the prompt-scoring event), the text that
    became final, and, on its last event, why it finished ('eos', 'stop', 'length' or 'cancelled')."""

    token: int | None
    text: str
    logprob: float | None = None  # log p(token) under the raw distribution
    top: list[tuple[int, float]] | None = None  # the most likely alternatives (token id, logprob)
    rank: int | None = None  # with top_logprobs: how many tokens were likelier (0 = the argmax, as GLTR counts)
    finish_reason: str | None = None
    prompt_stats: TokenStats | None = None  # with prompt_logprobs, on the first event: one row per prompt token after the first


def incomplete_utf8_tail(data: bytes) -> int:
    """How many bytes at the end of `data` start a UTF-8 character that later bytes may complete (0 to 3)."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the lead byte of the last character
            need = 2 if 0xC0 <= byte < 0xE0 else 3 if 0xE0 <= byte < 0xF0 else 4 if 0xF0 <= byte < 0xF8 else 1
            return back if need > back else 0
    return 0


class Detokenizer:
    """Turns one sequence's tokens into text that is safe to show: never half a UTF-8 character, never the
    beginning of what may turn out to be a stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.pending = b""  # bytes of an incomplete character
        self.text = ""  # all decoded text so far (cut at a stop string once one is found)
        self.emitted = 0  # how much of self.text has been handed out

    def add(self, token_id: int) -> bool:
        """Append a token; True when the text now contains a stop string (the text is cut before it)."""
        self.pending += self.tokenizer.token_bytes(token_id)
        cut = len(self.pending) - incomplete_utf8_tail(self.pending)
        if cut:
            self.text += self.pending[:cut].decode("utf-8", errors="replace")
            self.pending = self.pending[cut:]
        return self._cut_at_stop()

    def finish(self) -> str:
        """Flush what is held back (an unfinished character becomes U+FFFD) and return the rest of the text."""
        if self.pending:
            self.text += self.pending.decode("utf-8", errors="replace")
            self.pending = b""
            self._cut_at_stop()
        return self._take(len(self.text))

    def ready(self) -> str:
        """New text that no later token can change."""
        hold = 0
        for s in self.stop:  # the longest tail of the text that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:n]):
                    hold = n
                    break
        return self._take(len(self.text) - hold)

    def _take(self, end: int) -> str:
        piece = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece

    def _cut_at_stop(self) -> bool:
        if not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        start = max(0, self.emitted - longest)  # a stop string cannot end inside text already emitted
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False


class Sequence:
    """A request's state while it runs: its slot, position, generator, penalties' counts and detokenizer."""

    def __init__(self, request: Request, emit: Callable[[Event], None], tokenizer: Tokenizer, vocab: int) -> None:
        self.request = request
        self.emit = emit
        self.generator = torch.Generator().manual_seed(request.seed)
        self.detok = Detokenizer(tokenizer, request.stop)
        self.tokens: list[int] = []
        self.slot = -1
        self.position = 0  # cache position of the next token to feed
        self.next_token: int | None = None  # chosen, not yet fed through the model
        self.finished = False
        self.cancelled: str | None = None  # the reason, once cancelled
        self.queued_at = time.perf_counter()  # when it started waiting for a slot
        s = request.sampling
        self.seen = self.counts = None
        if s.repetition_penalty != 1.0:  # prompt and generated tokens, as transformers counts them
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.seen[request.prompt] = True
        if s.presence_penalty or s.frequency_penalty:  # generated tokens only, as OpenAI counts them
            self.counts = torch.zeros(vocab)


def check_request(request: Request, config: GPT2Config) -> None:
    """Raise GenerationError unless the request fits the model: valid ids, and prompt + max_new_tokens - 1 positions
    (the last new token is never fed back) within the context."""
    if not request.prompt:
        raise GenerationError("the prompt is empty (an empty text prompt starts from <|endoftext|>)")
    if any(not 0 <= t < config.vocab_size for t in request.prompt):
        raise GenerationError(f"prompt token ids must be in [0, {config.vocab_size})")
    need = len(request.prompt) + max(request.max_new_tokens - 1, 0)
    if need > config.n_positions:
        raise GenerationError(
            f"prompt of {len(request.prompt)} tokens + max_new_tokens {request.max_new_tokens} exceeds the context of "
            f"{config.n_positions} tokens; shorten the prompt or lower max_new_tokens")


class Scheduler:
    """Slots, a waiting queue and the step loop over one model's weights."""

    def __init__(self, weights: GPT2Weights, config: GPT2Config, tokenizer: Tokenizer, slots: int,
                 max_len: int | None = None) -> None:
        self.weights, self.config, self.tokenizer = weights, config, tokenizer
        self.cache = KVCache.allocate(config, slots, max_len or config.n_positions)  # [n_layer, slots, nh, L, hs]
        self.slots: list[Sequence | None] = [None] * slots
        self.waiting: deque[Sequence] = deque()

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    def add(self, request: Request, emit: Callable[[Event], None]) -> Sequence:
        """Queue a request; its events go to `emit` as steps produce them."""
        check_request(request, self.config)
        if len(request.prompt) + max(request.max_new_tokens - 1, 0) > self.cache.max_len:
            raise GenerationError(f"request needs more than this scheduler's {self.cache.max_len} cache positions")
        seq = Sequence(request, emit, self.tokenizer, self.config.vocab_size)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Stop a sequence: it leaves its slot (or the queue) at the next step with a final event of this reason."""
        seq.cancelled = reason

    def step(self, intake: Callable[[], None] | None = None) -> bool:
        """Admit what fits, then one pass over the weights (one per DECODE_ROWS rows) that advances every running
        sequence and runs every new short prompt. True while work remains.

        `intake`, if given, takes the requests and cancellations that arrived since (the server's engine thread
        passes its inbox). It is called before each block of the step's last pass, and in the first half of the
        blocks new short prompts that fit join that pass (model.forward_segments): at 8 clients a request that
        arrives mid-pass had waited for the rest of it and then for a pass of its own. Later, catching up alone
        would cost the running sequences more than the newcomer saves, and it waits for the next pass."""
        self._drop_cancelled()
        running = [s for s in self.slots if s is not None and not s.finished]
        new: list[Sequence] = []
        while self.waiting and None in self.slots:
            seq = self._place(self.waiting.popleft())
            if self._can_join(seq):
                new.append(seq)
            else:
                self._prefill(seq)  # alone, through the whole-sequence forward
        work = [(s, [s.next_token], s.position) for s in running] + [(s, s.request.prompt, 0) for s in new]
        passes: list[list[tuple[Sequence, list[int], int]]] = [[]]
        for item in work:  # passes hold at most DECODE_ROWS rows; each pass's events go out at once
            if passes[-1] and sum(len(ids) for _, ids, _ in passes[-1]) + len(item[1]) > DECODE_ROWS:
                passes.append([])
            passes[-1].append(item)
        for p, chunk in enumerate(passes):
            if not chunk:
                continue  # only prompts prefilled alone this step
            joined: list[Sequence] = []

            def join(layer: int, rows: int) -> list[tuple[int, int, list[int]]]:
                if intake is None:
                    return []
                intake()
                if 2 * layer >= self.config.n_layer:
                    return []
                more = []
                while (self.waiting and None in self.slots and self._can_join(self.waiting[0])
                       and rows + len(self.waiting[0].request.prompt) <= DECODE_ROWS):
                    more.append(self._place(self.waiting.popleft()))
                    rows += len(more[-1].request.prompt)
                joined.extend(more)
                return [(s.slot, 0, s.request.prompt) for s in more]

            with torch.inference_mode():
                out = forward_segments(self.weights, self.config, [(s.slot, start, ids) for s, ids, start in chunk],
                                       self.cache, join if p == len(passes) - 1 else None)  # [n, V], joined ones last
                lses = torch.logsumexp(out, -1).tolist()  # [n]: one call for the pass, not one per row
            for (seq, ids, start), row, lse in zip(chunk + [(s, s.request.prompt, 0) for s in joined], out, lses):
                seq.position = start + len(ids)
                self._advance(seq, row, lse)
        return bool(self.waiting) or self.running > 0

    # --- internals ------------------------------------------------------------------------------------------------

    def _place(self, seq: Sequence) -> Sequence:
        seq.slot = self.slots.index(None)
        self.slots[seq.slot] = seq
        return seq

    @staticmethod
    def _can_join(seq: Sequence) -> bool:
        """Whether a new sequence's prompt can run as rows of a shared pass (short, not scored, not cancelled)."""
        r = seq.request
        return (not seq.cancelled and len(r.prompt) <= DECODE_ROWS and not r.prompt_logprobs
                and r.max_new_tokens > 0)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            self._finish(seq, seq.cancelled)
        for seq in self.slots:
            if seq is not None and seq.cancelled and not seq.finished:
                self._finish(seq, seq.cancelled)

    def _finish(self, seq: Sequence, reason: str, event: Event | None = None) -> None:
        seq.finished = True
        if 0 <= seq.slot and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None  # the slot is free for the next step's admissions
        event = event or Event(None, "")
        event.text += seq.detok.finish() if reason in ("eos", "stop", "length") else ""
        event.finish_reason = reason
        seq.emit(event)

    def _prefill(self, seq: Sequence) -> None:
        """Run the prompt alone through the model into the sequence's slot, then choose its first token."""
        r, w, cfg = seq.request, self.weights, self.config
        ids = torch.tensor([r.prompt])  # [1, T]
        view = KVCache(self.cache.k[:, seq.slot : seq.slot + 1], self.cache.v[:, seq.slot : seq.slot + 1])
        prompt_stats = None
        with torch.inference_mode():
            if r.prompt_logprobs:
                x = residual_stream(w, cfg, ids, cache=view, start=0)[0]  # [T, C]
                prompt_stats = token_stats(w, cfg, x[:-1], ids[0, 1:], top=r.top_logprobs)
                next_logits = logits(w, cfg, x[-1:])[0]  # [V]
            else:
                next_logits = forward(w, cfg, ids, cache=view, start=0, last_only=True)[0, -1]  # [V]
        seq.position = len(r.prompt)
        if r.max_new_tokens == 0:
            self._finish(seq, "length", Event(None, "", prompt_stats=prompt_stats))
            return
        self._advance(seq, next_logits, float(torch.logsumexp(next_logits, -1)), prompt_stats)

    def _advance(self, seq: Sequence, raw: torch.Tensor, lse: float, prompt_stats: TokenStats | None = None) -> None:
        """Choose the next token from raw logits [V] (lse: their logsumexp), emit it, and finish the sequence if it
        is done."""
        r, eot = seq.request, self.tokenizer.eot_id
        processed = apply_penalties(raw, r.sampling, seq.seen, seq.counts)
        if r.ignore_eos:
            processed = processed.clone() if processed is raw else processed
            processed[eot] = -math.inf
        token = choose(processed, r.sampling, seq.generator)
        logprob = float(raw[token]) - lse
        top = rank = None
        if r.top_logprobs:
            values, ids = raw.topk(r.top_logprobs)
            top = list(zip(ids.tolist(), (values - lse).tolist()))
            rank = int((raw > raw[token]).sum())
        event = Event(token, "", logprob, top, rank=rank, prompt_stats=prompt_stats)
        if token == eot:
            self._finish(seq, "eos", event)
            return
        seq.tokens.append(token)
        if seq.seen is not None:
            seq.seen[token] = True
        if seq.counts is not None:
            seq.counts[token] += 1
        if seq.detok.add(token):
            self._finish(seq, "stop", event)
        elif len(seq.tokens) == r.max_new_tokens:
            self._finish(seq, "length", event)
        else:
            event.text = seq.detok.ready()
            seq.next_token = token
            seq.emit(event)
