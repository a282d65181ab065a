"""Weight-only int8 quantization, done at load time: symmetric, one scale per output channel.

Activations stay float32; each int8 matrix is widened to float32 right before its matmul (model.as_float32).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .weights import Block, GPT2Weights, Int8Matrix, Linear


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float -> int8 (rows, cols) and scales (rows, 1): scale = max |row| / 127, values rounded."""
    scales = w.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12) / 127.0
    return torch.round(w.float() / scales).clamp_(-127, 127).to(torch.int8), scales


def quantize_linear(p: Linear) -> Linear:
    """A Conv1D projection (in, out) with its weight in int8, one scale per output column."""
    values, scales = quantize_rows(p.weight.t())  # rows = output channels
    return Linear(Int8Matrix(values.t().contiguous(), scales.t().contiguous()), p.bias)


def quantize_weights(w: GPT2Weights) -> GPT2Weights:
    """Every projection and the output head in int8; embeddings, biases and layer norms stay as they are."""
    def block(b: Block) -> Block:
        return replace(b, c_attn=quantize_linear(b.c_attn), attn_c_proj=quantize_linear(b.attn_c_proj),
                       c_fc=quantize_linear(b.c_fc), mlp_c_proj=quantize_linear(b.mlp_c_proj))

    return replace(w, blocks=tuple(block(b) for b in w.blocks), head=Int8Matrix(*quantize_rows(w.wte)))
