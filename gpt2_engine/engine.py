"""The public API: `GPT2.from_pretrained(directory)`, then `model(ids)` for logits or `model.generate(prompt)`."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import GPT2Config
from .errors import GPT2EngineError, WeightsError
from .model import forward
from .tokenizer import Tokenizer, load_tokenizer
from .weights import CONFIG, GPT2Weights, load_weights


class GPT2:
    """A loaded GPT-2: config, weights and tokenizer, with a from-scratch forward pass."""

    def __init__(self, config: GPT2Config, weights: GPT2Weights, tokenizer: Tokenizer, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = device

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, dtype: torch.dtype | str = torch.float32,
                        device: torch.device | str = "cpu") -> GPT2:
        """Load the official-format checkpoint in `directory` (config.json, weights, BPE files)."""
        directory = Path(directory)
        dtype = parse_dtype(dtype)
        device = torch.device(device)
        config = GPT2Config.from_json(directory / CONFIG) if directory.is_dir() else None
        if config is None:
            load_weights(directory, GPT2Config())  # raises the loader's error for a missing or non-directory path
        weights = load_weights(directory, config, dtype)
        if device.type != "cpu":
            weights = _to_device(weights, device)
        tokenizer = load_tokenizer(directory)
        if tokenizer.n_vocab > config.vocab_size:
            raise WeightsError(f"{directory}: tokenizer has {tokenizer.n_vocab} tokens, more than vocab_size {config.vocab_size}")
        return cls(config, weights, tokenizer, dtype=dtype, device=device)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] (float32) for a LongTensor of token ids [B, T]."""
        return self.forward(ids)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [B, T, V]; if `hidden_states` is a list, the output of each block is appended to it."""
        self.check_ids(ids)
        return forward(self.weights, self.config, ids.to(self.device), hidden_states=hidden_states)

    def check_ids(self, ids: torch.Tensor) -> None:
        """Raise GPT2EngineError unless `ids` is a [B, T] integer tensor of valid tokens that fits the context."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            what = f"{ids.dtype} tensor of shape {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise GPT2EngineError(f"ids: expected an integer tensor of shape [B, T], got {what}")
        B, T = ids.shape
        if B == 0 or T == 0:
            raise GPT2EngineError(f"ids: expected at least one token, got shape [{B}, {T}]")
        if T > self.config.n_positions:
            raise GPT2EngineError(f"ids: {T} tokens exceed the context length {self.config.n_positions}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise GPT2EngineError(f"ids: token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float32 / torch.bfloat16, or their names."""
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if isinstance(dtype, str):
        if dtype not in names:
            raise GPT2EngineError(f"dtype: expected one of {', '.join(names)}, got {dtype!r}")
        dtype = names[dtype]
    if dtype not in (torch.float32, torch.bfloat16):
        raise GPT2EngineError(f"dtype: expected torch.float32 or torch.bfloat16, got {dtype}")
    return dtype


def _to_device(w: GPT2Weights, device: torch.device) -> GPT2Weights:
    import dataclasses

    def move(obj):  # dataclass trees of tensors
        if isinstance(obj, torch.Tensor):
            return obj.to(device)
        if isinstance(obj, tuple):
            return tuple(move(o) for o in obj)
        return dataclasses.replace(obj, **{f.name: move(getattr(obj, f.name)) for f in dataclasses.fields(obj)})

    return move(w)
