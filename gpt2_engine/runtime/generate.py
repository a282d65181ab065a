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
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..core.config import GPT2Config
from ..core.model import KVCache
from ..core.errors import GenerationError
from ..core.pages import available_memory
from ..core.tokenizer import Tokenizer
from ..core.weights import GPT2Weights
from .drafters import Speculation
from .constraints import GrammarError, Grammars, grammar_failure
from .loop import EngineLoop
from .plan import Event, Finished
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


def check_event(e: Event) -> None:
    """Raise for an event that ends its sequence with an error: the input's fault (a grammar over a limit) or the
    engine's."""
    if e.finish_reason != "error":
        return
    if (grammar := grammar_failure(e.error or "")) is not None:
        raise GrammarError(grammar)  # the constraint went over a limit: the input's fault
    raise RuntimeError(f"generation failed: {e.error}")  # the engine failed, not the input


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
    rest wait for a slot); None: all of them. `runner`: what executes the passes, made as ModelRunner is (GPT2.runner:
    ModelRunner, or the torch runner's factory)."""

    def __init__(self, weights: GPT2Weights, config: GPT2Config, tokenizer: Tokenizer, prompts: list[list[int]],
                 settings: GenerationSettings, speculation: Speculation | None = None, slots: int | None = None,
                 grammars: Grammars | None = None, runner: Callable[..., ModelRunner] = ModelRunner) -> None:
        self.weights, self.config, self.tokenizer = weights, config, tokenizer
        self.settings, self.speculation, self.slots, self.runner = settings, speculation, slots, runner
        if settings.constraint is not None and grammars is None:
            grammars = Grammars(tokenizer, config.vocab_size)
        self.batch: RequestSet = build_requests(prompts, settings, config, tokenizer.eot_id, grammars)
        reqs = self.batch.requests
        self.shape = min(len(reqs), slots or len(reqs)), max(len(r.prompt) + max(r.max_new_tokens - 1, 0) for r in reqs)
        check_cache_fits(*self.shape, config, settings.num_samples, len(prompts))
        self.stats = GenerationStats(seed=self.batch.seed, truncated_tokens=self.batch.truncated_tokens,
                                     context_limited=self.batch.context_limited)
        self.completions: list[Completion] = []

    def __iter__(self) -> Iterator[tuple[int, str]]:
        reqs = self.batch.requests
        loop = self._loop()
        loop.submit(reqs, tag=None)
        loop.intake()
        logprobs: list[list[float]] = [[] for _ in reqs]
        done: list[Finished | None] = [None] * len(reqs)
        finish: list[str] = ["length"] * len(reqs)
        self.stats.prompt_tokens = sum(len(r.prompt) for r in reqs)
        t0 = time.perf_counter()
        first = True
        while not loop.scheduler.idle:
            for outputs in loop.step():
                for ref, e in outputs:
                    b = ref.index
                    check_event(e)
                    if e.token is not None and e.token != self.tokenizer.eot_id:
                        logprobs[b].append(e.logprob)
                        self.stats.new_tokens += 1
                    finish[b], done[b] = e.finish_reason or finish[b], e.done or done[b]
                    if e.text:
                        yield b, e.text
            if first:  # the first step prefills every sequence that has a slot and chooses its first token
                self.stats.prefill_seconds, t0, first = time.perf_counter() - t0, time.perf_counter(), False
        self.stats.decode_seconds = time.perf_counter() - t0
        self._finish(done, logprobs, finish)

    def _loop(self) -> EngineLoop:
        """An engine loop of its own for this run: a slot per sequence (or `slots`), caches as long as it needs."""
        (slots, max_len), spec = self.shape, self.speculation  # sequences at once, positions each
        return EngineLoop(Scheduler(self.config, self.tokenizer, slots=slots, max_len=max_len,
                                    speculation=None if spec is None else spec.policy),
                          self.runner(self.weights, self.config, slots=slots, max_len=max_len),
                          None if spec is None else spec.drafter(slots, max_len))

    def _finish(self, done: list[Finished], logprobs: list[list[float]], finish: list[str]) -> None:
        """The completions, and the speculation counts of the stats, from each sequence's Finished summary."""
        st = self.stats
        st.drafted, st.accepted = sum(d.drafted for d in done), sum(d.accepted for d in done)
        st.verify_passes = sum(d.verified for d in done)
        st.verified_tokens = st.accepted + st.verify_passes
        self.completions = [Completion(d.text, d.tokens, logprobs[b], finish[b], d.prompt_tokens)
                            for b, d in enumerate(done)]

    def run(self) -> list[Completion]:
        """Generate to the end without streaming."""
        for _ in self:
            pass
        return self.completions


def check_cache_fits(slots: int, max_len: int, config: GPT2Config, num_samples: int, prompts: int) -> None:
    """Raise GenerationError unless the KV cache of `slots` sequences of up to `max_len` positions, allocated whole
    before the first token, fits in the memory this machine has available."""
    per_sequence = KVCache.nbytes(config, 1, max_len)
    available = available_memory()
    if slots * per_sequence <= available:
        return
    asked = f"num_samples {num_samples}" + (f" x {prompts} prompts" if prompts > 1 else "")
    raise GenerationError(f"{asked} needs a {slots * per_sequence / 1e9:.1f} GB KV cache ({slots:,} sequences of up "
                          f"to {max_len:,} positions at once); this machine has {available / 1e9:.1f} GB available, "
                          f"room for {available // per_sequence:,} sequences", param="num_samples",
                          advice="ask for fewer samples or new tokens a call")


def two_samples(weights: GPT2Weights, prompt: list[int], max_new_tokens: int, seed: int, *, config: GPT2Config,
                tokenizer: Tokenizer) -> tuple[str, str]:
    """Two continuations of a prompt: greedy, and drawn at temperature 1 with top-k 40 (the trainer's samples: its
    Sampler, with config and tokenizer bound)."""
    texts = []
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=40)):
        settings = GenerationSettings(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, truncate="left")
        texts.append(Generation(weights, config, tokenizer, [prompt], settings).run()[0].text)
    return texts[0], texts[1]
