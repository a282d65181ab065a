"""Checkpoints of other GPT-2 trainers, read into the official names (and written back): nanoGPT's `ckpt.pt` and
llm.c's model file. A path is told apart by its content, so `GPT2.from_pretrained(PATH)` and every `--weights PATH`
take a Hugging Face folder or either file.

Each reader is a name table with strict accounting, as weights.py's loader: every tensor of the file is used once or
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

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import GPT2Config
from .errors import WeightsError
from .files import atomic_write
from .tokenizer import load_tokenizer
from .weights import CONFIG, PYTORCH_BIN, SAFETENSORS, expected_shapes, find_weights_file

GPT2_VOCAB = 50257
LLMC_MAGIC = 20240326
LLMC_VERSIONS = {3: torch.float32, 5: torch.bfloat16}
LLMC_HEADER = 256  # int32 values
LLMC_PAD = 128  # llm.c pads the vocabulary to a multiple of 128
NANOGPT_PREFIX = "transformer."
COMPILED_PREFIX = "_orig_mod."  # what torch.compile's wrapper adds to every key
# per layer, in llm.c's order: (official name, shape as llm.c stores it, transposed from Conv1D's)
LLMC_LAYER = (("ln_1.weight", "C"), ("ln_1.bias", "C"), ("attn.c_attn.weight", "3C,C"), ("attn.c_attn.bias", "3C"),
              ("attn.c_proj.weight", "C,C"), ("attn.c_proj.bias", "C"), ("ln_2.weight", "C"), ("ln_2.bias", "C"),
              ("mlp.c_fc.weight", "F,C"), ("mlp.c_fc.bias", "F"), ("mlp.c_proj.weight", "C,F"), ("mlp.c_proj.bias", "C"))
MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def checkpoint_kind(path: Path) -> str:
    """'hf' (a directory), 'nanogpt' (a torch checkpoint file), 'llmc' (llm.c's model file) or 'gguf', by content."""
    if not path.exists():
        raise WeightsError(f"{path}: no such checkpoint (expected a Hugging Face directory, a nanoGPT ckpt.pt or an "
                           f"llm.c model .bin)")
    if path.is_dir():
        return "hf"
    if path.name in (SAFETENSORS, PYTORCH_BIN) or path.suffix == ".safetensors":  # a Hugging Face folder's file
        raise WeightsError(f"{path}: a weights file; expected a directory holding config.json and it (pass "
                           f"{path.parent})")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] == b"GGUF":
        return "gguf"
    if len(head) >= 4 and int.from_bytes(head[:4], "little") == LLMC_MAGIC:
        return "llmc"
    if head[:2] == b"PK" or head[:1] == b"\x80":  # torch.save's zip archive, or a legacy pickle
        return "nanogpt"
    raise WeightsError(f"{path}: not a checkpoint the engine reads (expected a Hugging Face directory, nanoGPT's "
                       f"ckpt.pt or llm.c's model .bin)")


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


# --- nanoGPT ----------------------------------------------------------------------------------------------------------


def read_nanogpt(path: Path) -> tuple[GPT2Config, dict[str, torch.Tensor]]:
    """nanoGPT's ckpt.pt (see the module docstring)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - an unreadable file, or one whose pickle would run code
        raise WeightsError(f"{path}: not a readable nanoGPT checkpoint ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:200]})") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict) or not isinstance(ckpt.get("model_args"), dict):
        raise WeightsError(f"{path}: expected nanoGPT's checkpoint (a dict with 'model' and 'model_args', as its "
                           f"train.py saves), found {type(ckpt).__name__} with keys {sorted(ckpt)[:6] if isinstance(ckpt, dict) else '-'}")
    args = ckpt["model_args"]
    missing = [k for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size") if k not in args]
    if missing:
        raise WeightsError(f"{path}: model_args has no {missing[0]} (expected nanoGPT's GPTConfig fields)")
    vocab = args["vocab_size"]
    if vocab < GPT2_VOCAB:
        meta = path.parent / "meta.pkl"
        raise WeightsError(f"{path}: a vocabulary of {vocab} tokens{' (with ' + str(meta) + ')' if meta.exists() else ''} "
                           f"is a character-level model; the engine runs GPT-2's BPE (vocab_size 50257, or 50304 "
                           f"padded)")
    try:
        config = GPT2Config(vocab_size=GPT2_VOCAB, n_positions=args["block_size"], n_embd=args["n_embd"],
                            n_layer=args["n_layer"], n_head=args["n_head"], activation_function="gelu")
    except ValueError as e:
        raise WeightsError(f"{path}: {e}") from None
    bias = bool(args.get("bias", True))
    state = {k.removeprefix(COMPILED_PREFIX): v for k, v in ckpt["model"].items()}
    expected = expected_shapes(config)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in state:
            raise WeightsError(f"{path}: missing tensor {key} (nanoGPT's model with n_layer={config.n_layer}, "
                               f"bias={bias})")
        used.add(key)
        t = state[key]
        if not isinstance(t, torch.Tensor):
            raise WeightsError(f"{path}: {key} is a {type(t).__name__}, not a tensor")
        return t

    for name, shape in expected.items():
        key = NANOGPT_PREFIX + name
        if name.endswith(".bias") and not bias:
            out[name] = torch.zeros(shape)  # a bias-free layer is one with a zero bias, to the bit
            continue
        t = take(key)
        if name == "wte.weight":
            if t.dim() != 2 or t.shape[0] != vocab or t.shape[1] != config.n_embd:
                raise WeightsError(f"{path}: {key} has shape {list(t.shape)}, expected [{vocab}, {config.n_embd}]")
            t = t[:GPT2_VOCAB]  # the padding rows: never a token, never sampled
        elif any(name.endswith(m) for m in MATRICES):
            t = t.t()  # nn.Linear's (out, in) -> Conv1D's (in, out)
        if tuple(t.shape) != shape:
            raise WeightsError(f"{path}: {key} has shape {list(t.shape)}, expected {list(shape)} in the official "
                               f"layout")
        out[name] = t.float().contiguous()
    head = take("lm_head.weight")
    if not torch.equal(head, state[NANOGPT_PREFIX + "wte.weight"]):
        raise WeightsError(f"{path}: lm_head.weight differs from transformer.wte.weight; nanoGPT ties them")
    ignored = {k for k in state if k.endswith(".attn.bias") and k.startswith(NANOGPT_PREFIX + "h.")}  # causal masks
    if unexpected := sorted(set(state) - used - ignored):
        raise WeightsError(f"{path}: unexpected tensor {unexpected[0]}"
                           f"{f' and {len(unexpected) - 1} more' if len(unexpected) > 1 else ''} (not part of "
                           f"nanoGPT's GPT with n_layer={config.n_layer}, bias={bias})")
    return config, out


# --- llm.c ------------------------------------------------------------------------------------------------------------


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
    """llm.c's model file (see the module docstring), memory-mapped."""
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
    raw = np.memmap(path, dtype="<i2" if size == 2 else "<f4", mode="r", offset=LLMC_HEADER * 4)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in layout:
        n = math.prod(shape)
        t = torch.from_numpy(np.array(raw[offset : offset + n])).view(shape)
        offset += n
        t = (t.view(torch.bfloat16) if size == 2 else t).float()
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


# --- GGUF -------------------------------------------------------------------------------------------------------------

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
