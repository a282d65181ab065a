"""Load official GPT-2 checkpoints: a name table, strict accounting, one exception type.

The official files (`openai-community/gpt2` on the Hub) store every projection in Conv1D layout, weight shape
(in, out), so a projection is `x @ W + b`. We keep that layout: the safetensors file is memory-mapped and, in float32,
its tensors are used in place, never copied.
"""

from __future__ import annotations

import math
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open

from .config import GPT2Config
from .errors import WeightsError

DEFAULT_WEIGHTS = Path("weights")  # the project's default checkpoint directory
SAFETENSORS = "model.safetensors"
PYTORCH_BIN = "pytorch_model.bin"
CONFIG = "config.json"
# Checkpoint formats we recognise but do not read, so that the error can say what was found.
OTHER_FORMATS = ("tf_model.h5", "flax_model.msgpack", "model.ckpt.index", "64-8bits.tflite", "rust_model.ot")

# Buffers that transformers saves with the weights but that are not parameters: the causal mask.
IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


@dataclass(frozen=True)
class Int8Matrix:
    """A weight matrix stored as int8: W ~= values * scales, in the layout of the float matrix it replaces.

    scales broadcasts over `values`: (1, out) for a Conv1D (in, out) weight, one per output column; (V, 1) for the
    (V, C) output head, one per vocabulary row. Symmetric, so there is no zero point.
    """

    values: torch.Tensor  # int8, the shape of the float matrix
    scales: torch.Tensor  # float32, broadcastable to values


@dataclass(frozen=True)
class Linear:
    """A Conv1D projection: weight (in, out), bias (out,)."""

    weight: torch.Tensor | Int8Matrix
    bias: torch.Tensor


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
        ws, bs = split_qkv(self.c_attn.weight), split_qkv(self.c_attn.bias)
        return Linear(ws[0], bs[0]), Linear(ws[1], bs[1]), Linear(ws[2], bs[2])


@dataclass(frozen=True)
class GPT2Weights:
    wte: torch.Tensor  # (V, C) token embedding
    wpe: torch.Tensor  # (n_positions, C)
    blocks: tuple[Block, ...]
    ln_f: LayerNorm
    head: torch.Tensor | Int8Matrix  # (V, C): the output head is wte itself (GPT-2 ties them), or its int8 copy


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


def find_weights_file(directory: Path) -> Path:
    """The checkpoint file to read in `directory`: model.safetensors, else pytorch_model.bin."""
    if not directory.exists():
        raise WeightsError(f"{directory}: weights directory does not exist (run `make weights` or copy the official files there)")
    if not directory.is_dir():
        raise WeightsError(f"{directory}: expected a directory holding {CONFIG} and {SAFETENSORS} or {PYTORCH_BIN}, found a file")
    for name in (SAFETENSORS, PYTORCH_BIN):
        if (directory / name).is_file():
            return directory / name
    others = [name for name in OTHER_FORMATS if (directory / name).exists()]
    if others:
        raise WeightsError(f"{directory}: unsupported weights format {others[0]}; expected {SAFETENSORS} or {PYTORCH_BIN}")
    raise WeightsError(f"{directory}: no {SAFETENSORS} or {PYTORCH_BIN} found (run `make weights` or copy the official files there)")


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


def load_weights(directory: str | Path, config: GPT2Config, dtype: torch.dtype = torch.float32) -> GPT2Weights:
    """Read and check every tensor of the checkpoint in `directory`; raise WeightsError on any mismatch.

    `dtype` is that of the weight matrices (and wte); everything else stays float32.
    """
    path = find_weights_file(Path(directory))
    raw = read_tensors(path)
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
        _check_tensor(path, name, tensors[name], shape)
    if lm_head is not None:
        _check_tensor(path, "lm_head.weight", lm_head, expected["wte.weight"])
        if not torch.equal(lm_head, tensors["wte.weight"]):
            diff = (lm_head.float() - tensors["wte.weight"].float()).abs().max().item()
            raise WeightsError(f"{path}: lm_head.weight differs from wte.weight (max |diff| {diff:.3g}); GPT-2 ties them")

    def t(name: str, target: torch.dtype = torch.float32) -> torch.Tensor:
        tensor = tensors[name]
        return tensor if tensor.dtype == target else tensor.to(target)

    # `dtype` applies to the matrices that matmuls read; biases, layer norms and wpe stay float32 (mixed precision)
    def lin(prefix: str) -> Linear:
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


def _check_tensor(path: Path, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise WeightsError(f"{path}: tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}")
    if not tensor.dtype.is_floating_point:
        raise WeightsError(f"{path}: tensor {name} has dtype {tensor.dtype}, expected a floating-point dtype")
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise WeightsError(f"{path}: tensor {name} holds {bad} NaN/Inf values, expected finite weights")


def parameter_count(config: GPT2Config) -> int:
    """Number of parameters (the tied head counted once)."""
    return sum(math.prod(shape) for shape in expected_shapes(config).values())
