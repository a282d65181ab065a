"""GGUF (llama.cpp's format), read into the official names and written back."""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.config import GPT2_VOCAB, JSON_BYTES, GPT2Config, check_size, read_bytes
from ..core.errors import InputError, WeightsError, one_line
from ..core.tokenizer import load_tokenizer
from ..core.weights import MATRICES, expected_shapes
from .files import atomic_write
from .hf import check_values

GGUF_TYPES = ("f32", "f16", "q8_0")


GGUF_LAYER = {"ln_1.weight": "attn_norm.weight", "ln_1.bias": "attn_norm.bias", "attn.c_attn.weight": "attn_qkv.weight",
              "attn.c_attn.bias": "attn_qkv.bias", "attn.c_proj.weight": "attn_output.weight",
              "attn.c_proj.bias": "attn_output.bias", "ln_2.weight": "ffn_norm.weight", "ln_2.bias": "ffn_norm.bias",
              "mlp.c_fc.weight": "ffn_up.weight", "mlp.c_fc.bias": "ffn_up.bias", "mlp.c_proj.weight": "ffn_down.weight",
              "mlp.c_proj.bias": "ffn_down.bias"}


GGUF_GLOBAL = {"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight", "ln_f.weight": "output_norm.weight",
               "ln_f.bias": "output_norm.bias"}


GGUF_SEEKS = "gguf-py's writer asks the file for its position to align the tensor data"


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
            try:
                ids = json.loads(read_bytes(source / vocab, JSON_BYTES, "GPT-2's BPE vocabulary file", regular=True))
                lines = read_bytes(source / merges, JSON_BYTES, "GPT-2's BPE merges file", regular=True).decode("utf-8").splitlines()
            except InputError as e:
                raise WeightsError(str(e)) from None
            tokens = [""] * len(ids)
            for text, i in ids.items():
                tokens[i] = text
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

    atomic_write(path, write, seeks=GGUF_SEEKS)


# The bounded walk (check_gguf) and the metadata the reader takes.
GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
GGUF_STRING, GGUF_ARRAY, GGUF_UINT32 = 8, 9, 4
GGUF_INTEGERS, GGUF_FLOATS = (0, 1, 2, 3, 4, 5, 10, 11), (6, 12)
GGUF_VERSIONS = (2, 3)  # gguf-py's and llama.cpp's (version 1 is no longer read by either)
GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS
GGUF_MAX_VALUES = 1 << 18  # array values in a file's metadata; a GPT-2's hold 150,514 (tokens, their types, merges), and
# gguf-py makes two numpy views of each string (a million empty strings, 8 MB of file, took 1.9 GB and 18 s)
GGUF_MAX_TENSORS = 1 << 16  # GPT-2 xl has 582
GGUF_MAX_KVS = 1 << 12  # the engine writes 17; gguf-py builds a field of numpy views for each, ~1.5 KB apiece
GGUF_DEFAULT_ALIGNMENT = 32

# key -> (what it means to the engine, the GGUF value types it may have; an array's are its element types)
GGUF_FIELDS = {"general.architecture": ("the architecture", (GGUF_STRING,)),
               "tokenizer.ggml.model": ("the tokenizer", (GGUF_STRING,)),
               "tokenizer.ggml.tokens": ("the vocabulary", (GGUF_ARRAY, GGUF_STRING)),
               "gpt2.context_length": ("n_positions", GGUF_INTEGERS),
               "gpt2.embedding_length": ("n_embd", GGUF_INTEGERS),
               "gpt2.block_count": ("n_layer", GGUF_INTEGERS),
               "gpt2.attention.head_count": ("n_head", GGUF_INTEGERS),
               "gpt2.feed_forward_length": ("n_inner", GGUF_INTEGERS),
               "gpt2.attention.layer_norm_epsilon": ("layer_norm_epsilon", GGUF_FLOATS)}


class GGUFWalk:
    """A bounded walk over a GGUF file's header, metadata and tensor infos, each count and length checked against the
    bytes left before it is trusted. gguf-py's GGUFReader trusts them: it makes a numpy view per array value and loops
    over the declared count, so a 133-byte file declaring 2^40 values takes memory until the machine runs out."""

    def __init__(self, path: Path, data: memoryview) -> None:
        self.path, self.data, self.pos, self.order = path, data, 0, "<"
        self.values = 0  # array values so far
        self.alignment = GGUF_DEFAULT_ALIGNMENT

    def fail(self, what: str) -> WeightsError:
        return WeightsError(f"{self.path}: not a GGUF the engine reads: {what}")

    def take(self, n: int, what: str) -> int:
        """The offset of the next `n` bytes, which must lie in the file."""
        left = len(self.data) - self.pos
        if n > left:
            raise self.fail(f"{what} at byte {self.pos:,} needs {n:,} bytes, and {left:,} are left")
        self.pos += n
        return self.pos - n

    def number(self, fmt: str, what: str) -> int:
        return struct.unpack_from(self.order + fmt, self.data, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.number("Q", f"the length of {what}")
        start = self.take(n, what)
        try:
            return bytes(self.data[start : self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {start:,} is not UTF-8") from None

    def count(self, n: int, least: int, what: str) -> None:
        """`n` items of at least `least` bytes each must fit in what is left of the file."""
        left = len(self.data) - self.pos
        if n * least > left:
            raise self.fail(f"{what} declares {n:,} of at least {least} bytes each, and {left:,} bytes are left")

    def header(self) -> tuple[int, int]:
        """(tensor count, key-value count), after the magic and a version gguf-py reads."""
        start = self.take(4, "the magic")
        if bytes(self.data[start : start + 4]) != b"GGUF":
            raise self.fail("no GGUF magic")
        version = self.number("I", "the version")
        if version & 0xFFFF == 0:  # written on a big-endian machine, as gguf-py and llama.cpp detect it
            self.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in GGUF_VERSIONS:
            raise self.fail(f"version {version} (gguf-py reads {' and '.join(map(str, GGUF_VERSIONS))})")
        tensors, kvs = self.number("Q", "the tensor count"), self.number("Q", "the key-value count")
        if tensors > GGUF_MAX_TENSORS:
            raise self.fail(f"{tensors:,} tensors (a GPT-2 has at most {GGUF_MAX_TENSORS:,})")
        self.count(kvs, 13, "the key-value count")  # a key's length, a type and one byte
        if kvs > GGUF_MAX_KVS:
            raise self.fail(f"{kvs:,} key-values (a GPT-2's GGUF has about 20; the engine reads at most "
                            f"{GGUF_MAX_KVS:,})")
        return tensors, kvs

    def value(self, kind: int, key: str) -> None:
        """Step over one value of GGUF type `kind` (the key's, or its array's)."""
        if kind == GGUF_STRING:  # stepped over: the reader decodes the strings the engine reads
            self.take(self.number("Q", f"the length of a string of {key}"), f"a string of {key}")
        elif kind in GGUF_SCALAR_BYTES:
            self.take(GGUF_SCALAR_BYTES[kind], f"the value of {key}")
        elif kind == GGUF_ARRAY:
            raise self.fail(f"{key} is an array of arrays (llama.cpp's reader refuses them too)")
        else:
            raise self.fail(f"{key} has GGUF value type {kind}, which is none of GGUF's (0 to 12)")

    def array(self, key: str) -> None:
        kind, n = self.number("I", f"the type of {key}'s values"), self.number("Q", f"the length of {key}")
        self.count(n, 8 if kind == GGUF_STRING else GGUF_SCALAR_BYTES.get(kind, 1), f"the array {key}")
        self.values += n
        if self.values > GGUF_MAX_VALUES:
            raise self.fail(f"{self.values:,} array values in its metadata at {key} (a GPT-2's metadata holds "
                            f"150,514; the engine reads at most {GGUF_MAX_VALUES:,})")
        if kind in GGUF_SCALAR_BYTES:  # a block of fixed-size values: stepped over at once
            self.take(n * GGUF_SCALAR_BYTES[kind], f"the values of {key}")
            return
        for _ in range(n):
            self.value(kind, key)

    def key_value(self) -> None:
        key = self.string("a key")
        kind = self.number("I", f"the type of {key}")
        if kind == GGUF_ARRAY:
            self.array(key)
        elif key == "general.alignment" and kind == GGUF_UINT32:
            self.alignment = self.number("I", key)
        else:
            self.value(kind, key)

    def tensor_info(self, sizes: dict) -> tuple[str, int, int]:
        """(name, data offset, data bytes) of the next tensor info."""
        name = self.string("a tensor name")
        n_dims = self.number("I", f"the dimension count of {name}")
        if not 1 <= n_dims <= GGUF_MAX_DIMS:
            raise self.fail(f"tensor {name} has {n_dims} dimensions (expected 1 to {GGUF_MAX_DIMS})")
        dims = [self.number("Q", f"the shape of {name}") for _ in range(n_dims)]
        kind = self.number("I", f"the type of {name}")
        if kind not in sizes:
            raise self.fail(f"tensor {name} has ggml type {kind}, which gguf-py does not know")
        block, size = sizes[kind]
        if dims[0] % block:
            raise self.fail(f"tensor {name}'s rows of {dims[0]} values are not whole blocks of {block}")
        return name, self.number("Q", f"the data offset of {name}"), math.prod(dims) // block * size

    def walk(self, sizes: dict) -> None:
        """Check the whole layout: every count, length and tensor's data within the file."""
        tensors, kvs = self.header()
        for _ in range(kvs):
            self.key_value()
        self.count(tensors, 32, "the tensor count")  # a name's length, a dimension count, one dimension, a type, an offset
        infos = [self.tensor_info(sizes) for _ in range(tensors)]
        if self.alignment == 0 or self.alignment & (self.alignment - 1):
            raise self.fail(f"general.alignment {self.alignment} is not a power of two")
        start = -(-self.pos // self.alignment) * self.alignment
        for name, offset, n in infos:
            if start + offset + n > len(self.data):
                raise self.fail(f"tensor {name}'s {n:,} bytes at byte {start + offset:,} run past the end of the "
                                f"file ({len(self.data):,} bytes)")


def check_gguf(path: Path, sizes: dict) -> None:
    """Refuse, before gguf-py reads it, a GGUF whose counts or lengths do not fit in the file (see GGUFWalk);
    `sizes`: gguf-py's GGML_QUANT_SIZES, ggml type -> (block values, block bytes)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise WeightsError(f"{path}: not a GGUF the engine reads: an empty file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            data = memoryview(m)
            try:
                GGUFWalk(path, data).walk(sizes)
            finally:
                data.release()


def gguf_reader(gguf: Any, path: Path) -> Any:
    """gguf-py's GGUFReader on a file whose layout check_gguf has checked."""
    check_gguf(path, {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()})
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - what the walk does not check (a duplicated key or tensor name)
        raise WeightsError(f"{path}: not a readable GGUF file ({type(e).__name__}: {one_line(e, 160)})") from None


def gguf_fields(reader: Any, path: Path) -> dict[str, Any]:
    """The metadata the engine reads (GGUF_FIELDS), each present and of its type."""
    out = {}
    for key, (meaning, kinds) in GGUF_FIELDS.items():
        f = reader.get_field(key)
        if f is None:
            raise WeightsError(f"{path}: no {key} (expected a GPT-2 GGUF as llama.cpp's converter writes one)")
        found = [int(t) for t in f.types]  # [ARRAY, element type] for an array
        if not (found == list(kinds) if kinds[0] == GGUF_ARRAY else len(found) == 1 and found[0] in kinds):
            raise WeightsError(f"{path}: {key} ({meaning}) has GGUF value type {found}, expected "
                               f"{'an array of strings' if kinds[0] == GGUF_ARRAY else 'one of ' + str(list(kinds))}")
        try:
            out[key] = f.contents()
        except UnicodeDecodeError:
            raise WeightsError(f"{path}: {key} ({meaning}) is not UTF-8") from None
    return out


def gguf_config(meta: dict[str, Any], vocab: int, path: Path) -> GPT2Config:
    """The GPT2Config the metadata says; GPT-2's own MLP width reads back as n_inner None."""
    try:
        config = GPT2Config(vocab_size=vocab, n_positions=meta["gpt2.context_length"],
                            n_embd=meta["gpt2.embedding_length"], n_layer=meta["gpt2.block_count"],
                            n_head=meta["gpt2.attention.head_count"], n_inner=meta["gpt2.feed_forward_length"],
                            # stored as float32: 1e-5 reads back as 9.99999975e-06, so the 7 digits a float32 holds
                            layer_norm_epsilon=float(f"{meta['gpt2.attention.layer_norm_epsilon']:.7g}"))
    except ValueError as e:
        raise WeightsError(f"{path}: {e}") from None
    return replace(config, n_inner=None) if config.n_inner == 4 * config.n_embd else config


def check_gguf_identity(meta: dict[str, Any], config: GPT2Config, path: Path) -> None:
    """GPT-2's architecture, tokenizer and vocabulary, or an error naming what the file holds instead."""
    if meta["general.architecture"] != "gpt2":
        raise WeightsError(f"{path}: a GGUF of architecture {meta['general.architecture']!r}; the engine runs 'gpt2'")
    if meta["tokenizer.ggml.model"] != "gpt2":
        raise WeightsError(f"{path}: tokenizer.ggml.model is {meta['tokenizer.ggml.model']!r}, expected GPT-2's "
                           f"'gpt2' BPE")
    if len(meta["tokenizer.ggml.tokens"]) != config.vocab_size or config.vocab_size != GPT2_VOCAB:
        raise WeightsError(f"{path}: a vocabulary of {config.vocab_size} tokens; the engine runs GPT-2's 50257")
    if meta["tokenizer.ggml.tokens"] != bpe_tables(load_tokenizer(None).source)[0]:
        raise WeightsError(f"{path}: its tokens are not GPT-2's BPE vocabulary; the engine runs GPT-2's tokenizer")


def gguf_tensor(gguf: Any, t: Any, shape: tuple[int, ...], matrix: bool, path: Path) -> torch.Tensor:
    """One tensor of the file in the official layout (float32), its type and shape checked before it is read."""
    supported = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0)
    if t.tensor_type not in supported:
        raise WeightsError(f"{path}: {t.name} is {t.tensor_type.name}; the engine reads F32, F16 and Q8_0 GGUFs")
    stored = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dimension first
    if (stored[::-1] if matrix else stored) != shape:
        found = list(stored[::-1] if matrix else stored)
        raise WeightsError(f"{path}: {t.name} has shape {found}, expected {list(shape)} in the official layout")
    data = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(stored)
    return (data.t() if matrix else data).contiguous()


def gguf_tensors(gguf: Any, reader: Any, config: GPT2Config, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor by its official name, strictly accounted: each used once, `output.weight` checked equal to
    token_embd (GPT-2 ties them), nothing left over."""
    found = {t.name: t for t in reader.tensors}
    expected = expected_shapes(config)
    out: dict[str, torch.Tensor] = {}
    for name, target in gguf_names(config).items():
        if target not in found:
            raise WeightsError(f"{path}: missing tensor {target}")
        matrix = any(name.endswith(m) for m in MATRICES)
        out[name] = gguf_tensor(gguf, found.pop(target), expected[name], matrix, path)
    if "output.weight" in found:
        head = gguf_tensor(gguf, found.pop("output.weight"), expected["wte.weight"], False, path)
        if not torch.equal(head, out["wte.weight"]):
            for name, tensor in (("token_embd.weight", out["wte.weight"]), ("output.weight", head)):
                check_values(path, name, tensor, limit=None)  # NaN != NaN: a NaN is named, not called untied
            raise WeightsError(f"{path}: output.weight differs from token_embd.weight; GPT-2 ties them")
    if found:
        raise WeightsError(f"{path}: unexpected tensor {min(found)} (not part of GPT-2 with n_layer={config.n_layer})")
    return out


def read_gguf(path: Path) -> tuple[GPT2Config, dict[str, torch.Tensor]]:
    """A GPT-2 GGUF file (f32, f16 or q8_0 tensors, dequantized to float32) by the official names: its layout checked
    against its size before gguf-py reads it, its config's size against the file and memory before a tensor is."""
    gguf = gguf_module()
    reader = gguf_reader(gguf, path)
    meta = gguf_fields(reader, path)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    config = gguf_config(meta, int(embd.shape[-1]) if embd is not None else GPT2_VOCAB, path)
    check_gguf_identity(meta, config, path)
    check_size(config, path)
    return config, gguf_tensors(gguf, reader, config, path)
