"""llm.c's model file, read into the official names and written back."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..core.config import GPT2_VOCAB, GPT2Config, check_size
from ..core.errors import WeightsError
from ..core.weights import MATRICES
from .files import atomic_write

LLMC_MAGIC = 20240326


LLMC_VERSIONS = {3: torch.float32, 5: torch.bfloat16}


LLMC_HEADER = 256  # int32 values


LLMC_PAD = 128  # llm.c pads the vocabulary to a multiple of 128
# The most padding rows read: llm.c writes fewer than LLMC_PAD; a header that declares more would have the whole
# file mapped for rows nobody reads (2^27 rows: a 32 GB mapping the kernel refuses).
LLMC_PAD_SLACK = 1024


# per layer, in llm.c's order: (official name, shape as llm.c stores it, transposed from Conv1D's)
LLMC_LAYER = (("ln_1.weight", "C"), ("ln_1.bias", "C"), ("attn.c_attn.weight", "3C,C"), ("attn.c_attn.bias", "3C"),
              ("attn.c_proj.weight", "C,C"), ("attn.c_proj.bias", "C"), ("ln_2.weight", "C"), ("ln_2.bias", "C"),
              ("mlp.c_fc.weight", "F,C"), ("mlp.c_fc.bias", "F"), ("mlp.c_proj.weight", "C,F"), ("mlp.c_proj.bias", "C"))


def read_llmc_header(path: Path) -> np.ndarray:
    """The 256 int32 of an llm.c model file's header, checked."""
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER)
    if header.shape[0] != LLMC_HEADER or header[0] != LLMC_MAGIC:
        raise WeightsError(f"{path}: not an llm.c model file (expected magic {LLMC_MAGIC} in a 1024-byte header)")
    if int(header[1]) not in LLMC_VERSIONS:
        raise WeightsError(f"{path}: llm.c model version {int(header[1])} is not read (expected 3, float32, or 5, "
                           f"bfloat16)")
    return header


def llmc_config(header: np.ndarray, path: Path) -> GPT2Config:
    max_t, vocab, layers, heads, channels, padded = (int(x) for x in header[2:8])
    if vocab != GPT2_VOCAB or padded < vocab:
        raise WeightsError(f"{path}: vocabulary {vocab} (padded {padded}); the engine runs GPT-2's 50257 tokens")
    if padded > vocab + LLMC_PAD_SLACK:
        rounded = -(-vocab // LLMC_PAD) * LLMC_PAD
        raise WeightsError(f"{path}: padded vocabulary {padded:,}; llm.c pads {vocab:,} to a multiple of {LLMC_PAD} "
                           f"({rounded:,}), expected at most {vocab + LLMC_PAD_SLACK:,}")
    try:
        return GPT2Config(vocab_size=vocab, n_positions=max_t, n_embd=channels, n_layer=layers, n_head=heads)
    except ValueError as e:
        raise WeightsError(f"{path}: {e}") from None


def llmc_layout(config: GPT2Config, padded: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every array of an llm.c model file after its header, in order: (name, shape as stored). Per-layer arrays are
    named 'h.*.' + the official name, [L, *shape]."""
    C, F, L = config.n_embd, config.mlp_width, config.n_layer
    dims = {"C": C, "3C": 3 * C, "F": F}
    out = [("wte.weight", (padded, C)), ("wpe.weight", (config.n_positions, C))]
    out += [(f"h.*.{name}", (L, *(dims[d] for d in shape.split(",")))) for name, shape in LLMC_LAYER]
    return out + [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]


def read_llmc(path: Path) -> tuple[GPT2Config, dict[str, torch.Tensor]]:
    """llm.c's model file (see the module docstring), memory-mapped: float32 vectors and wte are used in place; the
    matrices are copied once, transposed into Conv1D's layout (bfloat16 files: everything, converted to float32)."""
    header = read_llmc_header(path)
    config = llmc_config(header, path)
    dtype = LLMC_VERSIONS[int(header[1])]
    layout = llmc_layout(config, int(header[7]))
    size = 2 if dtype == torch.bfloat16 else 4
    need = LLMC_HEADER * 4 + size * sum(math.prod(s) for _, s in layout)
    found = path.stat().st_size
    if found != need:
        raise WeightsError(f"{path}: {found} bytes, expected {need} for an llm.c model with {config.n_layer} layers, "
                           f"{config.n_embd} channels ({'truncated' if found < need else 'bytes left over'})")
    check_size(config, path)
    # copy-on-write: pages are shared with the page cache, and torch gets the writable array it expects (a read-only
    # map would fault on an in-place write, as finetune's updates are); the map is the file, bounded by check_size
    raw = torch.from_numpy(np.memmap(path, dtype="<i2" if size == 2 else "<f4", mode="c", offset=LLMC_HEADER * 4))
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in layout:
        n = math.prod(shape)
        t = raw[offset : offset + n].view(shape)
        offset += n
        t = t.view(torch.bfloat16).float() if size == 2 else t
        if name.startswith("h.*."):
            part = name[4:]
            for i in range(config.n_layer):
                out[f"h.{i}.{part}"] = (t[i].t() if part in MATRICES else t[i]).contiguous()
        else:
            out[name] = t[:GPT2_VOCAB].contiguous() if name == "wte.weight" else t
    return config, out


def write_llmc(path: Path, config: GPT2Config, tensors: dict[str, torch.Tensor], dtype: str = "float32") -> None:
    """An llm.c model file of these official-named tensors (Conv1D layout), as train_gpt2.py's write_model writes
    one: the vocabulary padded with zero rows to a multiple of 128; `dtype` float32 (version 3) or bfloat16 (5).
    Written beside `path` and renamed over it."""
    if config.exact_gelu:
        raise WeightsError(f"{path}: llm.c computes GPT-2's tanh GELU, and this model uses the exact erf form "
                           f"(a nanoGPT model): its llm.c file would compute another function")
    if config.vocab_size != GPT2_VOCAB:
        raise WeightsError(f"{path}: llm.c's files hold GPT-2's 50257-token vocabulary, this model has "
                           f"{config.vocab_size}")
    version = {"float32": 3, "bfloat16": 5}.get(dtype)
    if version is None:
        raise WeightsError(f"llm.c model files are float32 or bfloat16, not {dtype}")
    padded = -(-config.vocab_size // LLMC_PAD) * LLMC_PAD
    header = np.zeros(LLMC_HEADER, dtype="<i4")
    header[:8] = [LLMC_MAGIC, version, config.n_positions, config.vocab_size, config.n_layer, config.n_head,
                  config.n_embd, padded]

    def stored(name: str) -> torch.Tensor:
        if name == "wte.weight":
            wte = tensors[name].float()
            return torch.cat([wte, wte.new_zeros(padded - wte.shape[0], wte.shape[1])])
        if name.startswith("h.*."):
            part = name[4:]
            return torch.stack([tensors[f"h.{i}.{part}"].float().t() if part in MATRICES
                                else tensors[f"h.{i}.{part}"].float() for i in range(config.n_layer)])
        return tensors[name].float()

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            for name, shape in llmc_layout(config, padded):
                t = stored(name).contiguous()
                assert tuple(t.shape) == shape, (name, t.shape, shape)
                data = t.to(torch.bfloat16).view(torch.int16) if version == 5 else t
                f.write(data.numpy().tobytes())

    atomic_write(path, write)

