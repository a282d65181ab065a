"""GPT-2 hyperparameters, named as in Hugging Face's `config.json`."""

from __future__ import annotations

import json
import os
import resource
import stat
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import IO, Any

from .errors import InputError, WeightsError

# Up to this many rows a pass over the weights (one decode step of many sequences, a verify pass, short prompts riding
# along) runs on the native row-invariant kernels: each output element is reduced in a fixed order whatever the row
# count, so a sequence's logits never depend on what shares its pass. The scheduler plans passes within it.
DECODE_ROWS = 32
GPT2_VOCAB = 50257  # GPT-2's BPE: 50,000 merges, 256 byte tokens and <|endoftext|>

# The largest value each dimension may take: far above any GPT-2 (xl: 1,600 channels, 48 layers, 1,024 positions),
# low enough that a corrupt or hostile file's numbers are refused before anything of their size is allocated.
LIMITS = {"vocab_size": 1 << 20, "n_positions": 1 << 20, "n_embd": 1 << 16, "n_layer": 1 << 12, "n_head": 1 << 12,
          "n_inner": 1 << 18}
MAX_PARAMETERS = 1 << 36  # 68.7 billion, 44 times GPT-2 xl's 1.56 billion (275 GB in float32)

@dataclass(frozen=True)
class GPT2Config:
    """The shape of a GPT-2 model; defaults are GPT-2 small."""

    vocab_size: int = 50257
    n_positions: int = 1024  # context length
    n_embd: int = 768  # C
    n_layer: int = 12
    n_head: int = 12  # nh
    n_inner: int | None = None  # MLP width; None means 4 * n_embd
    layer_norm_epsilon: float = 1e-5
    # GPT-2's GELU is the tanh approximation ("gelu_new", Hugging Face's name); nanoGPT's models use the exact erf
    # form (nn.GELU(), Hugging Face's "gelu"), and a checkpoint converted from one keeps it
    activation_function: str = "gelu_new"

    def __post_init__(self) -> None:
        for name, limit in LIMITS.items():
            value = getattr(self, name)
            if name == "n_inner" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
                raise ValueError(f"config: {name} must be a positive integer up to {limit:,}"
                                 f"{' or null' if name == 'n_inner' else ''}, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"config: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        eps = self.layer_norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:  # GPT-2's is 1e-5
            raise ValueError(f"config: layer_norm_epsilon must be a number in (0, 1), got {eps!r}")
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(f"config: activation_function {self.activation_function!r} is not supported (expected "
                             f"{' or '.join(map(repr, ACTIVATIONS))})")
        if self.parameters > MAX_PARAMETERS:
            raise ValueError(f"config: {self.parameters:,} parameters (n_layer {self.n_layer}, n_embd {self.n_embd}, "
                             f"vocab_size {self.vocab_size}, n_positions {self.n_positions}), more than the "
                             f"{MAX_PARAMETERS:,} the engine accepts")

    @property
    def parameters(self) -> int:
        """How many parameters the official layout holds (124,439,808 for GPT-2 small; the tied head counted once)."""
        C, F = self.n_embd, self.mlp_width
        block = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * F + F) + (F * C + C)  # ln_1, attn, ln_2, mlp
        return (self.vocab_size + self.n_positions) * C + self.n_layer * block + 2 * C

    @property
    def exact_gelu(self) -> bool:
        """Whether the MLP's GELU is the exact erf form (nanoGPT's) rather than GPT-2's tanh approximation."""
        return self.activation_function == "gelu"

    @property
    def head_size(self) -> int:  # hs
        return self.n_embd // self.n_head

    @property
    def mlp_width(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    def to_json_dict(self) -> dict[str, object]:
        """This config as the official checkpoints' config.json writes it (transformers reads it back as is)."""
        raw: dict[str, object] = {
            "activation_function": self.activation_function, "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
            "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
            "layer_norm_epsilon": self.layer_norm_epsilon, "model_type": "gpt2", "n_ctx": self.n_positions,
            "n_embd": self.n_embd, "n_head": self.n_head, "n_inner": self.n_inner, "n_layer": self.n_layer,
            "n_positions": self.n_positions, "resid_pdrop": 0.1, "scale_attn_weights": True,
            "vocab_size": self.vocab_size,
        }  # fmt: skip
        return raw

    @classmethod
    def from_json(cls, path: str | Path) -> GPT2Config:
        """Read a Hugging Face GPT-2 `config.json`, rejecting options this engine does not implement."""
        path = Path(path)
        try:
            raw = read_json(path)
        except FileNotFoundError:
            raise WeightsError(f"{path}: config.json not found (expected the checkpoint's Hugging Face config)") from None
        except InputError as e:
            raise WeightsError(str(e)) from None
        except (OSError, ValueError) as e:
            raise WeightsError(f"{path}: not a readable JSON config ({e})") from None
        if not isinstance(raw, dict):
            raise WeightsError(f"{path}: expected a JSON object, found {type(raw).__name__}")
        model_type = raw.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise WeightsError(f"{path}: model_type is {model_type!r}, expected 'gpt2'")
        # Options that change the math; the official checkpoints all use the values on the right.
        for key, expected in UNSUPPORTED_OPTIONS.items():
            if key in raw and raw[key] != expected:
                raise WeightsError(f"{path}: {key}={raw[key]!r} is not supported (expected {expected!r})")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except (TypeError, ValueError) as e:
            raise WeightsError(f"{path}: {e}") from None


# A JSON config (a checkpoint's, an adapter's, an SAE's) or a training state is a few KB and GPT-2's vocab.json 1 MB:
# a file past this is refused before it is read (a sparse file of 5 GB, /dev/zero, would otherwise be read whole).
JSON_BYTES = 64 << 20


def size_text(size: int) -> str:
    """A size as people read it: '5.0 GiB', '64 MiB', '4,096 bytes'."""
    if size >= 1 << 30:
        return f"{size / 2**30:,.1f} GiB"
    return f"{size / 2**20:,.{0 if size % (1 << 20) == 0 else 1}f} MiB" if size >= 1 << 20 else f"{size:,} bytes"


def read_bytes(path: str | Path, limit: int, expected: str, name: str | None = None,
               stdin: IO[bytes] | None = None, regular: bool = False) -> bytes:
    """The whole of a file (or of `stdin` for "-"), its size checked before it is read: one holding more than `limit`
    bytes is an InputError '{name}: 5.0 GiB; expected {expected} of at most 64 MiB' (`name`: the path unless given;
    'more than 64 MiB' where only reading tells, as from a device or a pipe). `regular`: anything but a regular file
    is refused before it is opened (opening a FIFO waits for a writer, forever). OSError as opening or reading
    raises."""
    name = str(path) if name is None else name
    if regular and not (stdin is not None and str(path) == "-") and os.path.exists(path) and \
            not stat.S_ISREG(os.stat(path).st_mode):
        raise InputError(f"{name}: not a regular file (a FIFO, a device or a folder); expected {expected}")
    if stdin is not None and str(path) == "-":
        data, size = stdin.read(limit + 1), 0
    else:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size  # 0 for a device or a pipe: the read stops at limit + 1 anyway
            data = b"" if size > limit else f.read(limit + 1)
    if size > limit or len(data) > limit:
        found = size_text(size) if size > limit else f"more than {size_text(limit)}"
        raise InputError(f"{name}: {found}; expected {expected} of at most {size_text(limit)}")
    return data


def read_json(path: Path, expected: str = "a JSON config") -> Any:
    """The value of a JSON file of at most JSON_BYTES (past that an InputError naming `expected`); OSError as reading
    it raises, ValueError in one line where it is not UTF-8 JSON or nests deeper than Python's parser recurses (a
    config nested 100,000 deep)."""
    text = read_bytes(path, JSON_BYTES, expected, regular=True).decode("utf-8")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("its values nest too deeply") from None


def memory_limit() -> int:
    """The bytes this process may hold: the machine's memory, or the address-space limit set on it where lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return total if soft == resource.RLIM_INFINITY else min(total, soft)


def memory_left() -> int:
    """The bytes this process may still allocate: memory_limit(), less what the process has mapped already where an
    address-space limit (RLIMIT_AS) is set, since every mapping counts against it (torch and the interpreter alone
    map a few GB)."""
    limit = memory_limit()
    if resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
        return limit
    try:
        with open("/proc/self/status", "rb") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"VmSize:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return limit  # not Linux: the limit as it is
    return max(0, limit - mapped)


def check_size(config: GPT2Config, path: Path, copied: int = 4) -> None:
    """Refuse, before anything of their size is allocated, the dimensions a file at `path` cannot hold (every format
    stores at least one byte per parameter) and those whose weights cannot fit in memory when the reader holds
    `copied` bytes of each parameter (float32 copies: 4; used in place from the mapped file: 0)."""
    n, size = config.parameters, path.stat().st_size
    dims = f"n_layer {config.n_layer}, n_embd {config.n_embd}, vocab_size {config.vocab_size}, n_positions {config.n_positions}"
    if n > size:
        raise WeightsError(f"{path}: its config ({dims}) means {n:,} parameters, and the file holds {size:,} bytes "
                           f"(at least one byte per parameter)")
    need, limit = copied * n, memory_limit()
    if need > limit:
        raise WeightsError(f"{path}: its {n:,} parameters ({dims}) need {need / 2**30:.1f} GiB as float32, more than "
                           f"the {limit / 2**30:.1f} GiB of memory this process may use")


ACTIVATIONS = ("gelu_new", "gelu")  # tanh-approximated (GPT-2's), exact erf (nanoGPT's)

UNSUPPORTED_OPTIONS: dict[str, object] = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}

PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(),  # 124M parameters
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),  # 355M
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}


def preset(name: str, **overrides: int) -> GPT2Config:
    """A named preset, optionally with some fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)
