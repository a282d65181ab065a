"""What every command that loads a model shares: the model options, their command-line flags, and loading.

This module sits below every command (generate, score, serve, inspect, the Ray modules): they import it, and
nothing here imports them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from .core.errors import GPT2EngineError
from .core.weights import DEFAULT_WEIGHTS, DEMO_NAME


class UsageError(GPT2EngineError):
    """Bad command-line input."""


@dataclass(frozen=True)
class ModelOptions:
    """Which checkpoint to load and how: the `--weights`, `--dtype`, `--quantize`, `--threads` and `--lora` flags."""

    weights: Path = DEFAULT_WEIGHTS
    dtype: str = "float32"
    quantize: str | None = None
    threads: int | None = None  # torch's CPU threads (None: torch's choice)
    lora: Path | None = None  # a PEFT LoRA adapter directory applied on the weights
    force: bool = False  # apply `lora` even to a base other than the one it records

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelOptions:
        lora = getattr(args, "lora", None)
        return cls(args.weights, args.dtype, args.quantize, args.threads, lora if isinstance(lora, Path) else None,
                   getattr(args, "force", False))


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


positive_int.__name__ = "positive integer"  # argparse names the type in its error: "invalid positive integer value"


def add_weights_option(p: argparse.ArgumentParser) -> None:
    """--weights DIR; the CLI resolves its default (weights/, else the demo model) with `core.weights.weights_directory`."""
    p.add_argument("--weights", type=Path, metavar="DIR",
                   help=f"checkpoint directory in the official layout (default {DEFAULT_WEIGHTS}/, or the demo model "
                        f"when {DEFAULT_WEIGHTS}/ holds none and `make demo` built it; `{DEMO_NAME}` names the demo model)")


def add_force_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true",
                   help="apply a LoRA adapter even to weights other than the base it was trained on (by default an "
                        "error: the adapter records its base's fingerprint)")


def add_model_options(p: argparse.ArgumentParser, lora: bool = True) -> None:
    """The model flags; `lora`: with --lora DIR (gpt2 serve has its own, NAME=DIR, repeatable)."""
    add_weights_option(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and matmul dtype (default float32)")
    p.add_argument("--quantize", choices=["int8", "int4"],
                   help="quantize the projections at load time to blockwise int8 or int4 (the head to int8, or "
                        "6 bits with int4): "
                        "faster decoding, a little less accurate (see README)")
    p.add_argument("--threads", type=positive_int, help="CPU threads for torch (default: torch's choice)")
    if lora:
        p.add_argument("--lora", type=Path, metavar="DIR",
                       help="a LoRA adapter (PEFT's format, from gpt2 finetune --lora or peft) applied on the weights; "
                            "without --weights, on the base it records")
        add_force_option(p)


def load_model(options: ModelOptions):
    """The GPT2 these options name (torch's thread count set first)."""
    import torch

    from .api import GPT2

    if options.threads:
        torch.set_num_threads(options.threads)
    return GPT2.from_pretrained(options.weights, dtype=options.dtype, quantize=options.quantize, lora=options.lora,
                                force=options.force)
