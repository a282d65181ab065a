"""From what a user asks for to the scheduler's Requests: the one request builder of the command line, the Python API
and the server.

It owns every decision about turning prompts and settings into sequences: the prompt forms (text, texts, token ids,
lists of them), the empty prompt (it starts from <|endoftext|>, as GPT-2's training documents do), the seed (a random
one when none is given, reported back), sample j of a prompt drawing with seed + j (so a prompt's samples are the same
alone or in a batch), truncation from the left, and the context: a prompt that leaves room for fewer new tokens than
asked generates up to the context and stops there ('length'); a prompt longer than the context, or more new tokens
than the whole context, is an error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from ..core.config import GPT2Config
from ..core.errors import GenerationError
from ..core.scalars import as_int, described
from ..interp.spec import Steering, check_steering
from ..core.tokenizer import Tokenizer
from .constraints import Constraint, Grammars
from .plan import Request, check_request
from .sampling import SamplingParams, checked_number

Prompt = str | list[str] | list[int] | list[list[int]]

# What one call may ask for, on the command line and in the Python API alike (the server's protocol.py holds an OpenAI
# request to its own, tighter n <= 16). Each sample is a sequence whose results are kept to the end of the call, so
# num_samples alone multiplies a call's memory (10,000 samples of 1,024 tokens keep ten million token ids, logprobs and
# their text); top_logprobs is the server's limit.
MAX_SAMPLES = 10_000
MAX_TOP_LOGPROBS = 20


# GenerationSettings' integer fields: (name, whether the integer is allowed, what the error says it must be, the OpenAI
# param). numpy's integers and 0-d integer tensors read as Python's (np.int64(3) is seed 3); True is not 1.
INTEGER_CHECKS: tuple[tuple[str, Callable[[int], bool], str, str], ...] = (
    ("max_new_tokens", lambda v: v >= 0, "an integer >= 0", "max_new_tokens"),
    ("num_samples", lambda v: 1 <= v <= MAX_SAMPLES, f"an integer in [1, {MAX_SAMPLES}]", "num_samples"),
    ("seed", lambda v: 0 <= v < 2**63, "an integer in [0, 2^63)", "seed"),
    ("top_logprobs", lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs"),
)
FLAGS = ("ignore_eos", "prompt_logprobs")  # "no" would be true


@dataclass(frozen=True)
class GenerationSettings:
    """Everything that shapes one generation run; the defaults are the CLI's and the API's (the server fills these
    from an OpenAI request, with OpenAI's defaults)."""

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # the text ends before the first stop string
    ignore_eos: bool = False  # never end at <|endoftext|>: its logit is set to -inf, as llama.cpp's --ignore-eos does
    seed: int | None = None  # None: a fresh random seed, reported in RequestSet.seed
    num_samples: int = 1  # completions per prompt
    truncate: str | None = None  # "left": keep the last tokens of a prompt that does not fit
    top_logprobs: int = 0  # alternatives reported per generated token
    prompt_logprobs: bool = False  # score the prompt's tokens too
    constraint: Constraint | None = None  # structured output: a JSON schema, regex, choice or grammar to match
    steering: tuple[Steering, ...] = ()  # directions added or SAE features clamped while generating (Steering)

    def __post_init__(self) -> None:
        if isinstance(self.steering, (Steering, list)):
            object.__setattr__(self, "steering", (self.steering,) if isinstance(self.steering, Steering)
                               else tuple(self.steering))
        for name, allowed, must, param in INTEGER_CHECKS:
            value = getattr(self, name)
            if value is not None or name != "seed":  # seed None: a random one
                object.__setattr__(self, name, checked_number(name, value, as_int, allowed, must, param))
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise GenerationError(f"{name} must be True or False, got {described(getattr(self, name))}", param=name)
        if self.truncate not in (None, "left"):
            raise GenerationError(f"truncate must be None or 'left', got {self.truncate!r}", param="truncate")
        object.__setattr__(self, "stop", stop_strings(self.stop))
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise GenerationError("constraint must be a Constraint (Constraint.json_schema, .regex, .choice, "
                                      f".grammar), got {type(self.constraint).__name__}", param="constraint")
            if self.ignore_eos:
                raise GenerationError("ignore_eos cannot be combined with a constraint: the grammar decides where the "
                                      "text ends", param="ignore_eos")


def stop_strings(stop: object) -> tuple[str, ...]:
    """GenerationSettings.stop as a tuple of non-empty strings: one string, None (none) or an iterable of them."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Iterable):
        raise GenerationError(f"stop must be a string or a list of strings, got {described(stop)}", param="stop")
    strings = tuple(stop)
    if any(not isinstance(s, str) or s == "" for s in strings):
        raise GenerationError(f"stop strings must be non-empty strings, got {list(strings)!r}", param="stop")
    return strings


@dataclass(frozen=True)
class RequestSet:
    """The Requests of one call: sample j of prompt i is requests[i * num_samples + j]."""

    requests: list[Request]
    seed: int  # the seed of sample 0 (the one given, or the random one drawn)
    truncated_tokens: int = 0  # the most prompt tokens truncate="left" dropped from one prompt
    context_limited: int = 0  # the fewest new tokens a prompt has room for, where that is below max_new_tokens (0: none)


def encode_prompts(prompt: Prompt, tokenizer: Tokenizer, *, allow_special: bool = False) -> list[list[int]]:
    """Token ids of each prompt: a text, a list of texts, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, allow_special=allow_special)]
    if isinstance(prompt, (bytes, bytearray, memoryview)):  # a sequence of ints, which would pass for token ids
        raise GenerationError(f"prompt: got {type(prompt).__name__}; decode it to a string first", param="prompt")
    if not isinstance(prompt, Seq):
        raise GenerationError("prompt must be a string, a list of strings, a list of token ids or a list of such "
                              f"lists; got {type(prompt).__name__}", param="prompt")
    if not prompt:
        raise GenerationError("prompt must not be an empty list", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p, allow_special=allow_special) for p in prompt]
    lists = [prompt] if all(isinstance(t, int) for t in prompt) else prompt
    for ids in lists:
        check_token_ids(ids)
    return [list(ids) for ids in lists]


def check_token_ids(ids: object) -> None:
    """Raise GenerationError unless `ids` is a non-empty list of token ids (ints, not bools)."""
    if not isinstance(ids, Seq) or isinstance(ids, str) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise GenerationError("prompt must be a string, a list of strings, a list of token ids or a list of "
                              "such lists", param="prompt")
    if not ids:
        raise GenerationError("a token-id prompt must not be empty", param="prompt")


def prompt_or_endoftext(ids: list[int], eot_id: int) -> list[int]:
    """The ids a prompt starts from: an empty prompt starts from <|endoftext|>, as GPT-2's training documents do."""
    return list(ids) or [eot_id]


def build_requests(prompts: list[list[int]], settings: GenerationSettings, config: GPT2Config,
                   eot_id: int, grammars: Grammars | None = None) -> RequestSet:
    """num_samples Requests per prompt (token ids), checked against the model; see the module's docstring. A
    constraint is compiled once, by `grammars` (the model's), for all of them."""
    if not prompts:
        raise GenerationError("no prompt given", param="prompt")
    compiled = None
    if settings.constraint is not None:
        if grammars is None:
            raise GenerationError("a constraint needs the model's Grammars to compile it", param="constraint")
        compiled = grammars.compile(settings.constraint)
    limit = config.n_positions
    if settings.max_new_tokens > limit:  # impossible whatever the prompt: say so rather than stop short
        raise GenerationError(f"asking for {settings.max_new_tokens} new tokens exceeds the context of {limit} tokens "
                              f"(at most {limit})", param="max_new_tokens")
    for token, _ in settings.sampling.logit_bias:
        if token >= config.vocab_size:
            raise GenerationError(f"logit_bias token id {token} is outside the vocabulary [0, {config.vocab_size})",
                                  param="logit_bias")
    steering = check_steering(settings.steering, config)
    seed = settings.seed if settings.seed is not None else int.from_bytes(os.urandom(7), "little")
    room = limit - max(settings.max_new_tokens - 1, 0)  # the last new token is never fed back: it needs no position
    requests, truncated, limited = [], 0, 0
    for prompt in prompts:
        prompt = prompt_or_endoftext(prompt, eot_id)
        if len(prompt) > room and settings.truncate == "left":
            truncated = max(truncated, len(prompt) - room)
            prompt = prompt[-room:]
        if len(prompt) > limit:
            raise GenerationError(f"the prompt of {len(prompt)} tokens exceeds the context of {limit} tokens",
                                  param="prompt", advice="shorten it, or keep its last tokens with truncate left "
                                  "(gpt2 generate --truncate left)")
        # as llama.cpp and transformers do, generation stops at the context (finish reason 'length') rather than
        # refusing a prompt that leaves room for fewer new tokens than asked
        new = min(settings.max_new_tokens, limit - len(prompt) + 1)  # the last new token is never fed back
        if new < settings.max_new_tokens:
            limited = new if not limited else min(limited, new)
        for j in range(settings.num_samples):
            request = Request(prompt, new, settings.sampling, settings.stop, settings.ignore_eos,
                              (seed + j) % 2**63, settings.top_logprobs, settings.prompt_logprobs,
                              constraint=compiled, steering=steering)
            check_request(request, config)
            requests.append(request)
    return RequestSet(requests, seed, truncated, limited)
