"""The rows of many sequences in one pass over the weights (continuous batching, speculative verify passes): where
each row sits (RowLayout), attention that stays within each row's cache slot, and a whole block or the head as one
native call on the row-invariant kernels. runtime/runner.py drives these; model.py holds the math they share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.config import GPT2Config
from ..core.kernels import cpu, decode_kernels
from ..core.ops import FEW_IDS
from ..core.model import Tap, attention, attention_mask, hooked, linear, merge_heads, split_heads
from ..core.projection import native_projection
from ..core.packed import PackedMatrix
from ..core.weights import Block, GPT2Weights, QuantizedMatrix, split_qkv


@dataclass(frozen=True)
class RowLayout:
    """Where the rows of a continuous-batching pass go, worked out once for all blocks: spans (slot, start, n) in row
    order (n new tokens of the sequence in cache slot `slot`, at positions [start, start + n)), each span's first
    row, and for every row its cache slot and position (what the native attention kernel reads). Slots and positions
    are lists, which the native calls take as they are: a decode step starts on caches that the last step's head has
    flushed, where making a small tensor costs more than a block's element-wise work (kernels/block.cpp)."""

    spans: list[tuple[int, int, int]]
    first_rows: list[int]  # each span's first row
    slots: list[int]  # [R] the slot of each row
    positions: list[int]  # [R] the position of each row in its sequence

    @classmethod
    def of(cls, spans: list[tuple[int, int, int]]) -> RowLayout:
        firsts = [0]
        for _, _, n in spans[:-1]:
            firsts.append(firsts[-1] + n)
        slots = [slot for slot, _, n in spans for _ in range(n)]
        positions = [p for _, start, n in spans for p in range(start, start + n)]
        return cls(spans, firsts, slots, positions)


def self_attention_segments(x: torch.Tensor, blk: Block, n_head: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            layout: RowLayout, adapters: torch.Tensor | None = None,
                            tap: Tap | None = None) -> torch.Tensor:
    """[1, R, C] -> [1, R, C] for the rows of several sequences back to back; span (slot, start, n) holds n new
    tokens of the sequence in cache slot `slot` at positions [start, start + n): a running sequence's next token
    (n = 1) or a new prompt (start = 0). One projection over all R rows; each span writes its keys and values
    into its slot and attends causally to its own slot's keys only, so nothing depends on the other spans.

    With the native kernels all R rows are one call (kernels/attention.cpp): it writes every row's key and value
    first, then each row attends to its slot's positions up to its own, in a fixed order, so a prompt's tokens are
    rows like any other (a Python loop of ~15 torch ops per prompt and layer made a step that admitted 6 prompts
    half again as long as a decode step). Without them, span by span in torch. `tap` (scoped to the block): the hook
    points attn.hook_q|hook_k|hook_v|hook_z [1, R, nh, hs], as causal_self_attention has them."""
    R, C = x.shape[1], x.shape[2]
    hs = C // n_head
    q, k, v = split_qkv(linear(x, blk.c_attn, adapters))  # 3 x [1, R, C]
    if tap is not None:
        q, k, v = (hooked(tap, f"attn.hook_{n}", t.view(1, R, n_head, hs)).reshape(1, R, C) for n, t in zip("qkv", (q, k, v)))
    native = decode_kernels() if k_cache.is_contiguous() else None
    if native is not None:
        out = native.decode_attention(q[0].view(R, n_head, hs), k[0].view(R, n_head, hs), v[0].view(R, n_head, hs),
                                      k_cache, v_cache, torch.tensor(layout.slots, dtype=torch.long),
                                      torch.tensor(layout.positions, dtype=torch.long), cpu().avx512)
        out = hooked(tap, "attn.hook_z", out.view(1, R, n_head, hs))
        return linear(out.reshape(1, R, C), blk.attn_c_proj, adapters)  # [1, R, C]
    out = torch.empty(1, R, C)  # [1, R, C]
    for (slot, start, n), row in zip(layout.spans, layout.first_rows):
        qi, ki, vi = (split_heads(t[:, row : row + n], n_head) for t in (q, k, v))  # 3 x [1, nh, n, hs]
        k_cache[slot, :, start : start + n], v_cache[slot, :, start : start + n] = ki[0], vi[0]
        keys, values = k_cache[slot : slot + 1, :, : start + n], v_cache[slot : slot + 1, :, : start + n]  # [1, nh, S, hs]
        out[:, row : row + n] = merge_heads(attention(qi, keys, values, attention_mask(n, start, None, x.device),
                                                      causal=start == 0))
    out = hooked(tap, "attn.hook_z", out.view(1, R, n_head, hs)).reshape(1, R, C)
    return linear(out, blk.attn_c_proj, adapters)  # [1, R, C]


def embeds_natively(w: GPT2Weights) -> bool:
    """Whether native_embed applies to these weights: the native kernels, wte in float32 or bfloat16 and wpe in
    float32, each contiguous. Decided once per runner (runtime/runner.py's NativeRows), not in every step."""
    return (decode_kernels() is not None and w.wte.dtype in (torch.float32, torch.bfloat16) and w.wte.is_contiguous()
            and w.wpe.dtype == torch.float32 and w.wpe.is_contiguous())


def native_embed(w: GPT2Weights, ids: list[int], positions: list[int]) -> torch.Tensor | None:
    """model.embed(w, ids) + wpe[positions], float32 [1, R, C], as one native call (kernels/block.cpp's embed_rows,
    the same bits) for a pass's rows, where embeds_natively(w). None where a quantized model reads these rows through
    the mapping (more than FEW_IDS of them: model.embed); its few rows are read from the file, as model.embed does."""
    table, rows = w.wte, ids
    if w.wte_pages is not None:
        if len(ids) > FEW_IDS or (table := w.wte_pages.read_rows(w.wte, ids)) is None:
            return None
        rows = list(range(len(ids)))
    return decode_kernels().embed_rows(table, rows, w.wpe, positions)


def native_block(blk: Block, config: GPT2Config, layer: int) -> Any | None:
    """Block `blk` (number `layer`) as one native call for the rows of a decode-sized pass: kernels/block.cpp's
    RowBlock, which does block() around self_attention_segments() on the same row-invariant kernels, with its own
    layer norm and GELU (see its header). None without the native kernels, or where a weight's format has none."""
    native = None if config.exact_gelu else decode_kernels()  # the kernel's GELU is GPT-2's tanh form
    parts = [native_projection(p) for p in (blk.c_attn, blk.attn_c_proj, blk.c_fc, blk.mlp_c_proj)]
    norms = [blk.ln_1.weight, blk.ln_1.bias, blk.ln_2.weight, blk.ln_2.bias]
    if native is None or None in parts or any(t.dtype != torch.float32 or not t.is_contiguous() for t in norms):
        return None
    tensors = [*norms, *(t for part, _ in parts for t in part)]
    return native.RowBlock(tensors, [bits for _, bits in parts], layer, config.n_head, config.layer_norm_epsilon,
                           cpu().avx512, cpu().avx512_vnni)


def native_head(w: GPT2Weights, config: GPT2Config) -> Any | None:
    """logits() as one native call for the rows of a decode-sized pass: kernels/block.cpp's RowHead (its own layer
    norm, then the head's row-invariant kernel). None without the native kernels, or where the head's format or the
    layer norm's dtype has none."""
    native, head = decode_kernels(), w.head
    if native is None or any(t.dtype != torch.float32 or not t.is_contiguous() for t in (w.ln_f.weight, w.ln_f.bias)):
        return None
    if isinstance(head, QuantizedMatrix):
        tensors, bits, vocab = (head.packed, head.scales), head.bits, head.out_features
    elif isinstance(head, PackedMatrix):  # packed.cpp's dot_packed: its units, and its side list as the scales
        tensors, bits, vocab = (head.units, head.side), head.bits, head.rows
    elif head.dtype in (torch.float32, torch.bfloat16) and head.is_contiguous():
        tensors, bits, vocab = (head, torch.empty(0)), 0, head.shape[0]
    else:
        return None
    return native.RowHead(w.ln_f.weight, w.ln_f.bias, *tensors, bits, vocab, config.layer_norm_epsilon, cpu().avx512,
                          cpu().avx512_vnni)
