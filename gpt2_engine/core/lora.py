"""LoRA adapters (Hu et al., 2021) on GPT-2's projections, in Hugging Face PEFT's file format.

An adapter on a projection y = x W + b (Conv1D: W is (in, out)) adds a low-rank term:
    y = x W + b + s * (dropout(x) A) B,    A (in, r), B (r, out), s = lora_alpha / r
with W frozen; B starts at zero, so a new adapter leaves the model as it was. GPT-2's c_attn is one fused Conv1D
for Q, K and V, so one adapter there spans all three (its B has 3C columns), as PEFT's does.

PEFT's files (what `PeftModel.from_pretrained(GPT2LMHeadModel..., dir)` reads): adapter_config.json (peft_type
LORA, r, lora_alpha, target_modules, fan_in_fan_out true, since GPT-2's projections are Conv1D) and
adapter_model.safetensors, whose keys name nn.Linear layers: `base_model.model.transformer.h.{i}.attn.c_attn.lora_A
.weight` is A^T (r, in) and `...lora_B.weight` is B^T (out, r). Here A and B are kept in the Conv1D orientation
(in, r) and (r, out), so that the term is two plain matmuls; the transposes happen at the file boundary only.

At inference the adapters ride on the weights (weights.LoraStack on each adapted Linear), n of them stacked, and a
pass says per row which one applies (projection.lora_rows): one set of base weights serves many adapters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .config import GPT2Config
from .errors import GPT2EngineError
from .packed import PackedMatrix
from .weights import BLOCK_PARTS, Block, GPT2Weights, Linear, LoraStack, PanelMatrix, QuantizedMatrix

# the projections an adapter can sit on: the name users give (PEFT's target_modules suffixes) -> the Block field
TARGETS = {"c_attn": "c_attn", "attn.c_proj": "attn_c_proj", "c_fc": "c_fc", "mlp.c_proj": "mlp_c_proj"}
TARGET_OF = {field: target for target, field in TARGETS.items()}  # Block field -> target
ALL_TARGETS = tuple(TARGETS)


class LoraError(GPT2EngineError):
    """An adapter that cannot be made, read or used: bad settings, files, shapes or base."""


def parse_targets(spec: str | Sequence[str]) -> tuple[str, ...]:
    """'c_attn,mlp.c_proj' (or a list) -> the targets in canonical order; PEFT's bare 'c_proj' means both c_projs."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    chosen: set[str] = set()
    for name in names:
        name = {"attn.c_attn": "c_attn", "mlp.c_fc": "c_fc"}.get(name, name)
        if name == "c_proj":
            chosen |= {"attn.c_proj", "mlp.c_proj"}
        elif name in TARGETS:
            chosen.add(name)
        else:
            raise LoraError(f"LoRA target {name!r}: expected some of {', '.join(ALL_TARGETS)} (or c_proj for both)")
    if not chosen:
        raise LoraError(f"LoRA targets: expected at least one of {', '.join(ALL_TARGETS)}")
    return tuple(t for t in ALL_TARGETS if t in chosen)


@dataclass(frozen=True)
class LoraSettings:
    """An adapter's shape: rank r, lora_alpha, the dropout on its input, and which projections it adapts."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ALL_TARGETS
    rslora: bool = False  # scale alpha / sqrt(r) (rank-stabilised LoRA) rather than alpha / r

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r < 1:
            raise LoraError(f"LoRA rank r: expected an integer >= 1, got {self.r!r}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise LoraError(f"lora_alpha: expected a finite number > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise LoraError(f"LoRA dropout: expected a probability in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "targets", parse_targets(self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


def module_name(i: int, target: str) -> str:
    """The adapted projection's official module name, 'h.3.attn.c_attn'."""
    return f"h.{i}.{BLOCK_PARTS[TARGETS[target]]}"


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter: its settings and its tensors, 'h.{i}.{module}.lora_A' (in, r) and '.lora_B' (r, out)."""

    settings: LoraSettings
    tensors: dict[str, torch.Tensor]
    base: str = ""  # base_model_name_or_path, as PEFT records it
    base_fingerprint: str = ""  # core.weights.weights_fingerprint of the base it was trained on ("" from peft)

    def pair(self, i: int, target: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        name = module_name(i, target)
        a = self.tensors.get(name + ".lora_A")
        return None if a is None else (a, self.tensors[name + ".lora_B"])

    @property
    def parameters(self) -> int:
        return sum(t.numel() for t in self.tensors.values())


def target_shape(config: GPT2Config, target: str) -> tuple[int, int]:
    C, F = config.n_embd, config.mlp_width
    return {"c_attn": (C, 3 * C), "attn.c_proj": (C, C), "c_fc": (C, F), "mlp.c_proj": (F, C)}[target]


def new_adapter(config: GPT2Config, settings: LoraSettings, generator: torch.Generator, base: str = "",
                dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """A fresh adapter as PEFT initialises one: A uniform in +-1/sqrt(in) (kaiming_uniform_ with a = sqrt(5) on
    nn.Linear's (r, in) weight), B zero, so the adapted model starts equal to the base."""
    tensors: dict[str, torch.Tensor] = {}
    for i in range(config.n_layer):
        for target in settings.targets:
            fan_in, fan_out = target_shape(config, target)
            bound = 1 / math.sqrt(fan_in)
            a = torch.rand(settings.r, fan_in, generator=generator, dtype=dtype).mul_(2 * bound).sub_(bound)
            tensors[module_name(i, target) + ".lora_A"] = a.t().contiguous()  # (in, r)
            tensors[module_name(i, target) + ".lora_B"] = torch.zeros(settings.r, fan_out, dtype=dtype)
    return LoraAdapter(settings, tensors, base)


def attach(w: GPT2Weights, adapters: Sequence[LoraAdapter]) -> GPT2Weights:
    """The base weights (any format, untouched) with adapters 0..n-1 stacked on every projection any of them adapts.
    An adapter that leaves a projection alone gets zeros there, and smaller ranks are zero-padded: zero terms add
    nothing, so a row's result is the same whatever the other adapters are."""
    if not adapters:
        return w
    dtype = next(iter(adapters[0].tensors.values())).dtype

    def stack(i: int, target: str, p: Linear) -> Linear:
        pairs = [ad.pair(i, target) for ad in adapters]
        if all(pr is None for pr in pairs):
            return replace(p, lora=None)
        w = p.weight
        stored = isinstance(w, (QuantizedMatrix, PanelMatrix, PackedMatrix))  # not a (K, N) tensor
        K, N = (w.in_features, w.out_features) if stored else w.shape
        r = max(pr[0].shape[1] for pr in pairs if pr is not None)
        a, b = torch.zeros(len(adapters), K, r, dtype=dtype), torch.zeros(len(adapters), r, N, dtype=dtype)
        for j, pr in enumerate(pairs):
            if pr is not None:
                a[j, :, : pr[0].shape[1]], b[j, : pr[1].shape[0]] = pr
        scale = torch.tensor([ad.settings.scale for ad in adapters], dtype=dtype)
        return replace(p, lora=LoraStack(a, b, scale))

    blocks = tuple(Block(**{f: stack(i, TARGET_OF[f], getattr(blk, f)) if f in TARGET_OF else getattr(blk, f)
                            for f in BLOCK_PARTS})
                   for i, blk in enumerate(w.blocks))
    return replace(w, blocks=blocks)


def trainable(w: GPT2Weights, adapter: LoraAdapter) -> tuple[GPT2Weights, dict[str, torch.Tensor]]:
    """For training one adapter: the weights with it attached, and its tensors as they sit there (the views the
    forward reads, which the optimizer updates in place), under the adapter's names."""
    attached = attach(w, [adapter])
    params: dict[str, torch.Tensor] = {}
    for i, blk in enumerate(attached.blocks):
        for target in adapter.settings.targets:
            stack = getattr(blk, TARGETS[target]).lora
            params[module_name(i, target) + ".lora_A"] = stack.a[0]
            params[module_name(i, target) + ".lora_B"] = stack.b[0]
    return attached, params


def merge(w: GPT2Weights, adapter: LoraAdapter) -> GPT2Weights:
    """The base with the adapter folded in, W + s A B, as new float32 matrices (the base's stay as they are)."""
    def fold(i: int, field: str, p: Linear) -> Linear:
        pair = adapter.pair(i, TARGET_OF[field])
        if pair is None:
            return p
        if isinstance(p.weight, QuantizedMatrix) or p.weight.dtype != torch.float32:
            raise LoraError("merge: the base must be float32 (a quantized or bfloat16 base cannot hold the merged "
                            "weights exactly); load it without --quantize/--dtype")
        a, b = pair
        return Linear(torch.addmm(p.weight, a.float(), b.float(), alpha=adapter.settings.scale), p.bias)

    blocks = tuple(Block(**{f: fold(i, f, getattr(blk, f)) if f in TARGET_OF else getattr(blk, f)
                            for f in BLOCK_PARTS})
                   for i, blk in enumerate(w.blocks))
    return replace(w, blocks=blocks)


# --- PEFT's files ---------------------------------------------------------------------------------------------------


