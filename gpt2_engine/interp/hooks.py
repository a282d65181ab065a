"""Hook points on the engine's own forward: record activations (run_with_cache) and replace them (run_with_hooks).

The forward functions in model.py call a `Tap` at each hook point when one is given; `Recorder` is that tap. The
names are TransformerLens's for GPT-2 (`hook_embed`, `blocks.3.attn.hook_pattern`, `ln_final.hook_scale`, ...), so
code written against TransformerLens finds the same activations here, with the same shapes. Nothing is a second
implementation of the model: without a tap the forward is the plain one, and with a tap it computes the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..core.config import GPT2Config
from ..core.errors import GPT2EngineError

Hook = Callable[[torch.Tensor, str], "torch.Tensor | None"]  # fn(activation, name) -> a replacement, or None
NameFilter = Sequence[str] | Callable[[str], bool] | None

BLOCK_POINTS = (
    "hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized",
    "attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z",
    "hook_attn_out", "hook_resid_mid", "ln2.hook_scale", "ln2.hook_normalized",
    "mlp.hook_pre", "mlp.hook_post", "hook_mlp_out", "hook_resid_post",
)


def hook_names(config: GPT2Config) -> list[str]:
    """Every hook point of a model with this config, in the order the forward reaches them."""
    blocks = [f"blocks.{i}.{p}" for i in range(config.n_layer) for p in BLOCK_POINTS]
    return ["hook_embed", "hook_pos_embed", *blocks, "ln_final.hook_scale", "ln_final.hook_normalized"]


def name_predicate(names: NameFilter, config: GPT2Config) -> Callable[[str], bool]:
    """`names` as a predicate; a list must name real hook points (a typo is an error, not an empty cache)."""
    if names is None:
        return lambda name: True
    if callable(names):
        return names
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(isinstance(n, str) for n in names):
        raise GPT2EngineError(f"names: expected None, a hook point's name, a list of them or a predicate, got "
                              f"{type(names).__name__}")
    known = set(hook_names(config))
    if unknown := [n for n in names if n not in known]:
        raise GPT2EngineError(f"unknown hook point {unknown[0]!r}; expected names like 'blocks.0.attn.hook_pattern' "
                              f"(gpt2_engine.interp.hooks.hook_names lists all {len(known)})")
    chosen = set(names)
    return chosen.__contains__


@dataclass
class Recorder:
    """A Tap (see model.py) that stores the activations `cache_filter` selects and applies `hooks`."""

    cache_filter: Callable[[str], bool] = lambda name: False
    hooks: Mapping[str, Hook] = field(default_factory=dict)
    activations: dict[str, torch.Tensor] = field(default_factory=dict)

    def wants(self, name: str) -> bool:
        return name in self.hooks or self.cache_filter(name)

    def edits(self, name: str) -> bool:
        return name in self.hooks

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if (hook := self.hooks.get(name)) is not None:
            out = hook(x, name)
            if out is not None:
                if not isinstance(out, torch.Tensor) or out.shape != x.shape:
                    got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise GPT2EngineError(f"hook on {name}: expected a tensor of shape {list(x.shape)} or None, got {got}")
                if not out.is_floating_point():  # a.long() cast back would silently truncate every activation
                    raise GPT2EngineError(f"hook on {name}: expected a floating-point tensor, got {out.dtype}")
                x = out.to(x.dtype)
        if self.cache_filter(name):
            self.activations[name] = x
        return x


class ActivationCache(Mapping[str, torch.Tensor]):
    """Activations by hook-point name, with the model and the ids they came from (inspect's tools need both)."""

    def __init__(self, activations: dict[str, torch.Tensor], model: object, ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> None:
        self.activations = activations
        self.model = model  # the GPT2 that ran: its weights, config and tokenizer
        self.ids = ids  # [B, T]
        self.attention_mask = attention_mask  # [B, T], 1 for real tokens, or None

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.activations[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in this cache (run_with_cache with names=None caches every hook point)") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.activations)

    def __len__(self) -> int:
        return len(self.activations)

    def nbytes(self) -> int:
        """Memory held by the cached tensors (views of one tensor counted once per view)."""
        return sum(t.numel() * t.element_size() for t in self.activations.values())

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} hook points, {self.nbytes() / 2**20:.1f} MiB, ids {list(self.ids.shape)})"
