"""What every command that loads a model shares: the model options, their command-line flags, and loading.

This module sits below every command (generate, score, serve, inspect, the Ray modules): they import it, and
nothing here imports them.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .core.errors import GPT2EngineError
from .formats.hf import DEFAULT_WEIGHTS, DEMO_NAME


class UsageError(GPT2EngineError):
    """Bad command-line input."""


@dataclass(frozen=True)
class ModelOptions:
    """Which checkpoint to load and how: the `--weights`, `--dtype`, `--quantize`, `--threads`, `--lora`, `--device`,
    `--runner` and `--weight-layout` flags."""

    weights: Path = DEFAULT_WEIGHTS
    dtype: str = "float32"
    quantize: str | None = None
    threads: int | None = None  # torch's CPU threads (None: torch's choice)
    lora: Path | None = None  # a PEFT LoRA adapter directory applied on the weights
    force: bool = False  # apply `lora` even to a base other than the one it records
    device: str = "cpu"  # where the model runs: "cpu", or "cuda" (a GPU, on the torch runner)
    runner: str | None = None  # "native" or "torch" (None: native on the CPU, torch on a GPU)
    weight_layout: str = "auto"  # auto, plain or packed (core/packing.py)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelOptions:
        lora = getattr(args, "lora", None)
        return cls(args.weights, args.dtype, args.quantize, args.threads, lora if isinstance(lora, Path) else None,
                   getattr(args, "force", False), getattr(args, "device", "cpu"), getattr(args, "runner", None),
                   getattr(args, "weight_layout", "auto"))


def progress_bar(quiet: bool = False, **bar: object) -> tqdm:
    """A tqdm bar on stderr, drawn only on a terminal: a log or a pipe gets the command's own lines, not bars
    (nor a bar's first frame before an error)."""
    return tqdm(file=sys.stderr, disable=quiet or not sys.stderr.isatty(), dynamic_ncols=True, **bar)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    if value >= 2**63:  # past a C long: islice, torch's sizes and range() refuse it deep inside a command
        raise argparse.ArgumentTypeError(f"{text}: at most 2^63 - 1")
    return value


positive_int.__name__ = "positive integer"  # argparse names the type in its error: "invalid positive integer value"


def seed_value(text: str) -> int:
    """--seed: an integer in [0, 2^63), what torch's and numpy's generators take (a larger one overflowed inside them)."""
    value = int(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{text}: expected an integer in [0, 2^63)")
    return value


def thread_count(text: str) -> int:
    """--threads: a positive integer, at most 4 per CPU core (torch starts each thread with its stack; a million of
    them ran out of memory inside torch.set_num_threads)."""
    value = positive_int(text)
    cores = os.cpu_count() or 1
    if value > 4 * cores:
        raise argparse.ArgumentTypeError(f"{value} threads; at most {4 * cores} (4 per CPU core; this machine has "
                                         f"{cores})")
    return value


def add_weights_option(p: argparse.ArgumentParser) -> None:
    """--weights DIR; the CLI resolves its default (weights/, else the demo model) with `core.weights.weights_directory`."""
    p.add_argument("--weights", type=Path, metavar="DIR",
                   help=f"checkpoint directory in the official layout (default {DEFAULT_WEIGHTS}/, or the demo model "
                        f"when {DEFAULT_WEIGHTS}/ holds none and `make demo` built it; `{DEMO_NAME}` names the demo model)")


def add_device_options(p: argparse.ArgumentParser) -> None:
    """--device and --runner: where the model runs, and on which runner."""
    p.add_argument("--device", default="cpu", metavar="DEV",
                   help="where the model runs: cpu (default), or cuda / cuda:N for an NVIDIA GPU (the torch runner: "
                        "weights, KV cache and activations there, decode steps as CUDA graphs; see docs/cuda.md)")
    p.add_argument("--runner", choices=["native", "torch"],
                   help="native: the engine's CPU kernels (the default on the CPU); torch: torch's kernels on --device "
                        "(the default on a GPU; on the CPU, the runner a GPU runs)")


def add_force_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true",
                   help="apply a LoRA adapter even to weights other than the base it was trained on (by default an "
                        "error: the adapter records its base's fingerprint)")


def add_overwrite_option(p: argparse.ArgumentParser, what: str) -> None:
    """--overwrite: replace `what` (by default an error, so that no model is lost to a mistyped destination)."""
    p.add_argument("--overwrite", action="store_true", help=f"replace {what} (by default an error)")


def add_model_options(p: argparse.ArgumentParser, lora: bool = True) -> None:
    """The model flags; `lora`: with --lora DIR (gpt2 serve has its own, NAME=DIR, repeatable)."""
    add_weights_option(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="weights and matmul dtype (default float32; float16 on the torch runner only)")
    p.add_argument("--quantize", choices=["int8", "int4"],
                   help="quantize the projections at load time to blockwise int8 or int4 (the head to int8, or "
                        "6 bits with int4): "
                        "faster decoding, a little less accurate (see docs/benchmarks.md)")
    p.add_argument("--threads", type=thread_count, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--weight-layout", choices=["auto", "plain", "packed"], default="auto",
                   help="how float32/bfloat16 weights are kept for decoding on the CPU: packed exponents (0.875x / "
                        "0.75x the bytes, the same logits to the bit), plain, or auto: packed where this CPU reads "
                        "that faster, measured at load (default auto)")
    add_device_options(p)
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
                                force=options.force, device=options.device, runner=options.runner,
                                weight_layout=options.weight_layout)


def add_steer_option(p: argparse.ArgumentParser) -> None:
    """--steer SPEC, repeatable (interp/steering.py's grammar)."""
    from .interp.spec import SPEC_GRAMMAR

    p.add_argument("--steer", action="append", default=[], metavar="SPEC",
                   help=f"steer the model while it runs (repeatable, applied in order): {SPEC_GRAMMAR}. SAE is an "
                        "SAELens directory or OpenAI .pt file (with hook=, which it does not record); coef adds coef x the feature's decoder row (or the "
                        "vector), clamp sets the feature (or the component along the vector) to VALUE. Or the path of "
                        "an lm-evaluation-harness steered-model .pt file. "
                        "E.g. --steer sae=saes/res6,feature=123,coef=8 or "
                        "--steer vector=dir.pt,hook=blocks.6.hook_resid_pre,coef=4")


def parse_steer_args(specs: list[str]) -> list[dict[str, str] | Path]:
    """The --steer specs parsed (their grammar checked before a model loads): fields, or an lm-eval file's path."""
    from .core.errors import SteeringError
    from .interp.spec import parse_spec

    out: list[dict[str, str] | Path] = []
    for spec in specs:
        if "=" in spec:
            out.append(parse_spec(spec))
        elif Path(spec).suffix in (".pt", ".pth") and Path(spec).is_file():
            out.append(Path(spec))
        else:
            raise SteeringError(f"--steer {spec!r}: expected key=value fields or an lm-eval steered-model .pt file "
                                f"that exists")
    return out


def steering_from_args(specs: list[dict[str, str] | Path], config) -> tuple:
    """The Steering edits the parsed --steer specs name, for a model with this config (SAEs and vectors loaded
    once per path). A file that cannot be read is named as the spec gave it: `--steer sae=PATH: ...`."""
    from .formats.saes import SAEError
    from .interp.sae import SAE
    from .core.errors import SteeringError
    from .formats.vectors import read_vector
    from .interp.spec import check_steering, from_fields
    from .interp.steering import load_lm_eval

    saes: dict[tuple[str, str | None], SAE] = {}

    def sae(path: str, hook: str | None) -> SAE:
        if (path, hook) not in saes:
            try:  # hook=: where an OpenAI .pt file reads (it does not record it); SAELens's cfg.json names its own
                saes[path, hook] = SAE.load(path, hook)
            except SAEError as e:  # the loader speaks of --sae, gpt2 serve's flag, and of hook_name, the API's
                message = unprefixed(str(e), "--sae ").replace("pass hook_name", "add hook=HOOK")
                raise SteeringError(f"--steer sae={path}: {message}") from None
        return saes[path, hook]

    def vector(path: str):
        try:
            return read_vector(path)
        except SteeringError as e:
            raise SteeringError(f"--steer vector={path}: {unprefixed(str(e), 'steering vector ')}") from None

    out = []
    for spec in specs:
        out += load_lm_eval(spec, config) if isinstance(spec, Path) else [from_fields(spec, sae, vector)]
    return check_steering(out, config)


def unprefixed(message: str, prefix: str) -> str:
    """`message` without its leading `PREFIX NAME: ` (a file named twice reads badly)."""
    return message.split(": ", 1)[1] if message.startswith(prefix) and ": " in message else message
