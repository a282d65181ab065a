"""Load official GPT-2 checkpoints: a name table, strict accounting, one exception type.

The official files (`openai-community/gpt2` on the Hub) store every projection in Conv1D layout, weight shape
(in, out), so a projection is `x @ W + b`. We keep that layout: the safetensors file is memory-mapped and, in float32,
its tensors are used in place, never copied.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import re
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar

import torch
from safetensors import safe_open

from .config import GPT2Config
from .errors import WeightsError
from .files import atomic_write

DEFAULT_WEIGHTS = Path("weights")  # the project's default checkpoint directory
# The demo model (scripts/demo.py, `make demo`): a small GPT-2 trained offline where the official weights cannot be
# downloaded. `latest` is a link to the newest build; "demo" names it wherever a checkpoint directory is asked for.
DEMO_WEIGHTS = Path(".cache/demo/latest")
DEMO_NAME = "demo"
SAFETENSORS = "model.safetensors"
PYTORCH_BIN = "pytorch_model.bin"
CONFIG = "config.json"
# Checkpoint formats we recognise but do not read, so that the error can say what was found.
OTHER_FORMATS = ("tf_model.h5", "flax_model.msgpack", "model.ckpt.index", "64-8bits.tflite", "rust_model.ot")

# Buffers that transformers saves with the weights but that are not parameters: the causal mask.
IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


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


def float_matrix(w: torch.Tensor | PanelMatrix) -> torch.Tensor:
    """A float projection's (K, N) matrix as a tensor, however it is stored (a PanelMatrix: its matrix())."""
    return w.matrix() if isinstance(w, PanelMatrix) else w


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

    weight: torch.Tensor | QuantizedMatrix | PanelMatrix
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
class FilePages:
    """The pages under a tensor that lies in a read-only memory mapping of the checkpoint file (file_pages() checks
    that). Releasing them loses nothing: a later access reads them from the file again."""

    start: int  # the checked tensor's first byte
    end: int  # one past its last byte
    path: str = ""  # the mapped file
    offset: int = 0  # where in it the checked tensor's first byte is
    inode: tuple[int, int] = (0, 0)  # (device, inode) of that file when it was checked

    def read_rows(self, table: torch.Tensor, ids: list[int]) -> torch.Tensor | None:
        """Rows `ids` of `table` (a contiguous 2-D tensor within the checked one) as [n, C], read from the file with
        pread instead of through the mapping: nothing gets mapped, so there is nothing to release afterwards (a
        release and the page fault of the next read cost ~0.3 ms a decode step). None where that cannot be done,
        or where the file at `path` is no longer the one mapped (replaced on disk since)."""
        first = table.data_ptr()
        if not self.path or table.dim() != 2 or not table.is_contiguous() or not self.start <= first < self.end:
            return None
        for t in ids:
            if not 0 <= t < table.shape[0]:
                raise IndexError(f"index {t} is out of bounds for {table.shape[0]} rows")
        out = torch.empty(len(ids), table.shape[1], dtype=table.dtype)  # [n, C]
        row_bytes = table.shape[1] * table.element_size()
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.inode:
                return None
            for i, t in enumerate(ids):
                at = self.offset + first - self.start + t * row_bytes
                if os.preadv(fd, [view[i * row_bytes : (i + 1) * row_bytes]], at) != row_bytes:
                    return None
        finally:
            os.close(fd)
        return out

    def within(self, tensor: torch.Tensor) -> FilePages | None:
        """The pages under `tensor`, if it is contiguous and lies within these (None otherwise)."""
        first = tensor.data_ptr()
        end = first + tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or not self.start <= first <= end <= self.end:
            return None
        return FilePages(first, end, self.path, self.offset + first - self.start, self.inode)

    def release(self, tensor: torch.Tensor) -> bool:
        """Drop this process's resident pages under `tensor` (madvise DONTNEED, ~10 us); False, leaving it alone,
        unless it is contiguous and lies within the checked tensor (not a copy, not on another device)."""
        if self.within(tensor) is None:
            return False
        first, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
        first = max(self.start - self.start % mmap.PAGESIZE, first - first % mmap.PAGESIZE)
        return libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), MADV_DONTNEED) == 0


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, loaded once per process (a dlopen for each madvise cost more than the madvise)."""
    return ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class GPT2Weights:
    wte: torch.Tensor  # (V, C) token embedding
    wpe: torch.Tensor  # (n_positions, C)
    blocks: tuple[Block, ...]
    ln_f: LayerNorm
    head: torch.Tensor | QuantizedMatrix  # wte (V, C) itself (GPT-2 ties them), or its quantized transpose (C, V)
    # Set when the head is quantized and wte is read from the mapped file: the embedding lookup then drops wte's
    # pages after each use (model.embed). A page fault on a file mapping maps the whole page-cache folio around the
    # row, about 0.9 MB here, so without this every distinct token would leave ~1 MB of float32 wte resident.
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


def weights_directory(given: Path | None) -> tuple[Path, str]:
    """The checkpoint directory that a `--weights` value names, and a line for the user when it is not `given`.

    None is the default: `weights/`, or the demo model when `weights/` holds no checkpoint and the demo is built (the
    line says so). "demo" names the demo model, unless a directory of that name exists.
    """
    if given is None:
        if not _has_checkpoint(DEFAULT_WEIGHTS) and _has_checkpoint(DEMO_WEIGHTS):
            return DEMO_WEIGHTS, (f"{DEFAULT_WEIGHTS}/ holds no checkpoint; using the demo model ({_shown(DEMO_WEIGHTS)}; "
                                  "`make weights` downloads GPT-2's)")
        return DEFAULT_WEIGHTS, ""
    if str(given) == DEMO_NAME and not given.exists():
        if not _has_checkpoint(DEMO_WEIGHTS):
            raise WeightsError(f"{DEMO_NAME}: the demo model is not built in {DEMO_WEIGHTS.parent}/ (run `make demo` "
                               "from the project's directory)")
        return DEMO_WEIGHTS, ""
    return given, ""


def weights_fingerprint(directory: Path) -> str:
    """Which checkpoint this is: the first 16 hex digits of the sha256 of its weights file, whole (an edit of one
    layer, as model-editing methods make, changes it; sampling the file would miss that). A LoRA adapter records its
    base's, and a resumed run checks it."""
    import hashlib

    digest = hashlib.sha256()
    with open(directory if directory.is_file() else find_weights_file(directory), "rb") as f:  # or a checkpoint file
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _has_checkpoint(directory: Path) -> bool:
    return (directory / SAFETENSORS).is_file() or (directory / PYTORCH_BIN).is_file()


def _shown(link: Path) -> str:
    """`link` as the directory it points to, relative to the working directory where it is below it."""
    target = link.resolve()
    try:
        return str(target.relative_to(Path.cwd()))
    except ValueError:
        return str(target)


def find_weights_file(directory: Path) -> Path:
    """The checkpoint file to read in `directory`: model.safetensors, else pytorch_model.bin."""
    if not directory.exists():
        raise WeightsError(f"{directory}: weights directory does not exist (run `make weights`, or `make demo` offline, or copy the official files there)")
    if not directory.is_dir():
        raise WeightsError(f"{directory}: expected a directory holding {CONFIG} and {SAFETENSORS} or {PYTORCH_BIN}, found a file")
    for name in (SAFETENSORS, PYTORCH_BIN):
        if (directory / name).is_file():
            return directory / name
    others = [name for name in OTHER_FORMATS if (directory / name).exists()]
    if others:
        raise WeightsError(f"{directory}: unsupported weights format {others[0]}; expected {SAFETENSORS} or {PYTORCH_BIN}")
    raise WeightsError(f"{directory}: no {SAFETENSORS} or {PYTORCH_BIN} found (run `make weights`, or `make demo` offline, or copy the official files there)")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint file, memory-mapped where the format allows."""
    if path.name.endswith(".safetensors"):
        try:
            with safe_open(str(path), framework="pt") as f:
                return {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise WeightsError(f"{path}: not a readable safetensors file ({_one_line(e)})") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise WeightsError(f"{path}: not a readable PyTorch checkpoint ({_one_line(e)})") from None
        state = _load_legacy_bin(path)  # files written before the zip format cannot be memory-mapped
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, TypeError) as e:
        raise WeightsError(f"{path}: not a readable PyTorch checkpoint ({_one_line(e)})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(f"{path}: expected a dict of tensors (a state_dict), found {type(state).__name__}")
    return state


def _load_legacy_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise WeightsError(f"{path}: not a readable PyTorch checkpoint ({_one_line(e)})") from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] or type(e).__name__


def load_weights(directory: str | Path, config: GPT2Config, dtype: torch.dtype = torch.float32,
                 resident: bool = True, panels: bool = False, alloc: Allocator | None = None) -> GPT2Weights:
    """Read and check every tensor of the checkpoint in `directory`; raise WeightsError on any mismatch.

    `dtype` is that of the weight matrices (and wte); everything else stays float32. resident=False: the pages that
    checking read are released again (release_pages), for a caller that quantizes the matrices one at a time.
    panels: keep the projections in panels (PanelMatrix) where their shape allows; float32 ones only where the file
    is memory-mapped, and with the file's matrix beside them (PanelMatrix.plain: its pages released until a GEMM
    reads them). alloc: where the panels are written (pages.HugeArena.take; None: new tensors).
    """
    path = find_weights_file(Path(directory))
    return weights_from_tensors(read_tensors(path), config, path, dtype, resident, panels, alloc)


def weights_from_tensors(raw: dict[str, torch.Tensor], config: GPT2Config, path: Path,
                         dtype: torch.dtype = torch.float32, resident: bool = True, panels: bool = False,
                         alloc: Allocator | None = None) -> GPT2Weights:
    """load_weights' checks and assembly, on tensors by official name (read from `path`, which errors name)."""
    expected = expected_shapes(config)

    tensors: dict[str, torch.Tensor] = {}
    lm_head: torch.Tensor | None = None
    unexpected: list[str] = []
    for full_name, tensor in raw.items():
        name = full_name.removeprefix("transformer.")  # GPT2LMHeadModel saves with the prefix, the Hub files without
        if IGNORED.fullmatch(name):
            continue
        if name == "lm_head.weight":
            lm_head = tensor
        elif name in expected:
            if name in tensors:
                raise WeightsError(f"{path}: tensor {name} appears twice (with and without the 'transformer.' prefix)")
            tensors[name] = tensor
        else:
            unexpected.append(full_name)
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise WeightsError(f"{path}: unexpected tensor {unexpected[0]}{more} (not part of GPT-2 with n_layer={config.n_layer})")

    for name, shape in expected.items():
        if name not in tensors:
            raise WeightsError(f"{path}: missing tensor {name} (expected shape {list(shape)})")
        _check_tensor(path, name, tensors[name], shape, None if resident else path)
    if lm_head is not None:
        _check_tensor(path, "lm_head.weight", lm_head, expected["wte.weight"], None if resident else path)
        if not torch.equal(lm_head, tensors["wte.weight"]):
            diff = (lm_head.float() - tensors["wte.weight"].float()).abs().max().item()
            raise WeightsError(f"{path}: lm_head.weight differs from wte.weight (max |diff| {diff:.3g}); GPT-2 ties them")
        if not resident:
            release_pages(lm_head, path)
            release_pages(tensors["wte.weight"], path)

    def t(name: str, target: torch.dtype = torch.float32) -> torch.Tensor:
        tensor = tensors[name]
        if tensor.dtype == target:
            return tensor
        converted = tensor.to(target)
        if not resident:  # the conversion read the file's pages back in; the copy is what is kept
            release_pages(tensor, path)
        return converted

    mappings: list[FilePages] = []  # the file's mappings found so far: one /proc/self/maps read for each

    def in_file(tensor: torch.Tensor) -> FilePages | None:
        """The pages under `tensor` if it lies in a mapping of the file `path`."""
        for mapping in mappings:
            if (pages := mapping.within(tensor)) is not None:
                return pages
        if (mapping := file_mapping(tensor, path)) is None:
            return None
        mappings.append(mapping)
        return mapping.within(tensor)

    # `dtype` applies to the matrices that matmuls read; biases, layer norms and wpe stay float32 (mixed precision).
    def lin(prefix: str) -> Linear:
        weight = tensors[prefix + ".weight"]
        if panels and PanelMatrix.fits(weight.shape) and weight.is_contiguous():
            if dtype == torch.bfloat16:
                kept = PanelMatrix.of(weight, dtype, alloc=alloc)
                if not resident:
                    release_pages(weight, path)
                return Linear(kept, t(prefix + ".bias"))
            # float32: the file's matrix stays beside the panels (PanelMatrix.plain), so only where it is that very
            # matrix, in the mapping; decode reads the panels, and a GEMM's first call reads its pages back
            if dtype == weight.dtype == torch.float32 and (pages := in_file(weight)) is not None:
                kept = PanelMatrix.of(weight, dtype, keep=True, alloc=alloc)
                pages.release(weight)
                return Linear(kept, t(prefix + ".bias"))
        return Linear(t(prefix + ".weight", dtype), t(prefix + ".bias"))

    def ln(prefix: str) -> LayerNorm:
        return LayerNorm(t(prefix + ".weight"), t(prefix + ".bias"))

    blocks = tuple(
        Block(
            ln_1=ln(f"h.{i}.ln_1"),
            c_attn=lin(f"h.{i}.attn.c_attn"),
            attn_c_proj=lin(f"h.{i}.attn.c_proj"),
            ln_2=ln(f"h.{i}.ln_2"),
            c_fc=lin(f"h.{i}.mlp.c_fc"),
            mlp_c_proj=lin(f"h.{i}.mlp.c_proj"),
        )
        for i in range(config.n_layer)
    )
    wte = t("wte.weight", dtype)
    return GPT2Weights(wte=wte, wpe=t("wpe.weight"), blocks=blocks, ln_f=ln("ln_f"), head=wte)


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


GENERATION_CONFIG = {"bos_token_id": 50256, "eos_token_id": 50256}


def save_checkpoint(directory: str | Path, config: GPT2Config, weights: GPT2Weights, bpe_source: Path) -> None:
    """Write `weights` in the official layout: config.json, model.safetensors (Conv1D shapes, official names, no
    `transformer.` prefix, the tied head left out, as the Hub's files), generation_config.json, and the BPE files
    vocab.json and merges.txt copied from `bpe_source` (a checkpoint directory or the packaged files). Each file is
    written beside its destination and renamed over it, so a reader never sees half a file."""
    import json
    import shutil

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    def atomic(name: str, write) -> None:
        atomic_write(directory / name, write)

    def text(content: str):
        return lambda tmp: Path(tmp).write_text(content, encoding="utf-8")

    tensors = {name: t.detach().to(torch.float32).contiguous() for name, t in named_tensors(weights).items()}
    atomic(SAFETENSORS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic(CONFIG, text(json.dumps(config.to_json_dict(), indent=2) + "\n"))
    atomic("generation_config.json", text(json.dumps(GENERATION_CONFIG, indent=2) + "\n"))
    for (vocab, merges) in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (bpe_source / vocab).is_file() and (bpe_source / merges).is_file():
            atomic("vocab.json", lambda tmp: shutil.copyfile(bpe_source / vocab, tmp))
            atomic("merges.txt", lambda tmp: shutil.copyfile(bpe_source / merges, tmp))
            return
    raise WeightsError(f"{bpe_source}: no BPE files (vocab.json + merges.txt or encoder.json + vocab.bpe) to copy")


MADV_DONTNEED = 4  # Linux
CHECK_CHUNK = 1 << 20  # elements checked for NaN/Inf at a time


def release_pages(tensor: torch.Tensor, source: Path) -> bool:
    """Drop this process's resident pages under `tensor` if it lies in a memory mapping of the file `source`
    (a checkpoint read in place); True if it did. Such pages are clean copies of the file: a later access reads them
    again, so nothing is lost, and a quantized model does not keep the float32 weights it no longer reads in memory.
    The pages at either end may hold neighbouring tensors; they are file pages too and come back the same way.
    Anything not mapped from `source` (a copy, anonymous memory) is left alone, since dropping it would lose data.
    """
    pages = file_pages(tensor, source)
    return pages is not None and pages.release(tensor)


def file_pages(tensor: torch.Tensor, source: Path) -> FilePages | None:
    """The pages under `tensor` if it lies in a memory mapping of the file `source`, else None (read from
    /proc/self/maps, ~1 ms: check once, release often; file_mapping, then FilePages.within, for many tensors)."""
    mapping = file_mapping(tensor, source)
    return None if mapping is None else mapping.within(tensor)


def file_mapping(tensor: torch.Tensor, source: Path) -> FilePages | None:
    """The pages of the whole memory mapping of the file `source` that `tensor` lies in, else None."""
    if sys.platform != "linux" or tensor.numel() == 0 or not tensor.is_contiguous() or tensor.device.type != "cpu":
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    target = str(source.resolve())
    for line in maps:
        fields = line.split(maxsplit=5)
        low, high = (int(a, 16) for a in fields[0].split("-"))
        if low <= start and end <= high:
            if len(fields) < 6 or fields[5] != target:
                return None
            try:
                st = os.stat(target)
            except OSError:
                return None
            return FilePages(low, high, target, int(fields[2], 16), (st.st_dev, st.st_ino))
    return None


def release_heap() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; nothing elsewhere). Quantizing frees
    temporaries of a few MB between the quantized matrices it keeps: glibc's mmap threshold has by then grown past
    their size, so they live on the heap and, without this, stay resident (about 17 MB after an int4 load)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(ctypes.c_size_t(0))


def _check_tensor(path: Path, name: str, tensor: torch.Tensor, shape: tuple[int, ...],
                  release: Path | None = None) -> None:
    """Shape, dtype and finite values; with `release` (the mapped file), each chunk's pages are released once read."""
    if tuple(tensor.shape) != shape:
        raise WeightsError(f"{path}: tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}")
    if not tensor.dtype.is_floating_point:
        raise WeightsError(f"{path}: tensor {name} has dtype {tensor.dtype}, expected a floating-point dtype")
    # in chunks: isfinite over all of wte at once holds temporaries of its size (about 250 MB more at the peak)
    flat, finite = tensor.reshape(-1), True
    pages = None if release is None else file_pages(flat, release)
    for i in range(0, flat.numel(), CHECK_CHUNK):
        finite = finite and bool(torch.isfinite(flat[i : i + CHECK_CHUNK]).all())
        if pages is not None:
            pages.release(flat[i : i + CHECK_CHUNK])
    if not finite:
        bad = int((~torch.isfinite(tensor)).sum())
        raise WeightsError(f"{path}: tensor {name} holds {bad} NaN/Inf values, expected finite weights")


def parameter_count(config: GPT2Config) -> int:
    """Number of parameters (the tied head counted once)."""
    return sum(math.prod(shape) for shape in expected_shapes(config).values())
