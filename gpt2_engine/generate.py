"""Text generation: prefill the prompt into a preallocated KV cache, then decode one token at a time.

Several prompts run as one batch, left-padded: every sequence's last prompt token sits in the same cache slot, a key
mask hides the padding slots, and each sequence counts its positions from its own first token.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .errors import GenerationError
from .model import KVCache, forward
from .sampling import SamplingParams, process_logits, sample
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .engine import GPT2


@dataclass(frozen=True)
class GenerationSettings:
    """Everything that shapes one generation run; the defaults are the CLI's and the API's."""

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # the text ends before the first stop string
    ignore_eos: bool = False  # never end at <|endoftext|>: its logit is set to -inf, as llama.cpp's --ignore-eos does
    seed: int | None = None  # None: a fresh random seed, reported in GenerationStats
    num_samples: int = 1  # completions per prompt
    truncate: str | None = None  # "left": keep the last tokens of a prompt that does not fit

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 0:
            raise GenerationError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise GenerationError(f"num_samples must be an integer >= 1, got {self.num_samples!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise GenerationError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        if self.truncate not in (None, "left"):
            raise GenerationError(f"truncate must be None or 'left', got {self.truncate!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise GenerationError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")


@dataclass
class Completion:
    """One generated sequence. finish_reason: 'eos' (<|endoftext|>), 'stop' (a stop string) or 'length'."""

    text: str
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the model's raw distribution (before temperature and filters)
    finish_reason: str
    prompt_tokens: int


@dataclass
class GenerationStats:
    seed: int
    prompt_tokens: int = 0  # summed over the batch, padding excluded
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    truncated_tokens: int = 0  # prompt tokens dropped by truncate="left"

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else math.nan

    @property
    def decode_tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds else math.nan


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


class Generation:
    """One generation run over a batch of prompts. Iterate it to stream (sequence index, text) pieces as they
    become final; afterwards `completions` and `stats` hold the results. Sequence i is sample i % num_samples of
    prompt i // num_samples."""

    def __init__(self, model: GPT2, prompts: list[list[int]], settings: GenerationSettings) -> None:
        if not prompts:
            raise GenerationError("no prompt given")
        self.model = model
        self.settings = settings
        limit = model.config.n_positions
        if settings.max_new_tokens > limit:
            raise GenerationError(f"max_new_tokens ({settings.max_new_tokens}) must be at most the context length {limit}")
        seed = settings.seed if settings.seed is not None else int.from_bytes(os.urandom(7), "little")
        self.stats = GenerationStats(seed=seed)
        self.generator = torch.Generator().manual_seed(seed)
        fitted = []
        for p in prompts:
            p = list(p) or [model.tokenizer.eot_id]  # an empty prompt starts from <|endoftext|>, as in training
            if any(not 0 <= t < model.config.vocab_size for t in p):
                raise GenerationError(f"prompt token ids must be in [0, {model.config.vocab_size})")
            room = limit - max(settings.max_new_tokens - 1, 0)  # the last new token is never fed back: no position
            if len(p) > room:
                if settings.truncate != "left":
                    raise GenerationError(
                        f"prompt of {len(p)} tokens + max_new_tokens {settings.max_new_tokens} exceeds the context of "
                        f"{limit} tokens; shorten the prompt, lower max_new_tokens, or truncate from the left")
                self.stats.truncated_tokens = max(self.stats.truncated_tokens, len(p) - room)
                p = p[-room:]
            fitted.extend([p] * settings.num_samples)
        self.prompts = fitted
        self.completions: list[Completion] = []

    def __iter__(self) -> Iterator[tuple[int, str]]:
        model, s = self.model, self.settings
        B = len(self.prompts)
        T = max(len(p) for p in self.prompts)  # the prompts end together at slot T - 1
        pad = torch.tensor([T - len(p) for p in self.prompts])  # [B]
        ids = torch.full((B, T), model.tokenizer.eot_id, dtype=torch.long)
        for b, p in enumerate(self.prompts):
            ids[b, pad[b]:] = torch.tensor(p)
        total = T + max(s.max_new_tokens - 1, 0)  # cache slots: the prompt, then every new token but the last
        slots = torch.arange(total)
        key_mask = (slots[None, :] >= pad[:, None]) if bool(pad.any()) else None  # [B, total]: False on padding
        positions = (slots[None, :T] - pad[:, None]).clamp(min=0)  # [B, T]: each sequence counts from its start
        cache = KVCache.allocate(model.config, B, total)  # float32, like the activations, whatever the weights

        seen = None  # [B, V]: tokens present in each sequence, for the repetition penalty
        if s.sampling.repetition_penalty != 1.0:
            seen = torch.zeros(B, model.config.vocab_size, dtype=torch.bool)
            for b, p in enumerate(self.prompts):
                seen[b, p] = True
        detok = [Detokenizer(model.tokenizer, s.stop) for _ in range(B)]
        tokens: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        finish: list[str | None] = [None] * B
        self.stats.prompt_tokens = sum(len(p) for p in self.prompts)

        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = forward(model.weights, model.config, ids, positions=positions, cache=cache, start=0,
                             key_mask=key_mask, last_only=True)[:, -1]  # [B, V]
            self.stats.prefill_seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
            eot = model.tokenizer.eot_id
            for step in range(s.max_new_tokens):
                log_probs = torch.log_softmax(logits, dim=-1)  # [B, V], reported for the chosen tokens
                processed = process_logits(logits, s.sampling, seen)
                if s.ignore_eos:
                    processed[:, eot] = -math.inf  # may write into `logits`: log_probs is already taken
                next_ids = sample(processed, s.sampling, self.generator)  # [B]
                chosen_logprobs = log_probs.gather(-1, next_ids[:, None])[:, 0]  # [B]
                if seen is not None:
                    seen[torch.arange(B), next_ids] = True
                for b, (tok, lp) in enumerate(zip(next_ids.tolist(), chosen_logprobs.tolist())):
                    if finish[b] is not None:
                        continue
                    if tok == eot:
                        finish[b] = "eos"
                    else:
                        tokens[b].append(tok)
                        logprobs[b].append(lp)
                        self.stats.new_tokens += 1
                        if detok[b].add(tok):
                            finish[b] = "stop"
                        elif len(tokens[b]) == s.max_new_tokens:
                            finish[b] = "length"
                    piece = detok[b].finish() if finish[b] else detok[b].ready()
                    if piece:
                        yield b, piece
                if all(f is not None for f in finish):
                    break
                slot = T + step
                logits = forward(model.weights, model.config, next_ids[:, None], positions=(slot - pad)[:, None],
                                 cache=cache, start=slot, key_mask=key_mask, last_only=True)[:, -1]  # [B, V]
            self.stats.decode_seconds = time.perf_counter() - t0
        for b in range(B):
            if finish[b] is None:  # max_new_tokens == 0
                finish[b] = "length"
        self.completions = [
            Completion(detok[b].text, tokens[b], logprobs[b], finish[b], len(self.prompts[b])) for b in range(B)
        ]

    def run(self) -> list[Completion]:
        """Generate to the end without streaming."""
        for _ in self:
            pass
        return self.completions
