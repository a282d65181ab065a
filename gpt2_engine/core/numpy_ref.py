"""A NumPy reference of GPT-2's forward pass, for reading and cross-checking the PyTorch engine. The first file of the
reading path (README: "Reading it"): the whole model in one screen.

Every formula is written out (layer norm, tanh GELU, softmax); there is no KV cache and no batching trick.
Same notation as model.py: T tokens, C channels, nh heads, hs head size, V vocabulary; one sequence at a time.
"""

from __future__ import annotations

import numpy as np

from .config import GPT2Config
from .weights import Block, GPT2Weights, LayerNorm, Linear


def layer_norm(x: np.ndarray, p: LayerNorm, eps: float) -> np.ndarray:
    """[T, C] -> [T, C]: normalise each row to mean 0, variance 1 (biased), then scale and shift."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p.weight.numpy() + p.bias.numpy()


def linear(x: np.ndarray, p: Linear) -> np.ndarray:
    """[T, in] -> [T, out]; Conv1D layout, W is (in, out)."""
    return x @ p.weight.numpy() + p.bias.numpy()


def gelu(x: np.ndarray) -> np.ndarray:
    """GPT-2's tanh approximation of GELU."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax, shifted by the row max so that exp never overflows."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def causal_self_attention(x: np.ndarray, blk: Block, n_head: int) -> np.ndarray:
    """[T, C] -> [T, C]: n_head independent causal attentions over slices of Q, K, V, then c_proj."""
    T, C = x.shape
    hs = C // n_head
    wq, wk, wv = blk.qkv()  # the (C, C) thirds of c_attn, in the order split_qkv defines
    q, k, v = linear(x, wq), linear(x, wk), linear(x, wv)  # 3 x [T, C]
    future = np.triu(np.ones((T, T), dtype=bool), k=1)  # [T, T]: True where key j > query i
    heads = []
    for h in range(n_head):
        cols = slice(h * hs, (h + 1) * hs)
        scores = q[:, cols] @ k[:, cols].T / np.sqrt(hs)  # [T, T]
        scores = np.where(future, -np.inf, scores)  # the causal mask: exp(-inf) = 0
        heads.append(softmax(scores) @ v[:, cols])  # [T, hs]
    return linear(np.concatenate(heads, axis=-1), blk.attn_c_proj)  # [T, C]


def forward(w: GPT2Weights, config: GPT2Config, ids: np.ndarray,
            hidden_states: list[np.ndarray] | None = None) -> np.ndarray:
    """Logits for one sequence of token ids [T] -> [T, V] in the weights' dtype (float32), from plain tensors: the
    loader's, or a loaded model's as assemble(named_tensors(model.weights)) (its projections may be in panels)."""
    T = len(ids)
    eps = config.layer_norm_epsilon
    x = w.wte.numpy()[ids] + w.wpe.numpy()[:T]  # [T, C]
    for blk in w.blocks:
        x = x + causal_self_attention(layer_norm(x, blk.ln_1, eps), blk, config.n_head)
        x = x + linear(gelu(linear(layer_norm(x, blk.ln_2, eps), blk.c_fc)), blk.mlp_c_proj)
        if hidden_states is not None:
            hidden_states.append(x)
    return layer_norm(x, w.ln_f, eps) @ w.wte.numpy().T  # [T, V]: the head is wte (tied)

# Next: core/model.py, the same forward in PyTorch, with the KV cache, batching and the hook points.
