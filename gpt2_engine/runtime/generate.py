"""Text generation for the CLI and the Python API: results, and a run over the engine loop.

Each prompt (and each sample of it) is a sequence of its own in the scheduler: prefilled into a slot of the KV cache
(or run as rows of a shared pass), then decoded one token at a time in batched passes with the others
(runtime/loop.py). The requests come from runtime/requests.py, the builder the server uses too. With a Speculation, the
loop drafts and the passes verify (runtime/speculation.py): the same tokens with greedy decoding, the same distribution
with sampling.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..core.config import GPT2Config
from ..core.tokenizer import Tokenizer
from ..core.weights import GPT2Weights
from .drafters import Speculation
from .loop import EngineLoop
from .constraints import GrammarError, Grammars, grammar_failure
from .requests import GenerationSettings, RequestSet, build_requests
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler


@dataclass
class Completion:
    """One generated sequence. finish_reason: 'eos' (<|endoftext|>), 'stop' (a stop string) or 'length'.

    Under a stop string, token_ids and logprobs are every token the model generated, the stop string's included (the
    last one completed it), while text ends where the stop string begins: the same convention as the server's
    completion_tokens and logprobs, and vLLM's. So decode(token_ids) starts with text + the stop string.
    """

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
    context_limited: int = 0  # the fewest new tokens a prompt had room for, below max_new_tokens (0: every one fit)
    drafted: int = 0  # speculation: tokens drafted, those the target accepted, and the verify passes run
    accepted: int = 0
    verify_passes: int = 0
    verified_tokens: int = 0  # tokens the verify passes emitted (accepted drafts and the target's own)

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else math.nan

    @property
    def decode_tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds else math.nan

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def tokens_per_verify(self) -> float:
        return self.verified_tokens / self.verify_passes if self.verify_passes else math.nan


class Generation:
    """One generation run over a batch of prompts (token ids), each sequence in a slot of its own. Iterate it to
    stream (sequence index, text) pieces as they become final; afterwards `completions` and `stats` hold the
    results. Sequence i is sample i % num_samples of prompt i // num_samples. `slots`: sequences run at once (the
    rest wait for a slot); None: all of them."""

    def __init__(self, weights: GPT2Weights, config: GPT2Config, tokenizer: Tokenizer, prompts: list[list[int]],
                 settings: GenerationSettings, speculation: Speculation | None = None, slots: int | None = None,
                 grammars: Grammars | None = None) -> None:
        self.weights, self.config, self.tokenizer = weights, config, tokenizer
        self.settings, self.speculation, self.slots = settings, speculation, slots
        if settings.constraint is not None and grammars is None:
            grammars = Grammars(tokenizer, config.vocab_size)
        self.batch: RequestSet = build_requests(prompts, settings, config, tokenizer.eot_id, grammars)
        self.stats = GenerationStats(seed=self.batch.seed, truncated_tokens=self.batch.truncated_tokens,
                                     context_limited=self.batch.context_limited)
        self.completions: list[Completion] = []

    def __iter__(self) -> Iterator[tuple[int, str]]:
        reqs = self.batch.requests
        max_len = max(len(r.prompt) + max(r.max_new_tokens - 1, 0) for r in reqs)
        spec, slots = self.speculation, min(len(reqs), self.slots or len(reqs))
        loop = EngineLoop(Scheduler(self.config, self.tokenizer, slots=slots, max_len=max_len,
                                   speculation=None if spec is None else spec.policy),
                          ModelRunner(self.weights, self.config, slots=slots, max_len=max_len),
                          None if spec is None else spec.drafter(slots, max_len))
        loop.submit(reqs, tag=None)
        loop.intake()
        seqs = list(loop.scheduler.waiting)  # in request order
        logprobs: list[list[float]] = [[] for _ in reqs]
        finish: list[str] = ["length"] * len(reqs)
        self.stats.prompt_tokens = sum(len(r.prompt) for r in reqs)
        t0 = time.perf_counter()
        first = True
        while not loop.scheduler.idle:
            for outputs in loop.step():
                for seq, e in outputs:
                    b = seq.index
                    if e.finish_reason == "error" and (grammar := grammar_failure(e.error or "")) is not None:
                        raise GrammarError(grammar)  # the constraint went over a limit: the input's fault
                    if e.finish_reason == "error":  # the engine failed, not the input
                        raise RuntimeError(f"generation failed: {e.error}")
                    if e.token is not None and e.token != self.tokenizer.eot_id:
                        logprobs[b].append(e.logprob)
                        self.stats.new_tokens += 1
                    finish[b] = e.finish_reason or finish[b]
                    if e.text:
                        yield b, e.text
            if first:  # the first step prefills every sequence that has a slot and chooses its first token
                self.stats.prefill_seconds, t0, first = time.perf_counter() - t0, time.perf_counter(), False
        self.stats.decode_seconds = time.perf_counter() - t0
        st = self.stats
        st.drafted, st.accepted = sum(s.drafted for s in seqs), sum(s.accepted for s in seqs)
        st.verify_passes = sum(s.verified for s in seqs)
        st.verified_tokens = st.accepted + st.verify_passes
        self.completions = [Completion(seq.detok.text, seq.tokens, logprobs[b], finish[b], len(seq.request.prompt))
                            for b, seq in enumerate(seqs)]

    def run(self) -> list[Completion]:
        """Generate to the end without streaming."""
        for _ in self:
            pass
        return self.completions


def two_samples(weights: GPT2Weights, prompt: list[int], max_new_tokens: int, seed: int, *, config: GPT2Config,
                tokenizer: Tokenizer) -> tuple[str, str]:
    """Two continuations of a prompt: greedy, and drawn at temperature 1 with top-k 40 (the trainer's samples: its
    Sampler, with config and tokenizer bound)."""
    texts = []
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=40)):
        settings = GenerationSettings(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, truncate="left")
        texts.append(Generation(weights, config, tokenizer, [prompt], settings).run()[0].text)
    return texts[0], texts[1]
