"""How the forward's non-matmul pieces run: on the native CPU kernels where they apply, else on torch's, with the
same meaning (model.py's math calls these; projection.py does the same for the matmuls). Also the token embedding's
page management for quantized models, whose float32 wte is never kept in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import cpu, decode_kernels
from .weights import GPT2Weights


def gelu(x: torch.Tensor, out: torch.Tensor | None = None, exact: bool = False) -> torch.Tensor:
    """GPT-2's GELU is the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), not the erf form.
    The native kernel's (kernels/block.cpp, what a decode step's blocks compute) where it applies: float32 with
    nothing to differentiate; elsewhere torch's. Written into `out` where given (the training step's buffer).
    `exact`: the erf form 0.5 x (1 + erf(x / sqrt 2)) instead, for models trained with it (nanoGPT's nn.GELU())."""
    how = "none" if exact else "tanh"
    native = None if exact or x.device.type != "cpu" else decode_kernels()
    if (native is not None and x.dtype == torch.float32 and not (torch.is_grad_enabled() and x.requires_grad)
            and (out is None or (out.dtype == torch.float32 and out.is_contiguous()))):
        return native.gelu(x, out)
    if out is None:
        return F.gelu(x, approximate=how)
    return torch.ops.aten.gelu.out(x, approximate=how, out=out)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(hs), causal) v for a whole sequence: q, k, v [B, nh, T, hs] -> [B, nh, T, hs]. The
    native kernel (kernels/attention.cpp) where it applies: AVX-512, float32, head size 64, nothing to differentiate;
    it returns the heads merged ([B, T, nh, hs]), so the result here is a transposed view and merge_heads copies
    nothing. Elsewhere (another device included) torch's fused flash-attention kernel."""
    native = decode_kernels() if q.device.type == "cpu" else None
    if (native is not None and cpu().avx512 and q.shape[-1] == 64
            and all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in (q, k, v))
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        return native.prefill_attention(q, k, v).transpose(1, 2)  # [B, nh, T, hs]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, T, hs]


EMBED_CHUNK = 32  # token ids a quantized model looks up between releases of wte's pages

FEW_IDS = 32  # up to this many ids (a decode step's), a quantized model reads wte's rows from the file


def embed(w: GPT2Weights, ids: torch.Tensor) -> torch.Tensor:
    """ids [...] -> [..., C] float32 token embeddings (wte rows), whatever the weights' dtype. A quantized model
    keeps wte's float32 pages out of its memory (GPT2Weights.wte_pages), so that it stays the quantized size: a
    decode step's few rows are read from the file (FilePages.read_rows); longer inputs go EMBED_CHUNK ids at a time
    through the mapping, whose pages are then dropped, since each distinct id can map a folio of ~1 MB."""
    if w.wte_pages is None:
        return w.wte[ids].float()  # [..., C]
    flat = ids.reshape(-1)
    if flat.shape[0] <= FEW_IDS and (rows := w.wte_pages.read_rows(w.wte, flat.tolist())) is not None:
        return rows.float().view(*ids.shape, -1)
    rows = torch.empty(flat.shape[0], w.wte.shape[1])  # [n, C]
    for i in range(0, flat.shape[0], EMBED_CHUNK):
        rows[i : i + EMBED_CHUNK] = w.wte[flat[i : i + EMBED_CHUNK]]
        w.wte_pages.release(w.wte)
    return rows.view(*ids.shape, -1)
