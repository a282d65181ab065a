"""Text generation for the CLI and the Python API: settings, results, and a run over the Scheduler.

Each prompt (and each sample of it) is a sequence of its own in the scheduler: prefilled alone into a slot of the
KV cache, then decoded one token at a time in batched steps with the others (core/scheduler.py).
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import GenerationError
from .sampling import SamplingParams
from .scheduler import Event, Request, Scheduler, check_request

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


class Generation:
    """One generation run over a batch of prompts: a client of the Scheduler, which gives each sequence a slot of
    its own. Iterate it to stream (sequence index, text) pieces as they become final; afterwards `completions` and
    `stats` hold the results. Sequence i is sample i % num_samples of prompt i // num_samples, and sample j draws
    with seed + j, so a prompt's samples are the same alone or in a batch."""

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
        self.requests: list[Request] = []
        for p in prompts:
            p = list(p) or [model.tokenizer.eot_id]  # an empty prompt starts from <|endoftext|>, as in training
            room = limit - max(settings.max_new_tokens - 1, 0)  # the last new token is never fed back: no position
            if len(p) > room and settings.truncate == "left":
                self.stats.truncated_tokens = max(self.stats.truncated_tokens, len(p) - room)
                p = p[-room:]
            for j in range(settings.num_samples):
                request = Request(p, settings.max_new_tokens, settings.sampling, settings.stop, settings.ignore_eos,
                                  (seed + j) % 2**63)
                check_request(request, model.config)
                self.requests.append(request)
        self.completions: list[Completion] = []

    def __iter__(self) -> Iterator[tuple[int, str]]:
        model, reqs = self.model, self.requests
        max_len = max(len(r.prompt) + max(r.max_new_tokens - 1, 0) for r in reqs)
        scheduler = Scheduler(model.weights, model.config, model.tokenizer, slots=len(reqs), max_len=max_len)
        events: list[tuple[int, Event]] = []
        seqs = [scheduler.add(r, lambda e, b=b: events.append((b, e))) for b, r in enumerate(reqs)]
        logprobs: list[list[float]] = [[] for _ in reqs]
        finish: list[str] = ["length"] * len(reqs)
        self.stats.prompt_tokens = sum(len(r.prompt) for r in reqs)
        t0 = time.perf_counter()
        for step in itertools.count():
            more = scheduler.step()
            if step == 0:  # the first step prefills every sequence (each has a slot) and chooses its first token
                self.stats.prefill_seconds, t0 = time.perf_counter() - t0, time.perf_counter()
            for b, e in events:
                if e.token is not None and e.token != model.tokenizer.eot_id:
                    logprobs[b].append(e.logprob)
                    self.stats.new_tokens += 1
                finish[b] = e.finish_reason or finish[b]
                if e.text:
                    yield b, e.text
            events.clear()
            if not more:
                break
        self.stats.decode_seconds = time.perf_counter() - t0
        self.completions = [Completion(seq.detok.text, seq.tokens, logprobs[b], finish[b], len(seq.request.prompt))
                            for b, seq in enumerate(seqs)]

    def run(self) -> list[Completion]:
        """Generate to the end without streaming."""
        for _ in self:
            pass
        return self.completions
