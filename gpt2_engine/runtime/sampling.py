"""Sampling as small pure functions over next-token logits.

Order: logit bias, repetition penalty, presence and frequency penalties (OpenAI's), then temperature, top-k, top-p
(transformers' order). `choose` is the per-sequence path the engine runs at every step (the tests hold it to a
whole-vocabulary reference of the filters, and that reference to transformers' processors). Randomness comes only
from the torch.Generator the caller passes in.

`SamplingParams` holds the one set of bounds that the command line, the Python API and the server all check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.errors import GenerationError
from ..core.scalars import as_int, as_real, described

MAX_TEMPERATURE = 2  # OpenAI's bound; GPT-2's text past it is noise
# Temperatures below this are greedy, as vLLM reads them (its _SAMPLING_EPS): a draw at 1e-5 picks the argmax unless
# two logits are within ~1e-4 of each other, and below ~1e-37 logits / temperature overflows float32 to inf.
GREEDY_BELOW = 1e-5
# The repetition penalty divides or multiplies a seen token's logit: within these bounds a logit stays finite after
# it and after the smallest sampling temperature (|logit| * 100 / 1e-5 is far from float32's 3e38).
REPETITION_PENALTY = (0.01, 100)


# SamplingParams' fields: (name, how a value reads as a number (None: it is not one), whether that number is allowed,
# what the error says it must be). numpy's and torch's scalars read as Python's; True is not temperature 1.
CHECKS: tuple[tuple[str, Callable[[object], float | int | None], Callable[[Any], bool], str], ...] = (
    ("temperature", as_real, lambda v: 0 <= v <= MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE}] (0 is greedy)"),
    ("top_k", as_int, lambda v: v >= 0, "an integer >= 0 (0 disables it)"),
    ("top_p", as_real, lambda v: 0 < v <= 1, "in (0, 1] (1 disables it)"),
    ("repetition_penalty", as_real, lambda v: REPETITION_PENALTY[0] <= v <= REPETITION_PENALTY[1],
     f"in [{REPETITION_PENALTY[0]:g}, {REPETITION_PENALTY[1]:g}] (1 disables it)"),
    ("presence_penalty", as_real, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    ("frequency_penalty", as_real, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
)


def checked_number(name: str, value: object, read: Callable[[object], float | int | None],
                   allowed: Callable[[Any], bool], must: str, param: str | None = None) -> float | int:
    """`value` read as a Python number by `read` (as_int or as_real) when `allowed`; GenerationError otherwise, naming
    the value (its type too where it is not a number of that kind)."""
    number = read(value)
    if number is None or not allowed(number):  # NaN fails every comparison
        shown = described(value) if number is None else repr(value if type(value) in (int, float) else number)
        raise GenerationError(f"{name} must be {must}, got {shown}", param=param or name)
    return number


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    repetition_penalty: float = 1.0  # transformers': divides positive / multiplies negative logits of seen tokens
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated text
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the raw logits

    def __post_init__(self) -> None:
        for name, read, allowed, must in CHECKS:
            object.__setattr__(self, name, checked_number(name, getattr(self, name), read, allowed, must))
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, Mapping) else bias  # the API's {token: bias}
        if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
            raise GenerationError(f"logit_bias must map token ids to numbers in [-100, 100], got {described(bias)}",
                                  param="logit_bias")
        checked = []
        for pair in pairs:
            token, value = pair if isinstance(pair, tuple) and len(pair) == 2 else (pair, None)
            t, v = as_int(token), as_real(value)
            if t is None or t < 0 or v is None or not -100 <= v <= 100:  # NaN too
                raise GenerationError("logit_bias must map token ids to numbers in [-100, 100], got "
                                      f"{described(token) if t is None else t}: "
                                      f"{described(value) if v is None else repr(value)}", param="logit_bias")
            checked.append((t, v))
        object.__setattr__(self, "logit_bias", tuple(checked))

    @property
    def needs_counts(self) -> bool:
        """Whether sampling depends on the tokens generated so far."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """[B, V] -> [B, V]: for tokens already in the sequence (seen [B, V] bool), positive logits are divided by the
    penalty and negative ones multiplied by it (the CTRL paper's rule, as in transformers)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, V] -> [B, V]: logits / temperature (> 0)."""
    return logits if temperature == 1.0 else logits / temperature


def apply_penalties(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None,
                    counts: torch.Tensor | None) -> torch.Tensor:
    """[..., V] -> [..., V]: logit bias, then the repetition penalty over `seen` (prompt and generated tokens, bool)
    and the presence and frequency penalties over `counts` (occurrences in the generated tokens)."""
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        logits = logits.clone()
        logits[..., list(ids)] += torch.tensor(bias, dtype=logits.dtype)
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if counts is not None and (params.presence_penalty or params.frequency_penalty):
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def kept(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """[V] penalised logits -> (weights [k], token ids [k]) of the tokens a draw may pick (not greedy): temperature,
    top-k, then top-p. The weights are the softmax over the top-k with the tokens top-p drops set to 0 (not
    renormalised: a draw normalises them).

    Only the top-k survivors are sorted and exponentiated: the same kept set and distribution as filtering the whole
    vocabulary (ties at the k-th value aside), at a fraction of the work.
    """
    k = params.top_k if 0 < params.top_k < logits.shape[-1] else logits.shape[-1]
    values, ids = logits.topk(k) if k < logits.shape[-1] else logits.sort(descending=True)  # [k], descending
    probs = torch.softmax(apply_temperature(values, params.temperature), dim=-1)  # [k]
    if params.top_p < 1.0:
        # keep a token iff the mass of the tokens above it is < p (the nucleus rule, counted from the top)
        above = probs.cumsum(-1) - probs  # [k]
        drop = above >= params.top_p
        drop[0] = False  # the top token always stays: a p below float32's least (1e-300) compares as 0 to its 0 above
        probs = probs.masked_fill(drop, 0.0)
    return probs, ids


def argmax(logits: torch.Tensor) -> int:
    """[V] -> the index of the largest logit (the first of equals, a NaN counting as the largest, as torch's). numpy's:
    torch's argmax over one row of GPT-2's 50,257 logits starts the thread pool, an order of magnitude slower."""
    return int(np.argmax(logits.detach().numpy()))


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """[V] penalised logits (apply_penalties) -> the next token id: the argmax, or a draw from kept()."""
    if params.greedy:
        return argmax(logits)
    probs, ids = kept(logits, params)
    return int(ids[torch.multinomial(probs, 1, generator=generator)])


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] penalised logits -> [V]: the distribution `choose` draws from as a whole-vocabulary vector (greedy: a point
    mass on the argmax). Speculative sampling compares these (runtime/speculation.py)."""
    p = torch.zeros_like(logits)
    if params.greedy:
        p[argmax(logits)] = 1.0
        return p
    probs, ids = kept(logits, params)
    p[ids] = probs / probs.sum()
    return p
