"""The model's weights as types: a frozen tree of tensors under GPT-2's official names (Block, Linear, LayerNorm,
GPT2Weights), the forms a projection's matrix takes (a plain (K, N) tensor, panels, blockwise-quantized, packed
exponents: core/packed.py), the one
function that knows the fused c_attn's order, and every parameter's expected shape.

The official files (`openai-community/gpt2` on the Hub) store every projection in Conv1D layout, weight shape
(in, out), so a projection is `x @ W + b`; the engine keeps that layout. Reading and writing files is formats/'s work
(formats/hf.py for the Hub's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar

import torch

from .config import GPT2Config
from .packed import PackedMatrix
from .pages import FilePages, HugeArena, file_pages, huge_pages_available, move_to_huge_pages

# The Conv1D matrices of a block, by their official names: nanoGPT, llm.c and GGUF store them as nn.Linear's
# (out, in), so their readers and writers transpose exactly these.
MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@dataclass(frozen=True)
class QuantizedMatrix:
    """A (K, N) weight matrix in blockwise int8, int6 or int4 (core/quantize.py makes it; kernels/quant.cpp reads it).

    Column n's inputs come in groups of 32, each with a float16 scale: W[k, n] = q[k, n] * scales[k // 32, n]. The
    values are stored offset to unsigned and repacked in panels of 16 columns (quantize.pack describes the layout).
    """

    packed: torch.Tensor  # uint8, K * N_padded * bits / 8 bytes
    scales: torch.Tensor  # float16 [N_padded / 16, K / 32, 16]
    bits: int  # 8, 6 (the int4 models' head) or 4
    in_features: int  # K
    out_features: int  # N


Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]  # (shape, dtype) -> an uninitialised tensor


@dataclass(frozen=True)
class PanelMatrix:
    """A (K, N) float32 or bfloat16 weight matrix stored in panels, the order kernels/decode.cpp reads at decode
    (load_weights keeps projections so where asked, and GPT2.from_pretrained asks where the CPU reads them faster:
    kernels.CPU.panels).

    panels[b, t, r, c] = W[b * ROWS + r, t * COLS + c]: a band of ROWS weight rows of COLS columns is one contiguous
    run of memory. decode.cpp's projections read a plain (K, N) weight as one stream per weight row of a pass, which
    AMD's hardware prefetchers follow badly; panels they read in address order (docs/benchmarks.md). Same values, same
    bits.

    `plain`: the same matrix as the (K, N) tensor it was made from, where that costs no memory of the process's own:
    a float32 matrix lies in the memory-mapped checkpoint file, and longer inputs (prefill, scoring) hand it to MKL's
    GEMM as before (widening the panels for each such call cost a 128-token prefill 0.77x). Its pages are released
    once the panels are made and come back from the page cache on the first such call. None for bfloat16, which the
    file does not hold: a GEMM widens the panels (decode.cpp's unpack_panels).
    """

    ROWS: ClassVar[int] = 32  # decode.cpp's PANEL_ROWS
    COLS: ClassVar[int] = 64  # a tile of its AVX-512 body
    PIECES: ClassVar[int] = 8  # decode.cpp's KPIECES: each piece of K must be whole bands

    panels: torch.Tensor  # float32 or bfloat16 [K / ROWS, N / COLS, ROWS, COLS]
    in_features: int  # K
    out_features: int  # N
    plain: torch.Tensor | None = None  # (K, N), the panels' dtype, or None

    @classmethod
    def fits(cls, shape: torch.Size) -> bool:
        """Whether a (K, N) matrix can be kept in panels."""
        K, N = shape
        return K > 0 and K % (cls.PIECES * cls.ROWS) == 0 and N > 0 and N % cls.COLS == 0

    @classmethod
    def of(cls, w: torch.Tensor, dtype: torch.dtype = torch.bfloat16, keep: bool = False,
           alloc: Allocator | None = None) -> PanelMatrix:
        """A contiguous (K, N) matrix (one that fits) in panels of `dtype`, converted as it is copied (one pass, and no
        (K, N) copy in between); keep: `w` itself is kept as `plain` (it must be of `dtype`). alloc(shape, dtype):
        where the panels go (None: a new tensor)."""
        K, N = w.shape
        if keep and w.dtype != dtype:
            raise ValueError(f"PanelMatrix.of: a kept plain matrix must be {dtype}, got {w.dtype}")
        shape = (K // cls.ROWS, N // cls.COLS, cls.ROWS, cls.COLS)
        panels = torch.empty(shape, dtype=dtype) if alloc is None else alloc(shape, dtype)
        panels.copy_(w.view(K // cls.ROWS, cls.ROWS, N // cls.COLS, cls.COLS).permute(0, 2, 1, 3))
        return cls(panels, K, N, w if keep else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The (K, N) matrix in a tensor of its own, in `dtype` (None: the panels'), converted as it is copied."""
        K, N = self.in_features, self.out_features
        out = torch.empty(K, N, dtype=dtype or self.panels.dtype)
        out.view(K // self.ROWS, self.ROWS, N // self.COLS, self.COLS).copy_(self.panels.permute(0, 2, 1, 3))
        return out

    def matrix(self) -> torch.Tensor:
        """The (K, N) matrix in the panels' dtype: `plain` where kept (no copy), else dense()."""
        return self.plain if self.plain is not None else self.dense()


def float_matrix(w: torch.Tensor | PanelMatrix | PackedMatrix) -> torch.Tensor:
    """A float projection's (K, N) matrix as a tensor, however it is stored (in panels or with packed exponents: its
    matrix())."""
    return w.matrix() if isinstance(w, (PanelMatrix, PackedMatrix)) else w


def panel_bytes(config: GPT2Config, dtype: torch.dtype) -> int:
    """Room for the panels of every projection of `config` whose shape fits, in `dtype`, each on its own 64-byte
    line: what load_weights(panels=True) may write through its `alloc`."""
    shapes = [s for name, s in expected_shapes(config).items() if name.startswith("h.") and len(s) == 2]
    return sum(-(-math.prod(s) * dtype.itemsize // 64) * 64 for s in shapes if PanelMatrix.fits(s))


@dataclass(frozen=True)
class LoraStack:
    """Low-rank adapters on one projection (core/lora.py makes them), n of them stacked so that each row of a pass
    can use its own: row m adds scale[i] * (x_m a[i]) b[i] for its adapter i. Ranks below r are zero-padded."""

    a: torch.Tensor  # [n, in, r]
    b: torch.Tensor  # [n, r, out]
    scale: torch.Tensor  # [n] float32: lora_alpha / r (or / sqrt(r) with rsLoRA)


@dataclass(frozen=True)
class Linear:
    """A Conv1D projection: weight (in, out), bias (out,), and the LoRA adapters on it, if any. In a gradient
    GPT2Weights (train/step.py), weight and bias are None where the projection is frozen."""

    weight: torch.Tensor | QuantizedMatrix | PanelMatrix | PackedMatrix
    bias: torch.Tensor
    lora: LoraStack | None = None


@dataclass(frozen=True)
class LayerNorm:
    weight: torch.Tensor  # (C,)
    bias: torch.Tensor  # (C,)


@dataclass(frozen=True)
class Block:
    ln_1: LayerNorm
    c_attn: Linear  # (C, 3C): Q, K, V fused; see split_qkv
    attn_c_proj: Linear  # (C, C)
    ln_2: LayerNorm
    c_fc: Linear  # (C, 4C)
    mlp_c_proj: Linear  # (4C, C)

    def qkv(self) -> tuple[Linear, Linear, Linear]:
        """The Q, K and V projections as (C, C) views of the fused c_attn (no copy)."""
        ws, bs = split_qkv(float_matrix(self.c_attn.weight)), split_qkv(self.c_attn.bias)
        return Linear(ws[0], bs[0]), Linear(ws[1], bs[1]), Linear(ws[2], bs[2])


@dataclass(frozen=True)
class GPT2Weights:
    wte: torch.Tensor  # (V, C) token embedding
    wpe: torch.Tensor  # (n_positions, C)
    blocks: tuple[Block, ...]
    ln_f: LayerNorm
    # wte (V, C) itself (GPT-2 ties them), with packed exponents (its `plain` is wte), or its quantized transpose (C, V)
    head: torch.Tensor | QuantizedMatrix | PackedMatrix
    # Set when the head is not wte's tensor (quantized or packed) and wte is read from the mapped file: the embedding
    # lookup then drops wte's pages after each use (ops.embed). A page fault on a file mapping maps the whole
    # page-cache folio around the row, about 0.9 MB here, so without this every distinct token would leave ~1 MB of
    # float32 wte resident.
    wte_pages: FilePages | None = None


Array = TypeVar("Array")


def split_qkv(fused: Array) -> tuple[Array, Array, Array]:
    """Split GPT-2's fused c_attn along its last axis: [..., 3C] -> 3 x [..., C], in the order Q, K, V.

    This is the one place that knows the order. It applies equally to the weight (C, 3C) (Conv1D layout, so the
    output features are the columns), the bias (3C,) and the projected activations (B, T, 3C); each third holds
    n_head heads of C // n_head channels, head h at [h*hs:(h+1)*hs].
    """
    c3 = fused.shape[-1]
    if c3 % 3:
        raise ValueError(f"c_attn: last dimension must be 3*C, got {c3}")
    c = c3 // 3
    return fused[..., 0:c], fused[..., c : 2 * c], fused[..., 2 * c : 3 * c]


def expected_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every parameter of a GPT-2 checkpoint, by its official name, with its shape."""
    C, V, P, F = config.n_embd, config.vocab_size, config.n_positions, config.mlp_width
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (V, C), "wpe.weight": (P, C)}
    for i in range(config.n_layer):
        h = f"h.{i}."
        shapes.update({
            h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
            h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
            h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
            h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
            h + "mlp.c_fc.weight": (C, F), h + "mlp.c_fc.bias": (F,),
            h + "mlp.c_proj.weight": (F, C), h + "mlp.c_proj.bias": (C,),
        })  # fmt: skip
    shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    return shapes


# Each Block field and the official name of its part: `h.{i}.` + name + `.weight` / `.bias`.
BLOCK_PARTS = {"ln_1": "ln_1", "c_attn": "attn.c_attn", "attn_c_proj": "attn.c_proj", "ln_2": "ln_2",
               "c_fc": "mlp.c_fc", "mlp_c_proj": "mlp.c_proj"}


def named_tensors(w: GPT2Weights) -> dict[str, torch.Tensor]:
    """Every parameter under its official name, in expected_shapes' order (the tied head is wte, not listed)."""
    named = {"wte.weight": w.wte, "wpe.weight": w.wpe}
    for i, blk in enumerate(w.blocks):
        for field, part in BLOCK_PARTS.items():
            p = getattr(blk, field)
            if isinstance(p.weight, QuantizedMatrix):
                raise ValueError(f"h.{i}.{part}.weight is quantized; only float weights have named tensors")
            named[f"h.{i}.{part}.weight"], named[f"h.{i}.{part}.bias"] = float_matrix(p.weight), p.bias
    named["ln_f.weight"], named["ln_f.bias"] = w.ln_f.weight, w.ln_f.bias
    return named


def assemble(named: dict[str, torch.Tensor], config: GPT2Config) -> GPT2Weights:
    """GPT2Weights over tensors named as in the official files (no copies; the head is wte, as GPT-2 ties them)."""
    def part(i: int, field: str) -> Linear | LayerNorm:
        name = f"h.{i}.{BLOCK_PARTS[field]}"
        kind = LayerNorm if field.startswith("ln") else Linear
        return kind(named[name + ".weight"], named[name + ".bias"])

    blocks = tuple(Block(**{field: part(i, field) for field in BLOCK_PARTS}) for i in range(config.n_layer))
    return GPT2Weights(wte=named["wte.weight"], wpe=named["wpe.weight"], blocks=blocks,
                       ln_f=LayerNorm(named["ln_f.weight"], named["ln_f.bias"]), head=named["wte.weight"])


def parameter_count(config: GPT2Config) -> int:
    """Number of parameters (the tied head counted once)."""
    return sum(math.prod(shape) for shape in expected_shapes(config).values())


def stored_tensors(m: torch.Tensor | QuantizedMatrix | PanelMatrix | PackedMatrix) -> tuple[torch.Tensor, ...]:
    """The tensors a matrix's decode-time form lies in: a quantized one's values and scales, the panels, the packed
    units (their side list is small and read once a tile), or the plain tensor itself."""
    if isinstance(m, QuantizedMatrix):
        return m.packed, m.scales
    if isinstance(m, PanelMatrix):
        return (m.panels,)
    if isinstance(m, PackedMatrix):
        return (m.units,)
    return (m,)


def matrices_on_huge_pages(w: GPT2Weights, file: Path | None = None, arena: HugeArena | None = None) -> None:
    """Move the block matrices and the head of `w` (bfloat16, float32 or packed, with their scales, or panels) onto
    huge pages (move_to_huge_pages), where the system has them; the values, and so every result, stay the same.
    Those the loader wrote into `arena` are there already.

    file: the checkpoint that float32 weights are read in place from (GPT2.from_pretrained passes it only where the
    projections are in panels). Then only the panels and the head move: the plain matrices kept beside the panels
    stay in the file for GEMMs, at no memory of the process's own, and the head's pages there are released as it
    moves. The head reads 1.1x faster off huge pages than through the file's 4 KB mappings (whole decode
    1.016x, docs/benchmarks.md)."""
    if not huge_pages_available():
        return
    tensors = tensors_to_place(w, file, arena)
    if not tensors or not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors):
        return
    pages = None if file is None or not isinstance(w.head, torch.Tensor) else file_pages(w.head, file)
    move_to_huge_pages(list({id(t): t for t in tensors}.values()), None if pages is None else {id(w.head): pages})


def tensors_to_place(w: GPT2Weights, file: Path | None, arena: HugeArena | None) -> list[torch.Tensor]:
    """What matrices_on_huge_pages moves: the block matrices' stored tensors (with `file`, only what is not a plain
    matrix of the file) and the head's, less those the loader wrote into `arena`."""
    matrices = [getattr(b, name).weight for b in w.blocks for name in ("c_attn", "attn_c_proj", "c_fc", "mlp_c_proj")]
    tensors = [t for m in matrices if file is None or not isinstance(m, torch.Tensor) for t in stored_tensors(m)]
    # GPT-2's head is wte itself (tied), or its quantized transpose, or its packed units
    tensors += stored_tensors(w.head)
    return [t for t in tensors if arena is None or not arena.holds(t)]  # placed there by the loader already


def on_device(w: GPT2Weights, device: torch.device, dtype: torch.dtype | None = None) -> GPT2Weights:
    """The weights as the torch runner keeps them (runtime/torch_runner.py), on `device`: each block's four
    projections as plain (K, N) matrices in `dtype` (None: as they are), everything else (biases, layer norms, wpe, LoRA
    adapters) float32, and wte, which is also the head, float32 too: the CPU's bfloat16 path found a bfloat16 head
    cost top-1 agreement (core/projection.py). Tensors already there in that dtype are kept, not copied, so applying
    it again (to adapters attached since) moves only what is new."""
    def move(t: torch.Tensor, to: torch.dtype | None = torch.float32) -> torch.Tensor:
        return t.to(device=device, dtype=to or t.dtype)

    def linear(p: Linear) -> Linear:
        if isinstance(p.weight, QuantizedMatrix):
            raise ValueError("on_device: quantized matrices have no kernel off the native CPU runner")
        lora = None if p.lora is None else LoraStack(move(p.lora.a), move(p.lora.b), move(p.lora.scale))
        return Linear(move(float_matrix(p.weight), dtype), move(p.bias), lora)

    def norm(p: LayerNorm) -> LayerNorm:
        return LayerNorm(move(p.weight), move(p.bias))

    blocks = tuple(Block(norm(b.ln_1), linear(b.c_attn), linear(b.attn_c_proj), norm(b.ln_2), linear(b.c_fc),
                         linear(b.mlp_c_proj)) for b in w.blocks)
    if isinstance(w.head, QuantizedMatrix):
        raise ValueError("on_device: a quantized head has no kernel off the native CPU runner")
    wte = move(w.wte)
    tied = w.head is w.wte or isinstance(w.head, PackedMatrix)  # a packed head is wte's values (its plain is wte)
    return GPT2Weights(wte, move(w.wpe), blocks, norm(w.ln_f), wte if tied else move(w.head))
