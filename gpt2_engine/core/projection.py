"""How a projection runs, for each weight format: the one place that model.linear() and model.lm_head() dispatch to.

  float32        decode-sized inputs (<= DECODE_ROWS rows): the native row-invariant kernels (kernels/decode.cpp),
                 from panels where the loader kept them (weights.PanelMatrix); longer inputs: MKL's addmm on the
                 file's (K, N) matrix; without the native kernels, a GEMV split over the cores.
  bfloat16       decode-sized inputs: the same native kernels, reading bf16 and widening it in registers (half the
                 bytes, float32 arithmetic), from panels (weights.PanelMatrix) where the loader kept them so. Longer
                 inputs (prefill, scoring) on a CPU with AMX or AVX512-BF16: oneDNN's bf16 GEMM, which rounds the
                 activations and the outputs to bf16 and accumulates in float32; elsewhere (AVX2, where that GEMM is
                 ~7x slower than float32) widened to float32, then MKL. The head always keeps float32 arithmetic:
                 through the bf16 GEMM it cost top-1 agreement on the trained checkpoint (98.9%, below the 99.5% this
                 mode promises; 99.8% with the projections alone in bf16).
  packed         float32 or bfloat16 with packed exponents (core/packed.py's PackedMatrix, 28 or 12 bits a weight):
                 decode-sized inputs on kernels/packed.cpp, decode.cpp's bits from fewer bytes; longer inputs as
                 their dtype's, on the matrix the units decode to (float32: the file's, kept beside them).
  int8 / int4    (QuantizedMatrix) the native blockwise kernel (kernels/quant.cpp) at every row count, so prefill,
                 scoring and decode share one arithmetic; quantized_reference() is the same arithmetic in torch: the
                 fallback where the native kernels are missing, and what the tests hold the kernel to.
Another device (the torch runner's GPU): torch's matmul in the weight's dtype (device_project); float32 with
                 TF32 as torch is set (off by default: IEEE float32), bfloat16 and float16 with the activations
                 rounded to that dtype and float32 accumulation (cuBLAS), the output and the bias in float32 (straight
                 out of the GEMM where torch has addmm's out_dtype there). The native kernels are for CPU tensors
                 only: every dispatch here checks the device first.
LoRA adapters (weights.LoraStack on a Linear) add their low-rank term after the base projection, each row with its
own adapter (lora_rows).
Inputs that require grad (attribution in inspect/) take the torch path with the weights in float32, since the
native kernels have no autograd.
"""

from __future__ import annotations

import functools
import math

import torch

from .config import DECODE_ROWS
from .kernels import cpu, decode_kernels
from .packed import PackedMatrix
from .quantize import GROUP, PANEL, dequantize, unpack
from .weights import Linear, LoraStack, PanelMatrix, QuantizedMatrix

# Decoding multiplies only a few rows (one per sequence) by each weight matrix: a memory-bound GEMV. Up to
# config.DECODE_ROWS rows, float32 projections and the head run on the native row-invariant kernels, and the weight
# is read once for all rows. Without them (no compiler), the fallback below: MKL
# runs a GEMV on one core at about half the machine's read bandwidth, so the reduction is split over the cores with
# one bmm on zero-copy views of the weight (not batch-invariant).
FEW_ROWS = 8
# vocabulary rows of the head widened to float32 at a time, a bfloat16 head's here and a quantized head's in training's
# backward: (4096, C) float32 is 12 MiB at C = 768, which stays in cache
HEAD_BLOCK = 4096
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what decode.cpp's kernels read


def split_matmul(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """[M, K] @ [K, N] -> [M, N] with K split into one chunk per thread; None where that does not apply."""
    (M, K), chunks = x2.shape, torch.get_num_threads()
    if M > FEW_ROWS or chunks < 2 or K % chunks or not w.is_contiguous():
        return None
    parts = torch.bmm(x2.view(M, chunks, K // chunks).transpose(0, 1), w.view(chunks, K // chunks, -1))  # [chunks, M, N]
    return parts.sum(dim=0)


def as_float32(w: torch.Tensor | QuantizedMatrix | PanelMatrix | PackedMatrix) -> torch.Tensor:
    """A projection's weight (K, N) in float32 (float64 stays): quantized, paneled, packed and bfloat16 weights
    dequantized."""
    if isinstance(w, QuantizedMatrix):
        return dequantize(w)
    if isinstance(w, PackedMatrix):
        return w.plain if w.plain is not None and w.dtype == torch.float32 else packed_dense(w, torch.float32)
    if isinstance(w, PanelMatrix):
        if w.plain is not None:  # float32, the file's own matrix
            return w.plain
        native = decode_kernels()
        return native.unpack_panels(w.panels) if native is not None else w.dense(torch.float32)
    return w if w.dtype in (torch.float32, torch.float64) else w.float()


def packed_dense(w: PackedMatrix, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A packed matrix (R, C) in `dtype` (None: its own), decoded natively where the kernels are built (each tile as
    the decode kernels decode it), else by the format's torch reference (PackedMatrix.dense)."""
    native = decode_kernels()
    if native is None:
        return w.dense(dtype)
    out = native.unpack_packed(w.units, w.side, w.rows, w.cols, w.band, w.bits, dtype == torch.float32)
    return out if dtype is None or out.dtype == dtype else out.to(dtype)


def half_matrix(w: torch.Tensor | PanelMatrix | PackedMatrix) -> torch.Tensor:
    """A bfloat16 projection's (K, N) matrix as a tensor for oneDNN's bf16 GEMM: panels and packed units decoded."""
    if isinstance(w, PanelMatrix):
        return w.dense()
    if isinstance(w, PackedMatrix):
        return w.plain if w.plain is not None else packed_dense(w)
    return w


def head_rows(head: torch.Tensor | QuantizedMatrix | PackedMatrix, rows: slice = slice(None)) -> torch.Tensor:
    """Rows of the output head as (n, C) float32 (a quantized head is stored transposed, (C, V))."""
    if isinstance(head, QuantizedMatrix):
        return dequantize(head).t()[rows]
    if isinstance(head, PackedMatrix):
        head = head.matrix()  # wte itself: a packed head keeps it as `plain`
    return head[rows] if head.dtype in (torch.float32, torch.float64) else head[rows].float()


def quantize_activations(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> q [M, K / 32, 32] (integers, as float32) and scales [M, K / 32]: kernels/quant.cpp's rounding."""
    M, K = x2.shape
    groups = x2.reshape(M, K // GROUP, GROUP)  # [M, G, 32]
    scales = groups.abs().amax(dim=-1) / 127  # [M, G]
    safe = torch.where(scales != 0, scales, 1)[..., None]
    q = torch.where(scales[..., None] != 0, (groups / safe).clamp(-127, 127).round(), 0)  # half to even, as nearbyint
    return q, scales


def quantized_reference(x2: torch.Tensor, m: QuantizedMatrix, bias: torch.Tensor | None) -> torch.Tensor:
    """[M, K] -> [M, N]: packed_rows' arithmetic in torch. Each group's integer dot product (exact in float32: its
    terms are below 2^24), then acc = fma(isum_g, xscale_g * wscale_g, acc) group by group, emulated in float64 (a
    float32 product of the scales, one rounding per step), then the bias."""
    q, w_scales = unpack(m)  # (K, N) int8, (G, N) float32
    M, G = x2.shape[0], m.in_features // GROUP
    xq, x_scales = quantize_activations(x2.float())  # [M, G, 32], [M, G]
    isum = torch.bmm(xq.transpose(0, 1), q.float().view(G, GROUP, m.out_features))  # [G, M, N]
    acc = torch.zeros(M, m.out_features)
    for g in range(G):
        scale = w_scales[g] * x_scales[:, g : g + 1]  # [M, N], float32 as the kernel multiplies
        acc = (acc.double() + isum[g].double() * scale.double()).float()
    return acc if bias is None else acc + bias


def native_rows(x2: torch.Tensor, w: torch.Tensor | PanelMatrix | PackedMatrix,
                bias: torch.Tensor | None) -> torch.Tensor | None:
    """project() of a decode-sized input on the native row-invariant kernels (decode.cpp, or packed.cpp for packed
    exponents: the same bits); None where they do not apply (no kernels, too many rows, no bias, another dtype or a
    strided matrix)."""
    native = decode_kernels()
    if native is None or x2.shape[0] > DECODE_ROWS or bias is None:
        return None
    if isinstance(w, PackedMatrix):
        return native.conv1d_packed(x2, w.units, w.side, bias, w.bits, cpu().avx512)
    if isinstance(w, PanelMatrix):  # decode.cpp reads panels as they are
        return native.conv1d_rows(x2, w.panels, bias, cpu().avx512)
    if w.dtype in NATIVE_DTYPES and w.is_contiguous():
        return native.conv1d_rows(x2, w, bias, cpu().avx512)
    return None


def project(x2: torch.Tensor, w: torch.Tensor | QuantizedMatrix | PanelMatrix | PackedMatrix,
            bias: torch.Tensor | None) -> torch.Tensor:
    """[M, K] @ w (K, N) (+ bias) -> [M, N] float32, by the weight's format (see the module docstring)."""
    if x2.device.type != "cpu":
        return device_project(x2, w, bias)
    grad = x2.requires_grad
    native = decode_kernels() if not grad else None
    if isinstance(w, QuantizedMatrix):
        if native is not None:
            empty = x2.new_empty(0) if bias is None else bias
            return native.packed_rows(x2, w.packed, w.scales, empty, w.out_features, w.bits, cpu().avx512_vnni)
        if not grad:
            return quantized_reference(x2, w, bias)
    elif native is not None and (y := native_rows(x2, w, bias)) is not None:
        return y
    elif w.dtype == torch.bfloat16 and not grad and cpu().bf16_matmul:
        y = (x2.bfloat16() @ half_matrix(w)).float()  # [M, N]: bf16 in and out, float32 accumulation inside oneDNN
        return y if bias is None else y + bias
    w = as_float32(w)
    if bias is None:
        return x2 @ w
    if (flat := split_matmul(x2, w)) is not None:
        return flat + bias
    return torch.addmm(bias, x2, w)


def device_project(x2: torch.Tensor, w: torch.Tensor | QuantizedMatrix | PanelMatrix | PackedMatrix,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """project() off the CPU: [M, K] float32 @ w (K, N) float32, bfloat16 or float16 (+ bias) -> [M, N] float32."""
    if not isinstance(w, torch.Tensor):  # quantized, paneled, packed matrices: the CPU's layouts (weights.on_device)
        raise TypeError(f"project: a {type(w).__name__} has no kernel on {x2.device}; move plain matrices there")
    if w.dtype == torch.float32:
        return x2 @ w if bias is None else torch.addmm(bias, x2, w)
    x = x2.to(w.dtype)  # [M, K]: half-width inputs, float32 accumulation in cuBLAS
    if float32_out(x.device, w.dtype):  # the sums leave the GEMM in float32, the bias added there: one kernel
        return torch.mm(x, w, out_dtype=torch.float32) if bias is None else torch.addmm(bias, x, w,
                                                                                          out_dtype=torch.float32)
    y = (x @ w).float()  # [M, N], rounded to the half-width dtype on the way out
    return y if bias is None else y + bias


@functools.cache
def float32_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch multiplies `dtype` matrices into float32 outputs on `device` (addmm's out_dtype; CUDA, recent
    torch), asked once per device and dtype on a 2 x 2 product."""
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device)
        return torch.addmm(torch.zeros(2, device=device), a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def native_projection(p: Linear) -> tuple[list[torch.Tensor], int] | None:
    """A projection as kernels/block.cpp takes it: [weight, scales, bias, LoRA a, b, scale] (empty tensors where it
    has no scales or no LoRA) and its bits (0: float32 or bfloat16, plain or in panels, read by decode.cpp's kernel;
    28 or 12: float32 or bfloat16 with packed exponents, its units and side list; 8 or 4: quantized);
    None where a tensor has no native kernel (another dtype, a strided weight, float64 adapters)."""
    empty = torch.empty(0)
    w, lora = p.weight, p.lora
    if isinstance(w, QuantizedMatrix):
        tensors, bits = [w.packed, w.scales], w.bits
    elif isinstance(w, PackedMatrix):  # packed.cpp's conv1d_packed
        tensors, bits = [w.units, w.side], w.bits
    elif isinstance(w, PanelMatrix):  # decode.cpp's conv1d_rows reads panels as they are
        tensors, bits = [w.panels, empty], 0
    elif w.dtype in NATIVE_DTYPES and w.is_contiguous():
        tensors, bits = [w, empty], 0
    else:
        return None
    if p.bias is None or p.bias.dtype != torch.float32 or not p.bias.is_contiguous():
        return None
    if lora is None:
        return [*tensors, p.bias, empty, empty, empty], bits
    if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (lora.a, lora.b, lora.scale)):
        return None
    return [*tensors, p.bias, lora.a, lora.b, lora.scale], bits


def head_logits(x2: torch.Tensor, head: torch.Tensor | QuantizedMatrix | PackedMatrix) -> torch.Tensor:
    """[M, C] -> [M, V] logits through the tied head: wte (V, C) in float32 or bfloat16 (or with packed exponents),
    or its quantized (C, V)."""
    if isinstance(head, QuantizedMatrix):
        return project(x2, head, None)
    if isinstance(head, PackedMatrix):
        native = decode_kernels() if x2.shape[0] <= DECODE_ROWS and not x2.requires_grad else None
        if native is not None:
            return native.dot_packed(x2, head.units, head.side, head.rows, head.bits, cpu().avx512)
        head = head.matrix()  # wte itself (kept as `plain`): what longer inputs read
    if x2.device.type != "cpu":  # wte (V, C) as the matrix of x @ wte^T, in cuBLAS
        return x2 @ head.t() if head.dtype == torch.float32 else (x2.to(head.dtype) @ head.t()).float()
    native = decode_kernels() if x2.shape[0] <= DECODE_ROWS and not x2.requires_grad else None
    if native is not None and head.dtype in NATIVE_DTYPES and head.is_contiguous():
        return native.dot_rows(x2, head, cpu().avx512)
    return torch_head(x2, head)


def torch_head(x2: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """[M, C] -> [M, V] through wte (V, C) on torch's CPU kernels: longer inputs, training, and where no native
    kernel runs."""
    M, C = x2.shape
    V = head.shape[0]
    grad = x2.requires_grad
    if head.dtype != torch.float32:  # bfloat16: widened a block of rows at a time
        return torch.cat([x2 @ head_rows(head, slice(r, r + HEAD_BLOCK)).t() for r in range(0, V, HEAD_BLOCK)], dim=1)
    chunks = torch.get_num_threads()
    if M > FEW_ROWS or chunks < 2 or grad:
        # computed as wte @ x^T, [V, M], and returned as its transposed view: MKL runs this orientation (a tall
        # operand, not a transposed wide one) markedly faster than x @ wte^T (docs/benchmarks.md), and reductions
        # over the vocabulary (logsumexp, topk) read the strided view as fast.
        return (head @ x2.t()).t()  # [M, V], strides (1, M)
    # the same split for decoding, over the vocabulary rows: chunks of h rows, plus the V % chunks left over
    h = V // chunks
    parts = torch.bmm(x2.expand(chunks, M, C), head[: chunks * h].view(chunks, h, C).transpose(1, 2))  # [chunks, M, h]
    return torch.cat([*parts, x2 @ head[chunks * h :].t()], dim=1)


def lora_rows(x2: torch.Tensor, lora: LoraStack, rows: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y [M, N] + scale[i] * (x2 [M, K] a[i]) b[i] for each row's adapter i = rows[m] (-1: none; rows None: every
    row adapter 0). The native kernel reduces each row on its own in a fixed order (kernels/lora.cpp), so a row's
    bits do not depend on the other rows or adapters; it adds in place. The torch form (no kernels, or autograd)
    groups rows by adapter and returns a new tensor."""
    native = decode_kernels() if not (x2.requires_grad or lora.a.requires_grad) and x2.device.type == "cpu" else None
    if native is not None and x2.dtype == torch.float32 and lora.a.dtype == torch.float32:
        index = rows if rows is not None else torch.zeros(x2.shape[0], dtype=torch.long)
        native.lora_rows(x2.contiguous(), lora.a, lora.b, lora.scale, index, y)
        return y
    if rows is None:
        return y + ((x2 @ lora.a[0]) @ lora.b[0]) * lora.scale[0]
    out = y.clone()
    for i in rows.unique().tolist():
        if i >= 0:
            sel = rows == i
            out[sel] += ((x2[sel] @ lora.a[i]) @ lora.b[i]) * lora.scale[i]
    return out


def dequantize_columns(m: QuantizedMatrix, first: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Columns [first, end) of a quantized matrix as float32 (K, end - first); first a multiple of 16. The native
    kernel writes whole panels into `out` (K, >= panels * 16) where given; the torch form slices dequantize()."""
    if first % PANEL:
        raise ValueError(f"dequantize_columns: first column {first} is not a multiple of {PANEL}")
    native = decode_kernels()
    if native is None:
        return dequantize(m)[:, first:end]
    p0, p1 = first // PANEL, -(-end // PANEL)
    width = (p1 - p0) * PANEL
    if out is None or out.numel() < m.in_features * width:
        out = torch.empty(m.in_features * width)
    panels = out.view(-1)[: m.in_features * width].view(m.in_features, width)
    native.dequantize_panels(m.packed, m.scales, m.bits, m.in_features, p0, p1, panels)
    return panels[:, : end - first]


def reduce_rows(logits: torch.Tensor, banned: list[int] | None = None) -> tuple[list[int], list[float], list[float]]:
    """[n, V] -> each row's argmax skipping its `banned` token (-1: none; the argmax is -1 where the row has no
    value above -inf, or holds a NaN), that logit, and the logsumexp of the whole row (NaN where it holds one):
    runtime/plan.py's Picks. Each row is reduced alone in fixed pieces of the vocabulary (kernels/block.cpp, the
    same reduction as the native head's greedy picks), so that a row's values, and with them a token's logprob,
    never depend on what else shares the pass; torch's, row by row, where the native kernels are missing."""
    n = logits.shape[0]
    banned = [-1] * n if banned is None else banned
    native = decode_kernels() if logits.device.type == "cpu" else None
    if native is not None and logits.dtype == torch.float32:
        rows = logits if logits.shape[1] <= 1 or logits.stride(1) == 1 else logits.contiguous()
        return native.reduce_rows(rows, banned)
    tokens, best, lse = [], [], []
    for row, ban in zip(logits.float(), banned):
        total = float(torch.logsumexp(row, -1))
        allowed = row.clone()
        if ban >= 0:
            allowed[ban] = -math.inf
        t = int(allowed.argmax())
        ok = not math.isnan(total) and float(allowed[t]) > -math.inf
        tokens.append(t if ok else -1)
        best.append(float(allowed[t]) if ok else math.nan if math.isnan(total) else -math.inf)
        lse.append(total)
    return tokens, best, lse
