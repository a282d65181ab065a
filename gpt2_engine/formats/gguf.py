"""GGUF (llama.cpp's format), read into the official names and written back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.config import GPT2_VOCAB, GPT2Config
from ..core.errors import WeightsError
from ..core.tokenizer import load_tokenizer
from ..core.weights import MATRICES, expected_shapes
from .files import atomic_write

GGUF_TYPES = ("f32", "f16", "q8_0")


GGUF_LAYER = {"ln_1.weight": "attn_norm.weight", "ln_1.bias": "attn_norm.bias", "attn.c_attn.weight": "attn_qkv.weight",
              "attn.c_attn.bias": "attn_qkv.bias", "attn.c_proj.weight": "attn_output.weight",
              "attn.c_proj.bias": "attn_output.bias", "ln_2.weight": "ffn_norm.weight", "ln_2.bias": "ffn_norm.bias",
              "mlp.c_fc.weight": "ffn_up.weight", "mlp.c_fc.bias": "ffn_up.bias", "mlp.c_proj.weight": "ffn_down.weight",
              "mlp.c_proj.bias": "ffn_down.bias"}


GGUF_GLOBAL = {"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight", "ln_f.weight": "output_norm.weight",
               "ln_f.bias": "output_norm.bias"}


def gguf_module():
    try:
        import gguf
    except ImportError:
        raise WeightsError("GGUF needs the gguf package (llama.cpp's gguf-py): pip install 'gpt2-engine[gguf]'") from None
    return gguf


def gguf_names(config: GPT2Config) -> dict[str, str]:
    """Official name -> llama.cpp's GGUF tensor name."""
    names = dict(GGUF_GLOBAL)
    for i in range(config.n_layer):
        names.update({f"h.{i}.{k}": f"blk.{i}.{v}" for k, v in GGUF_LAYER.items()})
    return names


def bpe_tables(source: Path) -> tuple[list[str], list[str]]:
    """(the byte-level token strings in id order, the merges) of the BPE files in `source` (vocab.json + merges.txt,
    or OpenAI's encoder.json + vocab.bpe)."""
    import json

    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (source / vocab).is_file() and (source / merges).is_file():
            ids = json.loads((source / vocab).read_text(encoding="utf-8"))
            tokens = [""] * len(ids)
            for text, i in ids.items():
                tokens[i] = text
            lines = (source / merges).read_text(encoding="utf-8").splitlines()
            return tokens, [m for m in lines if m and not m.startswith("#version")]
    raise WeightsError(f"{source}: no BPE files (vocab.json + merges.txt or encoder.json + vocab.bpe)")


def write_gguf(path: Path, config: GPT2Config, tensors: dict[str, torch.Tensor], bpe_source: Path,
               qtype: str = "f32", eot: int = GPT2_VOCAB - 1) -> None:
    """A GGUF file that llama.cpp runs (see the module docstring), written beside `path` and renamed over it."""
    gguf = gguf_module()
    if config.exact_gelu:
        raise WeightsError(f"{path}: llama.cpp's gpt2 computes the tanh GELU, and this model uses the exact erf form "
                           f"(a nanoGPT model): its GGUF would compute another function")
    if qtype not in GGUF_TYPES:
        raise WeightsError(f"GGUF types are {', '.join(GGUF_TYPES)}, not {qtype}")
    tokens, merges = bpe_tables(bpe_source)
    if len(tokens) != config.vocab_size:
        raise WeightsError(f"{bpe_source}: {len(tokens)} BPE tokens, the model has {config.vocab_size}")
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]

    def stored(name: str) -> np.ndarray:
        t = tensors[name].float()
        t = t.t() if any(name.endswith(m) for m in MATRICES) else t  # Conv1D (in, out) -> (out, in)
        return t.contiguous().numpy()

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(str(tmp), "gpt2")
        w.add_name("gpt2-engine")
        w.add_context_length(config.n_positions)
        w.add_embedding_length(config.n_embd)
        w.add_feed_forward_length(config.mlp_width)
        w.add_block_count(config.n_layer)
        w.add_head_count(config.n_head)
        w.add_layer_norm_eps(config.layer_norm_epsilon)
        w.add_file_type(file_type)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types([gguf.TokenType.CONTROL if i == eot else gguf.TokenType.NORMAL for i in range(len(tokens))])
        w.add_token_merges(merges)
        w.add_bos_token_id(eot)
        w.add_eos_token_id(eot)
        w.add_add_bos_token(False)  # GPT-2 prepends nothing to a prompt
        names = gguf_names(config)
        for name, target in [*names.items(), ("wte.weight", "output.weight")]:  # the head: wte, tied
            data = stored(name)
            if data.ndim == 1 or qtype == "f32" or name == "wpe.weight":
                w.add_tensor(target, data)
            elif qtype == "f16":
                w.add_tensor(target, data.astype(np.float16))
            else:
                w.add_tensor(target, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                             raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    atomic_write(path, write)


def read_gguf(path: Path) -> tuple[GPT2Config, dict[str, torch.Tensor]]:
    """A GPT-2 GGUF file (f32, f16 or q8_0 tensors, dequantized to float32) by the official names, strictly
    accounted: every tensor used once, `output.weight` checked equal to token_embd (GPT-2 ties them)."""
    gguf = gguf_module()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt file
        raise WeightsError(f"{path}: not a readable GGUF file ({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None

    def field(key: str) -> Any:
        f = reader.get_field(key)
        if f is None:
            raise WeightsError(f"{path}: no {key} (expected a GPT-2 GGUF as llama.cpp's converter writes one)")
        return f.contents()

    arch = field("general.architecture")
    if arch != "gpt2":
        raise WeightsError(f"{path}: a GGUF of architecture {arch!r}; the engine runs 'gpt2'")
    if field("tokenizer.ggml.model") != "gpt2":
        raise WeightsError(f"{path}: tokenizer.ggml.model is {field('tokenizer.ggml.model')!r}, expected GPT-2's 'gpt2' BPE")
    found = {t.name: t for t in reader.tensors}
    vocab = int(found["token_embd.weight"].shape[-1]) if "token_embd.weight" in found else 0
    try:
        config = GPT2Config(vocab_size=vocab or GPT2_VOCAB, n_positions=int(field("gpt2.context_length")),
                            n_embd=int(field("gpt2.embedding_length")), n_layer=int(field("gpt2.block_count")),
                            n_head=int(field("gpt2.attention.head_count")),
                            n_inner=int(field("gpt2.feed_forward_length")),
                            # stored as float32: 1e-5 reads back as 9.99999975e-06, so the 7 digits a float32 holds
                            layer_norm_epsilon=float(f"{float(field('gpt2.attention.layer_norm_epsilon')):.7g}"))
    except ValueError as e:
        raise WeightsError(f"{path}: {e}") from None
    if config.n_inner == 4 * config.n_embd:
        config = replace(config, n_inner=None)  # GPT-2's own width, as an official config.json leaves it
    if len(field("tokenizer.ggml.tokens")) != config.vocab_size or config.vocab_size != GPT2_VOCAB:
        raise WeightsError(f"{path}: a vocabulary of {config.vocab_size} tokens; the engine runs GPT-2's 50257")
    if list(field("tokenizer.ggml.tokens")) != bpe_tables(load_tokenizer(None).source)[0]:
        raise WeightsError(f"{path}: its tokens are not GPT-2's BPE vocabulary; the engine runs GPT-2's tokenizer")
    supported = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0}
    expected = expected_shapes(config)
    out: dict[str, torch.Tensor] = {}

    def take(target: str) -> torch.Tensor:
        t = found.pop(target, None)
        if t is None:
            raise WeightsError(f"{path}: missing tensor {target}")
        if t.tensor_type not in supported:
            raise WeightsError(f"{path}: {target} is {t.tensor_type.name}; the engine reads F32, F16 and Q8_0 GGUFs")
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(tuple(int(d) for d in reversed(t.shape)))

    for name, target in gguf_names(config).items():
        t = take(target)
        t = t.t() if any(name.endswith(m) for m in MATRICES) else t
        if tuple(t.shape) != expected[name]:
            raise WeightsError(f"{path}: {target} has shape {list(t.shape)}, expected {list(expected[name])} in the "
                               f"official layout")
        out[name] = t.contiguous()
    if "output.weight" in found and not torch.equal(take("output.weight"), out["wte.weight"]):
        raise WeightsError(f"{path}: output.weight differs from token_embd.weight; GPT-2 ties them")
    if found:
        raise WeightsError(f"{path}: unexpected tensor {sorted(found)[0]} (not part of GPT-2 with n_layer={config.n_layer})")
    return config, out

