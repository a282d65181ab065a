"""Sampling as small pure functions over next-token logits [B, V].

Applied in the order transformers applies its processors: repetition penalty, temperature, top-k, top-p.
Filtered-out tokens get -inf. Randomness comes only from the torch.Generator the caller passes in.
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
    repetition_penalty: float = 1.0

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


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None) -> torch.Tensor:
    """[B, V] raw logits -> [B, V] logits to sample from (or take the argmax of, when greedy)."""
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits
    logits = apply_temperature(logits, params.temperature)
    return top_p_filter(top_k_filter(logits, params.top_k), params.top_p)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """[B, V] processed logits -> [B] token ids: the argmax when greedy, else a draw from softmax(logits)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
