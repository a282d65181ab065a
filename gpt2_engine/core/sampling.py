"""Sampling as small pure functions over next-token logits.

Order: logit bias, repetition penalty, presence and frequency penalties (OpenAI's), then temperature, top-k, top-p
(transformers' order). `choose` is the per-sequence path the engine runs at every step; the [B, V] filters below
are its reference (tests hold `choose` to them and them to transformers' processors). Filtered-out tokens get
-inf. Randomness comes only from the torch.Generator the caller passes in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import GenerationError


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
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise GenerationError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or not math.isfinite(rp) or rp <= 0:
            raise GenerationError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {rp!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise GenerationError(f"{name} must be a number in [-2, 2], got {value!r}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0 or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise GenerationError(f"logit_bias must map token ids to numbers in [-100, 100], got {token!r}: {bias!r}")

    @property
    def needs_counts(self) -> bool:
        """Whether sampling depends on the tokens generated so far."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[B, V] -> [B, V]: keep the logits >= the k-th largest (ties kept); k larger than V is clamped; 0 keeps all."""
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, -math.inf)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """[B, V] -> [B, V]: nucleus filtering. Drop the least likely tokens whose cumulative probability stays
    <= 1 - p (counting from the least likely), so the kept set holds at least p of the mass; the top token always stays."""
    if p >= 1.0:
        return logits
    ascending, order = torch.sort(logits, dim=-1)  # [B, V]
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= 1 - p
    drop_sorted[..., -1] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, -math.inf)


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


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
                   counts: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] raw logits -> [B, V] logits to sample from (or take the argmax of, when greedy): the reference."""
    logits = apply_penalties(logits, params, seen, counts)
    if params.greedy:
        return logits
    logits = apply_temperature(logits, params.temperature)
    return top_p_filter(top_k_filter(logits, params.top_k), params.top_p)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """[V] penalised logits (apply_penalties) -> the next token id, as process_logits + sample would choose it.

    Only the top-k survivors are sorted and exponentiated, and the draw is over them: the same kept set and
    distribution as filtering the whole vocabulary (ties at the k-th value aside), at a fraction of the work.
    """
    if params.greedy:
        return int(logits.argmax())
    k = params.top_k if 0 < params.top_k < logits.shape[-1] else logits.shape[-1]
    values, ids = logits.topk(k) if k < logits.shape[-1] else logits.sort(descending=True)  # [k], descending
    probs = torch.softmax(apply_temperature(values, params.temperature), dim=-1)  # [k]
    if params.top_p < 1.0:
        # keep a token iff the mass of the tokens above it is < p (top_p_filter's rule, counted from the top)
        above = probs.cumsum(-1) - probs  # [k]
        probs = probs.masked_fill(above >= params.top_p, 0.0)
    return int(ids[torch.multinomial(probs, 1, generator=generator)])
