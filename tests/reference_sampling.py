"""Whole-vocabulary [B, V] reference filters: what the engine's `choose` is held to, and what is held to
transformers' logits processors. Test-only: the engine samples through runtime/sampling.py's `choose`."""

from __future__ import annotations

import math

import torch

from gpt2_engine.runtime.sampling import SamplingParams, apply_penalties, apply_temperature


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


def process_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
                   counts: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] raw logits -> [B, V] logits to sample from (or take the argmax of, when greedy): the reference."""
    logits = apply_penalties(logits, params, seen, counts)
    if params.greedy:
        return logits
    logits = apply_temperature(logits, params.temperature)
    return top_p_filter(top_k_filter(logits, params.top_k), params.top_p)


