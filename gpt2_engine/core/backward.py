"""Causal self-attention in training mode: a forward that keeps its activations, and a hand-written backward.

This follows ../shared/seeds/002 (llm.c's attention layer), with explicit tensors and no autograd. Same notation as
model.py: B batch, T tokens, C channels, nh heads, hs = C // nh. Dropout is inverted dropout: kept values are
scaled by 1 / (1 - p), so p = 0 (or eval mode) is exactly the engine's inference forward.

Forward, for x [B, T, C]:
    qkv = x W_attn + b_attn                       [B, T, 3C]   (Conv1D: W_attn is (C, 3C))
    q, k, v = split_qkv(qkv), as heads            [B, nh, T, hs] each
    S = q k^T / sqrt(hs), S_ij = -inf for j > i   [B, nh, T, T]
    A = softmax(S)                                [B, nh, T, T]
    A' = A * M_att / (1 - p_attn)                 [B, nh, T, T]  (M_att: the kept positions)
    y = merge_heads(A' v)                         [B, T, C]
    out = (y W_proj + b_proj) * M_res / (1 - p_resid)   [B, T, C]

Backward, from G = dL/d out [B, T, C], each line the chain rule through one forward line, last to first:
    dO = G * M_res / (1 - p_resid)
    dW_proj = y^T dO,  db_proj = sum dO,  dy = dO W_proj^T
    dY_h = heads of dy;  dA' = dY_h v^T;  dv = A'^T dY_h     (the seed writes A' dY_h; the transpose is needed)
    dA = dA' * M_att / (1 - p_attn)
    dS = A * (dA - sum_j(dA * A))                 softmax backward, row by row
    dS_ij = 0 for j > i                           masked scores did not reach the output
    dS = dS / sqrt(hs)
    dq = dS k;  dk = dS^T q
    dqkv = [merge_heads(dq), merge_heads(dk), merge_heads(dv)]   (the inverse of split_qkv)
    dW_attn = x^T dqkv,  db_attn = sum dqkv,  dx = dqkv W_attn^T
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .model import attention_mask, attention_weights, linear, merge_heads, split_heads
from .weights import Linear, split_qkv


@dataclass(frozen=True)
class AttentionActivations:
    """What the training forward keeps for the backward."""

    x: torch.Tensor  # [B, T, C] input
    qkv: torch.Tensor  # [B, T, 3C]
    att: torch.Tensor  # [B, nh, T, T] softmax weights, before dropout
    att_keep: torch.Tensor | None  # [B, nh, T, T] bool dropout mask on att (None: no dropout)
    att_dropped: torch.Tensor  # [B, nh, T, T] after dropout
    y: torch.Tensor  # [B, T, C] heads merged, the input of c_proj
    out_keep: torch.Tensor | None  # [B, T, C] bool dropout mask on the output
    p_attn: float
    p_resid: float


@dataclass(frozen=True)
class AttentionGradients:
    x: torch.Tensor  # [B, T, C]
    c_attn: Linear  # weight (C, 3C), bias (3C,)
    c_proj: Linear  # weight (C, C), bias (C,)


def dropout_keep(shape: tuple[int, ...], p: float, generator: torch.Generator | None,
                 device: torch.device | str = "cpu") -> torch.Tensor | None:
    """A bool mask of kept positions, each kept with probability 1 - p; None when p == 0."""
    if not 0 <= p < 1:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if p == 0:
        return None
    return torch.rand(shape, generator=generator, device=device) >= p


def apply_dropout(x: torch.Tensor, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    """Inverted dropout with a given mask: kept values scaled by 1 / (1 - p). Also its own backward."""
    return x if keep is None else x * keep / (1.0 - p)


def attention_forward_train(x: torch.Tensor, c_attn: Linear, c_proj: Linear, n_head: int, *, p_attn: float = 0.0,
                            p_resid: float = 0.0, generator: torch.Generator | None = None
                            ) -> tuple[torch.Tensor, AttentionActivations]:
    """[B, T, C] -> [B, T, C] and the activations the backward needs (see the module docstring)."""
    B, T, C = x.shape
    qkv = linear(x, c_attn)  # [B, T, 3C]
    q, k, v = (split_heads(t, n_head) for t in split_qkv(qkv))  # 3 x [B, nh, T, hs]
    att = attention_weights(q, k, attention_mask(T, 0, None, x.device))  # [B, nh, T, T]
    att_keep = dropout_keep(tuple(att.shape), p_attn, generator, x.device)
    att_dropped = apply_dropout(att, att_keep, p_attn)
    y = merge_heads(att_dropped @ v)  # [B, T, C]
    out_keep = dropout_keep((B, T, C), p_resid, generator, x.device)
    out = apply_dropout(linear(y, c_proj), out_keep, p_resid)  # [B, T, C]
    return out, AttentionActivations(x, qkv, att, att_keep, att_dropped, y, out_keep, p_attn, p_resid)


def attention_backward(grad_out: torch.Tensor, acts: AttentionActivations, c_attn: Linear, c_proj: Linear,
                       n_head: int) -> AttentionGradients:
    """dL/d out [B, T, C] -> gradients for the input and the c_attn / c_proj parameters."""
    B, T, C = grad_out.shape
    hs = C // n_head

    # output dropout, then the output projection (Conv1D: out = y W + b)
    d_out = apply_dropout(grad_out, acts.out_keep, acts.p_resid)  # [B, T, C]
    d_proj_w = acts.y.reshape(-1, C).t() @ d_out.reshape(-1, C)  # [C, C]
    d_proj_b = d_out.sum(dim=(0, 1))  # [C]
    d_y = d_out @ c_proj.weight.t()  # [B, T, C]

    # per head: y_h = A' v
    q, k, v = (split_heads(t, n_head) for t in split_qkv(acts.qkv))  # [B, nh, T, hs]
    d_yh = split_heads(d_y, n_head)  # [B, nh, T, hs]
    d_att_dropped = d_yh @ v.transpose(-2, -1)  # [B, nh, T, T]
    d_v = acts.att_dropped.transpose(-2, -1) @ d_yh  # [B, nh, T, hs]

    # attention dropout, softmax, causal mask, scale
    d_att = apply_dropout(d_att_dropped, acts.att_keep, acts.p_attn)  # [B, nh, T, T]
    d_scores = acts.att * (d_att - (d_att * acts.att).sum(dim=-1, keepdim=True))  # [B, nh, T, T]
    future = torch.ones(T, T, dtype=torch.bool, device=grad_out.device).triu(1)  # [T, T]
    d_scores = d_scores.masked_fill(future, 0.0) * (1.0 / math.sqrt(hs))

    d_q = d_scores @ k  # [B, nh, T, hs]
    d_k = d_scores.transpose(-2, -1) @ q  # [B, nh, T, hs]
    d_qkv = torch.cat([merge_heads(d_q), merge_heads(d_k), merge_heads(d_v)], dim=-1)  # [B, T, 3C]

    # the fused Q/K/V projection (Conv1D: qkv = x W + b)
    d_attn_w = acts.x.reshape(-1, C).t() @ d_qkv.reshape(-1, 3 * C)  # [C, 3C]
    d_attn_b = d_qkv.sum(dim=(0, 1))  # [3C]
    d_x = d_qkv @ c_attn.weight.t()  # [B, T, C]
    return AttentionGradients(d_x, Linear(d_attn_w, d_attn_b), Linear(d_proj_w, d_proj_b))
