"""GPT-2's forward pass in PyTorch, as small functions over explicit tensors. The second file of the reading path,
after numpy_ref.py: the same math, with a KV cache, batches, padding masks and TransformerLens's hook points.

Notation: B batch, T tokens in this call, S key positions attended (cached + new), C channels (n_embd),
nh heads, hs head size (C // nh), V vocabulary. GPT-2 is pre-LN: each block is
x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)); the final ln_f comes after the last block.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .config import GPT2Config
from .ops import causal_attention, embed, gelu
from .pages import huge_zeros
from .projection import head_logits, lora_rows, project
from .weights import Block, GPT2Weights, LayerNorm, Linear, QuantizedMatrix, split_qkv


@dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer, preallocated for max_len positions and written in place by index."""

    k: torch.Tensor  # [n_layer, B, nh, max_len, hs]
    v: torch.Tensor  # [n_layer, B, nh, max_len, hs]

    @classmethod
    def allocate(cls, config: GPT2Config, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> KVCache:
        """An empty cache for `batch` sequences of up to `max_len` positions."""
        if not 0 < max_len <= config.n_positions:
            raise ValueError(f"KV cache length must be in 1..{config.n_positions}, got {max_len}")
        shape = (config.n_layer, batch, config.n_head, max_len, config.head_size)
        return cls(huge_zeros(shape, dtype, device), huge_zeros(shape, dtype, device))  # on 2 MB pages where it can

    @staticmethod
    def nbytes(config: GPT2Config, batch: int, max_len: int) -> int:
        """What allocate(config, batch, max_len) takes in float32: keys and values of every layer."""
        return 2 * config.n_layer * batch * max_len * config.n_embd * 4

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


class Tap(Protocol):
    """Hook points on the forward pass, named as TransformerLens names them for GPT-2 (interp/hooks.py records and
    patches through one). Without one (None) a hook point costs one `is None` test."""

    def wants(self, name: str) -> bool:
        """Whether hook point `name` is cached or hooked: the points that cost work to produce ask first."""
        ...

    def edits(self, name: str) -> bool:
        """Whether a hook at `name` may replace the activation (a point that is only recorded cannot)."""
        ...

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The activation at hook point `name`; returns it, or a replacement of the same shape."""
        ...


@dataclass(frozen=True)
class ScopedTap:
    """A tap seen from inside block i: names get the prefix "blocks.{i}."."""

    tap: Tap
    prefix: str

    def wants(self, name: str) -> bool:
        return self.tap.wants(self.prefix + name)

    def edits(self, name: str) -> bool:
        return self.tap.edits(self.prefix + name)

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.tap(self.prefix + name, x)


def hooked(tap: Tap | None, name: str, x: torch.Tensor) -> torch.Tensor:
    """x at hook point `name`: x itself without a tap, else what the tap returns (x, or its replacement)."""
    return x if tap is None else tap(name, x)


@dataclass(frozen=True)
class BlockCall:
    """What one call of a block is given beyond its weights, worked out once per call of the forward: where its T new tokens sit (positions
    [start, start + T), with this layer's KV cache view (k, v) [B, nh, max_len, hs] to write them into), which keys
    each query sees (`mask` [B|1, 1, T, S]; `causal` when that is only the causal mask of whole sequences), the hook
    points (`tap`, scoped to the block) and each row's LoRA adapter (`adapters` [B*T], linear()'s)."""

    start: int = 0
    mask: torch.Tensor | None = None
    causal: bool = False
    cache: tuple[torch.Tensor, torch.Tensor] | None = None
    tap: Tap | None = None
    adapters: torch.Tensor | None = None

    def hook(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return hooked(self.tap, name, x)


def layer_norm(x: torch.Tensor, p: LayerNorm, eps: float, tap: Tap | None = None, name: str = "") -> torch.Tensor:
    """[..., C] -> [..., C]: (x - mean) / sqrt(var + eps) * weight + bias; GPT-2's eps is 1e-5, not torch's default.

    Hook points `{name}hook_scale` [..., 1] (sqrt(var + eps), recomputed only when asked for; replacing it
    renormalises with the new scale) and `{name}hook_normalized` [..., C] (the output, weight and bias applied).
    """
    y = F.layer_norm(x, (x.shape[-1],), p.weight, p.bias, eps)  # [..., C]
    if tap is None:
        return y
    if tap.wants(name + "hook_scale"):
        scale = (x.var(dim=-1, keepdim=True, unbiased=False) + eps).sqrt()  # [..., 1]
        if (patched := tap(name + "hook_scale", scale)) is not scale:
            y = (x - x.mean(dim=-1, keepdim=True)) / patched * p.weight + p.bias
    return tap(name + "hook_normalized", y)


def linear(x: torch.Tensor, p: Linear, adapters: torch.Tensor | None = None) -> torch.Tensor:
    """[..., in] -> [..., out]. Conv1D layout: the weight is (in, out), so this is x @ W + b (not x @ W^T).
    How it runs for each weight format (float32, bfloat16, int8, int4) is projection.py's concern. With LoRA
    adapters on the projection, each row adds its adapter's low-rank term: adapters [B*T] says which (-1: none;
    None: adapter 0 for every row, the single-adapter model)."""
    x2 = x.reshape(-1, x.shape[-1])  # [B*T, in]
    flat = project(x2, p.weight, p.bias)  # [B*T, out]
    if p.lora is not None:
        flat = lora_rows(x2, p.lora, adapters, flat)
    return flat.view(*x.shape[:-1], flat.shape[-1])


def lm_head(x: torch.Tensor, head: torch.Tensor | QuantizedMatrix) -> torch.Tensor:
    """[..., C] -> [..., V] float32 logits. GPT-2 has no separate output matrix: the head is wte (V, C), transposed."""
    flat = head_logits(x.reshape(-1, x.shape[-1]), head)  # [M, V]
    return flat.view(*x.shape[:-1], flat.shape[-1])


def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """[B, T, C] -> [B, nh, T, hs]: head h owns channels [h*hs:(h+1)*hs]."""
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """[B, nh, T, hs] -> [B, T, C]: the inverse of split_heads."""
    B, nh, T, hs = y.shape
    return y.transpose(1, 2).reshape(B, T, nh * hs)


def attention_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q k^T / sqrt(hs), masked: q [B, nh, T, hs], k [B, nh, S, hs] -> [B, nh, T, S].

    `mask` [B|1, 1, T, S] is True where a query may attend. Masked scores become the dtype's most negative finite
    value rather than -inf, so that a row with nothing to attend to (a padding query) gives a harmless uniform row
    after the softmax, not NaN.
    """
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # [B, nh, T, S]
    return scores if mask is None else scores.masked_fill(~mask, torch.finfo(scores.dtype).min)


def softmax(scores: torch.Tensor) -> torch.Tensor:
    """[..., S] -> [..., S]: exp(s - rowmax) / sum (numerically stable), computed in at least float32."""
    return torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(scores.dtype)


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs)) with masked scores excluded: q [B, nh, T, hs], k [B, nh, S, hs] -> [B, nh, T, S]."""
    return softmax(attention_scores(q, k, mask))


QUERY_BLOCK = 128  # queries per block in a long prefill: [B, nh, 128, S] scores stay in cache


def query_blocks(T: int, S: int) -> list[tuple[int, int, int]]:
    """(first query, end query, keys seen) per block of at most QUERY_BLOCK of the T queries, which are the last T of
    the S positions: a block sees keys up to its own last query only, since the causal mask hides every later one."""
    return [(i, min(i + QUERY_BLOCK, T), S - T + min(i + QUERY_BLOCK, T)) for i in range(0, T, QUERY_BLOCK)]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              tap: Tap | None = None, causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs), masked) v: q [B, nh, T, hs], k and v [B, nh, S, hs] -> [B, nh, T, hs].

    The T new queries are the last T of the S positions. `causal` says that mask is nothing but the causal mask of
    a whole sequence (S = T, no padding): that case, a prompt or a scoring window, runs in causal_attention, which
    never writes the [T, S] scores and skips the blocks above the diagonal (several times faster than the explicit
    form below on long prompts; rows agree with it to ~1e-7). Every other case,
    and any hook on the scores or the pattern, is the explicit form. A long prompt there goes in blocks of queries
    (query_blocks): half the work of a causal prefill, and each block's scores fit in cache.
    """
    T, S = q.shape[2], k.shape[2]
    fused = causal and T > 1
    if tap is not None and (tap.wants("attn.hook_attn_scores") or tap.wants("attn.hook_pattern")):
        # a hook that may replace the scores or the pattern needs the explicit form; one that only records them
        # keeps the plain path's output, so that caching the pattern does not change a bit of the logits
        edited = tap.edits("attn.hook_attn_scores") or tap.edits("attn.hook_pattern")
        return tapped_attention(q, k, v, mask, tap, fused and not edited)
    if fused:
        assert T == S, "causal attention is for a whole sequence: as many keys as queries"
        return causal_attention(q, k, v)  # [B, nh, T, hs]
    if T <= QUERY_BLOCK:
        return attention_weights(q, k, mask) @ v  # [B, nh, T, hs]
    out = torch.empty_like(q)
    for i, j, keys in query_blocks(T, S):
        block_mask = None if mask is None else mask[:, :, i:j, :keys]
        out[:, :, i:j] = attention_weights(q[:, :, i:j], k[:, :, :keys], block_mask) @ v[:, :, :keys]
    return out


def tapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     tap: Tap, fused: bool = False) -> torch.Tensor:
    """attention() with hook points `attn.hook_attn_scores` and `attn.hook_pattern`, each the whole [B, nh, T, S]
    (scores a block does not compute are masked ones: the dtype's minimum, weights 0). The blocks are the same as
    attention()'s explicit form, on the same values, so the output is the same bits; a hook's replacement is used
    as it is. `fused` (the points are only recorded): the output is causal_attention's, as attention() gives it."""
    T, S = q.shape[2], k.shape[2]
    blocks = query_blocks(T, S)
    scores = q.new_full((q.shape[0], q.shape[1], T, S), torch.finfo(q.dtype).min)  # [B, nh, T, S]
    for i, j, keys in blocks:
        scores[:, :, i:j, :keys] = attention_scores(q[:, :, i:j], k[:, :, :keys], None if mask is None else mask[:, :, i:j, :keys])
    scores = tap("attn.hook_attn_scores", scores)
    pattern = torch.zeros_like(scores)  # [B, nh, T, S]
    for i, j, keys in blocks:
        pattern[:, :, i:j, :keys] = softmax(scores[:, :, i:j, :keys].contiguous())
    pattern = tap("attn.hook_pattern", pattern)
    if fused:
        return causal_attention(q, k, v)  # [B, nh, T, hs]
    out = torch.empty_like(q)  # [B, nh, T, hs]
    for i, j, keys in blocks:
        out[:, :, i:j] = pattern[:, :, i:j, :keys].contiguous() @ v[:, :, :keys]
    return out


def causal_self_attention(x: torch.Tensor, blk: Block, n_head: int, at: BlockCall) -> torch.Tensor:
    """[B, T, C] -> [B, T, C]. With a cache, this call's keys/values are written at [start, start+T) first.

    Hook points (TransformerLens's layout, heads before head size): attn.hook_q|hook_k|hook_v|hook_z [B, T, nh, hs],
    attn.hook_attn_scores|hook_pattern [B, nh, T, S].
    """
    q, k, v = split_qkv(linear(x, blk.c_attn, at.adapters))  # 3 x [B, T, C]: one matmul over the fused Q/K/V weights
    B, T, C = x.shape
    # hooked as [B, T, nh, hs] (TransformerLens's layout), then [B, nh, T, hs] as split_heads gives them
    q, k, v = (at.hook(f"attn.hook_{n}", t.view(B, T, n_head, C // n_head)).transpose(1, 2)
               for n, t in zip("qkv", (q, k, v)))
    if at.cache is not None:
        k_cache, v_cache = at.cache  # [B, nh, max_len, hs] each
        end = at.start + T
        k_cache[:, :, at.start : end] = k
        v_cache[:, :, at.start : end] = v
        k, v = k_cache[:, :, :end], v_cache[:, :, :end]  # [B, nh, S, hs], S = start + T
    # a cache in bfloat16 or float16 (the torch runner's, for such weights): the queries meet the keys in its dtype
    y = attention(q.to(k.dtype), k, v, at.mask, at.tap, causal=at.causal).to(x.dtype)  # [B, nh, T, hs]
    y = at.hook("attn.hook_z", y.transpose(1, 2)).transpose(1, 2)  # hooked as [B, T, nh, hs]
    return linear(merge_heads(y), blk.attn_c_proj, at.adapters)  # [B, T, C]


def mlp(x: torch.Tensor, blk: Block, at: BlockCall, exact_gelu: bool = False) -> torch.Tensor:
    """[B, T, C] -> [B, T, C] through the 4C-wide hidden layer; hook points mlp.hook_pre|hook_post [B, T, 4C]."""
    h = at.hook("mlp.hook_pre", linear(x, blk.c_fc, at.adapters))  # [B, T, 4C]
    h = at.hook("mlp.hook_post", gelu(h, exact=exact_gelu))  # [B, T, 4C]
    return linear(h, blk.mlp_c_proj, at.adapters)  # [B, T, C]


def block(x: torch.Tensor, blk: Block, config: GPT2Config, attend: Callable[[torch.Tensor], torch.Tensor],
          at: BlockCall) -> torch.Tensor:
    """[B, T, C] -> [B, T, C]: one pre-LN transformer block, x + attn(ln_1(x)), then + mlp(ln_2(x)); `attend` is its
    self-attention on ln_1(x) (causal_self_attention, or the rows of a batched pass: runtime/rows.py).

    Hook points, in TransformerLens's names within the block: hook_resid_pre, ln1.*, hook_attn_out, hook_resid_mid,
    ln2.*, mlp.*, hook_mlp_out, hook_resid_post (all [B, T, C] but the mlp's).
    """
    eps = config.layer_norm_epsilon
    x = at.hook("hook_resid_pre", x)
    a = at.hook("hook_attn_out", attend(layer_norm(x, blk.ln_1, eps, at.tap, "ln1.")))  # [B, T, C]
    x = at.hook("hook_resid_mid", x + a)
    m = at.hook("hook_mlp_out", mlp(layer_norm(x, blk.ln_2, eps, at.tap, "ln2."), blk, at, config.exact_gelu))  # [B, T, C]
    return at.hook("hook_resid_post", x + m)


def attention_mask(T: int, start: int, key_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """[B|1, 1, T, S] bool, S = start + T: query at slot start+i sees key slot j iff j <= start+i and key_mask[b, j].

    None when nothing is masked (one new token and no padding), so decoding skips the mask entirely.
    """
    S = start + T
    mask = None
    if T > 1:
        q_slot = torch.arange(start, S, device=device)[:, None]  # [T, 1]
        mask = (torch.arange(S, device=device)[None, :] <= q_slot)[None, None]  # [1, 1, T, S]
    if key_mask is not None:
        keys = key_mask[:, None, None, :S]  # [B, 1, 1, S]
        mask = keys if mask is None else mask & keys
    return mask


def residual_stream(w: GPT2Weights, config: GPT2Config, ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                    cache: KVCache | None = None, start: int = 0, key_mask: torch.Tensor | None = None,
                    hidden_states: list[torch.Tensor] | None = None, tap: Tap | None = None,
                    adapters: torch.Tensor | None = None) -> torch.Tensor:
    """ids [B, T] -> [B, T, C]: the residual stream after the last block (before ln_f).

    positions [B, T] default to start..start+T-1. Tokens attend to every earlier slot that key_mask [B, S] marks as
    a real token (False for left padding); with a cache, they occupy cache slots [start, start+T).
    If `hidden_states` is a list, the residual stream after each block is appended to it. Hook points: hook_embed,
    hook_pos_embed [B, T, C], then blocks.{i}.* (see block()). `adapters` [B]: each sequence's LoRA adapter, where
    the weights carry several (-1: the base; None: adapter 0, the model's own).
    """
    B, T = ids.shape
    device = w.wpe.device  # the weights' (a GPU's, on the torch runner): the ids and what goes with them move there
    ids, positions, key_mask, adapters = (None if t is None else t.to(device)
                                          for t in (ids, positions, key_mask, adapters))
    if positions is None:
        positions = torch.arange(start, start + T, device=ids.device).expand(B, T)
    tokens = hooked(tap, "hook_embed", embed(w, ids))  # [B, T, C]: the residual stream is float32 whatever the weights
    pos = hooked(tap, "hook_pos_embed", w.wpe[positions])  # [B, T, C]
    x = tokens + pos  # [B, T, C]
    mask = attention_mask(T, start, key_mask, ids.device)
    causal = start == 0 and key_mask is None
    rows = None if adapters is None else adapters.repeat_interleave(T)  # [B*T]
    for i, blk in enumerate(w.blocks):
        at = BlockCall(start, mask, causal, None if cache is None else (cache.k[i], cache.v[i]),
                   None if tap is None else ScopedTap(tap, f"blocks.{i}."), rows)
        x = block(x, blk, config, lambda h, blk=blk, at=at: causal_self_attention(h, blk, config.n_head, at), at)
        if hidden_states is not None:
            hidden_states.append(x)  # [B, T, C]
    return x


def logits(w: GPT2Weights, config: GPT2Config, x: torch.Tensor, tap: Tap | None = None) -> torch.Tensor:
    """[..., C] residual stream -> [..., V] logits: the final layer norm (hook points ln_final.*), then the tied head."""
    return lm_head(layer_norm(x, w.ln_f, config.layer_norm_epsilon, tap, "ln_final."), w.head)


def forward(w: GPT2Weights, config: GPT2Config, ids: torch.Tensor, *, positions: torch.Tensor | None = None,
            cache: KVCache | None = None, start: int = 0, key_mask: torch.Tensor | None = None,
            hidden_states: list[torch.Tensor] | None = None, tap: Tap | None = None,
            adapters: torch.Tensor | None = None) -> torch.Tensor:
    """Logits for ids [B, T] -> [B, T, V]; the arguments are residual_stream's."""
    x = residual_stream(w, config, ids, positions=positions, cache=cache, start=start, key_mask=key_mask,
                        hidden_states=hidden_states, tap=tap, adapters=adapters)  # [B, T, C]
    return logits(w, config, x, tap)  # [B, T, V]

# Next: runtime/greedy.py runs this forward as a generator does, a prompt into the KV cache and then one token at a
# time. (ops.py says which kernel runs GELU, causal attention and the embedding, projection.py each weight format's
# matmul; runtime/rows.py runs many sequences' rows in one pass.)
