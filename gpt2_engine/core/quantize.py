"""Blockwise int8, int6 and int4 weights, quantized at load time (llama.cpp's q8_0 and q4_0, repacked for our kernels,
and a 6-bit format of the same shape for the int4 models' output head, where llama.cpp uses its 6-bit q6_K).

Each group of 32 consecutive inputs of an output column gets one float16 scale d: w ~= q * d with q in
[-127, 127] (8 bits), [-32, 31] (6 bits) or [-8, 7] (4 bits; for 6 and 4 bits d = m / -32 or m / -8 where m is the
group's value of largest magnitude, so that value maps to the lowest level exactly and the full range is used). The
quantized values are stored offset to unsigned (u = q + 128, q + 32 or q + 8) and repacked into 16-column panels,
the layout kernels/quant.cpp streams (see its header).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from .errors import GPT2EngineError
from .weights import Block, GPT2Weights, Linear, QuantizedMatrix, float_matrix
from .pages import file_pages, release_heap, release_pages

GROUP = 32  # inputs per scale
PANEL = 16  # output columns per panel
CHUNK = 196_608  # weights quantized at a time (256 columns of 768 inputs): bounds the temporaries to a few MiB
FORMATS = {"int8": 8, "int4": 4}
# The head's error reaches every logit directly: int4 there cost 6 points of top-1 agreement on the trained
# checkpoint, 6 bits (the extra quarter of the bytes) keep it within the int4 mode's bars.
HEAD_BITS = {"int8": 8, "int4": 6}
ZERO = {8: 128, 6: 32, 4: 8}  # u = q + ZERO[bits]


def quantize_groups(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, N) float -> q int8 (K, N) and scales float16 (K / 32, N), one per group of 32 inputs of a column."""
    if bits not in ZERO:
        raise ValueError(f"quantize_groups: bits must be 8, 6 or 4, got {bits}")
    K, N = w.shape
    groups = w.float().reshape(K // GROUP, GROUP, N)  # [G, 32, N]
    if bits == 8:
        scales = (groups.abs().amax(dim=1) / 127).half()  # [G, N]
        low, high = -127, 127
    else:
        low_w, high_w = torch.aminmax(groups, dim=1)  # [G, N] each
        extreme = torch.where(high_w >= -low_w, high_w, low_w)  # [G, N]: signed, largest |w| (a tie: the positive)
        low = -ZERO[bits]
        scales = (extreme / low).half()
        high = -low - 1
    d = scales.float()[:, None]  # [G, 1, N]: the stored float16 scale, so that q * d is what the kernels compute
    q = torch.where(d != 0, torch.round(groups / torch.where(d != 0, d, 1)), 0).clamp_(low, high)
    return q.to(torch.int8).reshape(K, N), scales


def nibble_octets(u: torch.Tensor) -> torch.Tensor:
    """u (K, P * 16) below 16 -> [P, K / 8, 16, 4] bytes: inputs 8j..8j+3 in the low nibbles, 8j+4..8j+7 in the high."""
    K, padded = u.shape
    octets = u.view(K // 8, 2, 4, padded // PANEL, PANEL)
    return (octets[:, 0] | (octets[:, 1] << 4)).permute(2, 0, 3, 1)


def top_planes(top: torch.Tensor) -> torch.Tensor:
    """6 bits' top 2 bits (K, P * 16) -> [P, K / 8, 8, 4] bytes: octet j's 32-byte plane, where byte 4c + i holds
    input 8j + i of columns c and c + 8 in bits 0-1 and 2-3, and input 8j + 4 + i of the same columns in 4-5 and 6-7."""
    K, padded = top.shape
    t = top.view(K // 8, 2, 4, padded // PANEL, 2, PANEL // 2)  # [octet, low/high input half, i, P, column half, c]
    plane = t[:, 0, :, :, 0] | (t[:, 0, :, :, 1] << 2) | (t[:, 1, :, :, 0] << 4) | (t[:, 1, :, :, 1] << 6)
    return plane.permute(2, 0, 3, 1)  # [P, K/8, 8, 4]


def pack(q: torch.Tensor, scales: torch.Tensor, bits: int) -> QuantizedMatrix:
    """q int8 (K, N) and scales (K / 32, N) -> the panel layout of kernels/quant.cpp (N padded to 16 with zeros)."""
    K, N = q.shape
    padded = -(-N // PANEL) * PANEL
    u = torch.full((K, padded), ZERO[bits], dtype=torch.int16)  # padding: w = 0
    u[:, :N] = q.to(torch.int16) + ZERO[bits]
    panels = padded // PANEL
    if bits == 8:  # [K/4, 4, P, 16] -> [P, K/4, 16, 4]: a 32-bit lane holds 4 consecutive inputs of one column
        packed = u.view(K // 4, 4, panels, PANEL).permute(2, 0, 3, 1)
    elif bits == 4:
        packed = nibble_octets(u)
    else:  # per group: its 4 octets of low 4 bits (256 bytes), then their 4 planes of top 2 bits (128 bytes)
        groups = K // GROUP
        packed = torch.cat([nibble_octets(u & 0x0F).reshape(panels, groups, 256),
                            top_planes(u >> 4).reshape(panels, groups, 128)], dim=2)
    s = torch.zeros(K // GROUP, padded, dtype=torch.float16)
    s[:, :N] = scales
    return QuantizedMatrix(packed.to(torch.uint8).contiguous().view(-1),
                           s.view(K // GROUP, panels, PANEL).permute(1, 0, 2).contiguous(), bits, K, N)


def unpack(m: QuantizedMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack: q int8 (K, N) and scales float32 (K / 32, N)."""
    K, N, panels = m.in_features, m.out_features, m.scales.shape[0]

    def nibbles(b: torch.Tensor) -> torch.Tensor:  # [P, K/8, 16, 4] bytes -> (K, P * 16)
        b = b.permute(1, 3, 0, 2).to(torch.int16)  # [K/8, 4, P, 16]
        return torch.stack([b & 0x0F, b >> 4], dim=1).reshape(K, panels * PANEL)

    if m.bits == 8:
        u = m.packed.view(panels, K // 4, PANEL, 4).permute(1, 3, 0, 2).reshape(K, panels * PANEL).to(torch.int16)
    elif m.bits == 4:
        u = nibbles(m.packed.view(panels, K // 8, PANEL, 4))
    else:
        groups = m.packed.view(panels, K // GROUP, 384)
        low = nibbles(groups[:, :, :256].reshape(panels, K // 8, PANEL, 4))
        plane = groups[:, :, 256:].reshape(panels, K // 8, PANEL // 2, 4).permute(1, 3, 0, 2).to(torch.int16)
        fields = torch.stack([(plane >> s) & 3 for s in (0, 2, 4, 6)], dim=1)  # [K/8, (lo c, lo c+8, hi c, hi c+8), 4, P, 8]
        top = fields.view(K // 8, 2, 2, 4, panels, PANEL // 2).permute(0, 1, 3, 4, 2, 5).reshape(K, panels * PANEL)
        u = low | (top << 4)
    q = u - ZERO[m.bits]
    scales = m.scales.permute(1, 0, 2).reshape(K // GROUP, panels * PANEL).float()
    return q[:, :N].to(torch.int8), scales[:, :N]


def dequantize(m: QuantizedMatrix) -> torch.Tensor:
    """(K, N) float32: q * d, the weight the quantized matrix stands for."""
    q, scales = unpack(m)
    return (q.float().view(-1, GROUP, m.out_features) * scales[:, None]).view(m.in_features, m.out_features)


def quantize_matrix(w: torch.Tensor, bits: int, done: Callable[[slice], None] | None = None) -> QuantizedMatrix:
    """A (K, N) float matrix (Conv1D layout: inputs are rows) in the packed blockwise format, about CHUNK weights
    (whole panels of columns) at a time into the preallocated result (panels are independent); done(columns) after
    each chunk."""
    K, N = w.shape
    if K % GROUP:
        raise GPT2EngineError(f"quantize: input size {K} is not a multiple of {GROUP}, which the groups need")
    cols = max(PANEL, CHUNK // K // PANEL * PANEL)  # whole panels: each chunk's pack is a contiguous run of the result's
    panels = -(-N // PANEL)
    packed = torch.empty(panels * K * PANEL * bits // 8, dtype=torch.uint8)
    scales = torch.empty(panels, K // GROUP, PANEL, dtype=torch.float16)
    for c in range(0, N, cols):
        part = pack(*quantize_groups(w[:, c : c + cols], bits), bits)
        first = c // PANEL
        packed[first * K * PANEL * bits // 8 :][: part.packed.numel()] = part.packed
        scales[first : first + part.scales.shape[0]] = part.scales
        if done is not None:
            done(slice(c, c + cols))
    return QuantizedMatrix(packed, scales, bits, K, N)


def quantize_weights(w: GPT2Weights, fmt: str, source: Path | None = None) -> GPT2Weights:
    """Every projection in `fmt` (int8 or int4) and the output head in HEAD_BITS[fmt] (int8, or 6 bits with int4);
    embeddings, biases and layer norms stay as they are. The head's packed form is of wte^T (C, V), so it runs through the same kernel as the
    projections. With `source` (the memory-mapped checkpoint file), each float32 matrix's pages are released once
    it is quantized, so the peak memory is the quantized model plus one chunk, not the float32 file."""
    bits = FORMATS[fmt]

    def release(t: torch.Tensor) -> None:
        if source is not None:
            release_pages(t, source)

    def linear(p: Linear) -> Linear:
        w = float_matrix(p.weight)  # a float32 target in panels: the file's matrix beside them
        q = quantize_matrix(w, bits)
        release(w)
        release_heap()
        return Linear(q, p.bias)

    def block(b: Block) -> Block:
        return replace(b, c_attn=linear(b.c_attn), attn_c_proj=linear(b.attn_c_proj), c_fc=linear(b.c_fc),
                       mlp_c_proj=linear(b.mlp_c_proj))

    wte_pages = None if source is None else file_pages(w.wte, source)  # checked once, released chunk by chunk
    head = quantize_matrix(w.wte.t(), HEAD_BITS[fmt], done=lambda rows: wte_pages and wte_pages.release(w.wte[rows]))
    if wte_pages is not None:
        wte_pages.release(w.wte)  # each chunk's reads also mapped folios of the chunks released before it
    release_heap()
    # from now on only the embedding reads wte, and it drops the pages it maps (model.embed)
    return replace(w, blocks=tuple(block(b) for b in w.blocks), head=head, wte_pages=wte_pages)
