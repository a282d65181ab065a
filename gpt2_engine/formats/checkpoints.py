"""Checkpoints of other GPT-2 trainers, read into the official names (and written back): nanoGPT's `ckpt.pt` and
llm.c's model file. A path is told apart by its content, so `GPT2.from_pretrained(PATH)` and every `--weights PATH`
take a Hugging Face folder or either file.

Each reader is a name table with strict accounting, as formats/hf.py: every tensor of the file is used once or
deliberately ignored (nanoGPT's causal-mask buffer `attn.bias`, the tied `lm_head.weight` once checked equal to wte,
llm.c's vocabulary padding rows), every shape is checked, and the result is what an official checkpoint would hold,
in Conv1D (in, out) layout: both projects store nn.Linear's (out, in), so their matrices are transposed here.

- nanoGPT (`train.py`): {"model": state_dict, "model_args": {n_layer, n_head, n_embd, block_size, bias, vocab_size,
  dropout}, "iter_num", "best_val_loss", "config", "optimizer"}, read with torch.load(weights_only=True) (no code
  runs). Keys carry `_orig_mod.` when the model was torch.compile'd. A model made with bias=False has no biases in
  its layer norms and projections: they read as zeros, which is exact (x * w + 0 is x * w to the bit). Its vocabulary
  is padded to 50,304: the rows past GPT-2's 50,257 are dropped, so sampling never draws them. Its GELU is the exact
  erf form (nn.GELU()), not GPT-2's tanh approximation: the config says activation_function "gelu" (measured against
  nanoGPT's own forward, the tanh form differs by ~1e-3 of the logits; the erf form agrees to float32 rounding).
  A character-level model (vocab_size 65 and a meta.pkl of its characters) is refused by name.
- llm.c (`train_gpt2.py`'s write_model): 256 int32 of header (magic 20240326, version 3 = float32 or 5 = bfloat16,
  max T, V, L, NH, C, padded V), then each kind of parameter for all layers at once: wte (Vp, C), wpe (T, C), ln_1
  weight and bias, c_attn weight (3C, C) and bias, attn c_proj, ln_2, c_fc, mlp c_proj, ln_f. Its GELU is GPT-2's.
- GGUF (llama.cpp's, through the `gguf` package, llama.cpp's own gguf-py): architecture "gpt2", llama.cpp's tensor
  names (token_embd, position_embd, blk.N.attn_norm|attn_qkv|attn_output|ffn_norm|ffn_up|ffn_down, output_norm,
  output), matrices as nn.Linear's (out, in), and the tokenizer's metadata (tokenizer.ggml.model "gpt2", pre
  "gpt-2", the byte-level tokens, their types, the merges), so that llama.cpp runs the file without its converter.
  Written as f32, f16 or q8_0 (2-D weights; norms, biases and position_embd stay f32, as llama.cpp's converter keeps
  them); read from f32, f16 and q8_0, dequantized to float32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.config import GPT2Config
from ..core.errors import WeightsError
from .files import what_is
from .gguf import read_gguf
from .hf import CONFIG, PYTORCH_BIN, SAFETENSORS, find_weights_file
from .llmc import LLMC_MAGIC, llmc_config, read_llmc, read_llmc_header
from .nanogpt import read_nanogpt

READ = "a Hugging Face directory, nanoGPT's ckpt.pt, llm.c's model .bin or a GGUF"


def checkpoint_kind(path: Path) -> str:
    """'hf' (a directory), 'nanogpt' (a torch checkpoint file), 'llmc' (llm.c's model file) or 'gguf', by content."""
    if not path.exists():
        raise WeightsError(f"{path}: no such checkpoint (expected {READ})")
    if path.is_dir():
        return "hf"
    if path.name in (SAFETENSORS, PYTORCH_BIN) or path.suffix == ".safetensors":  # a Hugging Face folder's file
        raise WeightsError(f"{path}: a weights file; expected a directory holding config.json and it (pass "
                           f"{path.parent})")
    if not path.is_file():
        raise WeightsError(f"{path}: {what_is(path)}, not a checkpoint (expected {READ})")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] == b"GGUF":
        return "gguf"
    if len(head) >= 4 and int.from_bytes(head[:4], "little") == LLMC_MAGIC:
        return "llmc"
    if head[:2] == b"PK" or head[:1] == b"\x80":  # torch.save's zip archive, or a legacy pickle
        return "nanogpt"
    what = f"a {path.suffix} file without its format's magic bytes; " if path.suffix in (".gguf", ".bin", ".pt") else ""
    raise WeightsError(f"{path}: not a checkpoint the engine reads ({what}expected {READ})")


def checkpoint_config(path: Path) -> GPT2Config:
    """The config of the checkpoint at `path`, whatever its format (for checks made before the weights load)."""
    kind = checkpoint_kind(path)
    if kind == "hf":
        find_weights_file(path)
        return GPT2Config.from_json(path / CONFIG)
    if kind == "llmc":
        return llmc_config(read_llmc_header(path), path)
    if kind == "nanogpt":
        return read_nanogpt(path)[0]
    return read_gguf(path)[0]


def read_checkpoint(path: Path) -> tuple[GPT2Config, dict[str, torch.Tensor]]:
    """A nanoGPT or llm.c checkpoint file as (config, official name -> tensor in the official layout)."""
    kind = checkpoint_kind(path)
    if kind == "nanogpt":
        return read_nanogpt(path)
    if kind == "llmc":
        return read_llmc(path)
    if kind == "gguf":
        return read_gguf(path)
    raise WeightsError(f"{path}: a directory; the Hugging Face loader reads it")

