"""nanoGPT's `ckpt.pt`, read into the official names."""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.config import GPT2_VOCAB, GPT2Config, check_size
from ..core.errors import WeightsError
from ..core.weights import MATRICES, expected_shapes
from .pickles import load_pickle

NANOGPT_PREFIX = "transformer."


COMPILED_PREFIX = "_orig_mod."  # what torch.compile's wrapper adds to every key


NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")  # GPTConfig's, ints all


def found(ckpt: object) -> str:
    """What a checkpoint that is not nanoGPT's holds: its type, and for a dict its keys and their values' types."""
    if not isinstance(ckpt, dict):
        return type(ckpt).__name__
    keys = sorted(ckpt, key=str)[:6]
    return "a dict of " + ", ".join(f"{str(k)!r}: {type(ckpt[k]).__name__}" for k in keys)


def load_nanogpt(path: Path) -> dict:
    """The checkpoint's dict, read without running code, with `model` (a state dict) and `model_args` checked."""
    try:
        ckpt = load_pickle(path)
    except ValueError as e:
        raise WeightsError(f"{path}: not a readable nanoGPT checkpoint ({e})") from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict) or not isinstance(ckpt.get("model_args"), dict):
        raise WeightsError(f"{path}: expected nanoGPT's checkpoint (a dict with 'model' and 'model_args', as its "
                           f"train.py saves), found {found(ckpt)}")
    args = ckpt["model_args"]
    for key in NANOGPT_ARGS:
        if key not in args:
            raise WeightsError(f"{path}: model_args has no {key} (expected nanoGPT's GPTConfig fields)")
        if not isinstance(args[key], int) or isinstance(args[key], bool):
            raise WeightsError(f"{path}: model_args {key} is {args[key]!r}, expected an integer")
    if bad := [k for k in ckpt["model"] if not isinstance(k, str)]:
        raise WeightsError(f"{path}: model holds the key {bad[0]!r}, expected tensor names")
    return ckpt


def nanogpt_config(path: Path, args: dict) -> GPT2Config:
    """The GPT2Config of nanoGPT's model_args: GPT-2's vocabulary (nanoGPT pads it to 50,304), the exact GELU."""
    vocab = args["vocab_size"]
    if vocab < GPT2_VOCAB:
        meta = path.parent / "meta.pkl"
        raise WeightsError(f"{path}: a vocabulary of {vocab} tokens{' (with ' + str(meta) + ')' if meta.exists() else ''} "
                           f"is a character-level model; the engine runs GPT-2's BPE (vocab_size 50257, or 50304 "
                           f"padded)")
    try:
        return GPT2Config(vocab_size=GPT2_VOCAB, n_positions=args["block_size"], n_embd=args["n_embd"],
                          n_layer=args["n_layer"], n_head=args["n_head"], activation_function="gelu")
    except ValueError as e:
        raise WeightsError(f"{path}: {e}") from None


class NanoState:
    """A nanoGPT state dict read by official name, each key taken once (what is left over is accounted for after)."""

    def __init__(self, path: Path, state: dict, config: GPT2Config, bias: bool, vocab: int) -> None:
        self.path, self.config, self.bias, self.vocab = path, config, bias, vocab
        self.state = {k.removeprefix(COMPILED_PREFIX): v for k, v in state.items()}
        self.used: set[str] = set()

    def take(self, key: str) -> torch.Tensor:
        if key not in self.state:
            raise WeightsError(f"{self.path}: missing tensor {key} (nanoGPT's model with n_layer={self.config.n_layer}, "
                               f"bias={self.bias})")
        self.used.add(key)
        t = self.state[key]
        if not isinstance(t, torch.Tensor):
            raise WeightsError(f"{self.path}: {key} is a {type(t).__name__}, not a tensor")
        return t

    def official(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor for official `name` in the official layout, float32."""
        if name.endswith(".bias") and not self.bias:
            return torch.zeros(shape)  # a bias-free layer is one with a zero bias, to the bit
        key = NANOGPT_PREFIX + name
        t = self.take(key)
        if name == "wte.weight":
            if t.dim() != 2 or t.shape[0] != self.vocab or t.shape[1] != self.config.n_embd:
                raise WeightsError(f"{self.path}: {key} has shape {list(t.shape)}, expected [{self.vocab}, "
                                   f"{self.config.n_embd}]")
            t = t[:GPT2_VOCAB]  # the padding rows: never a token, never sampled
        elif any(name.endswith(m) for m in MATRICES):
            t = t.t()  # nn.Linear's (out, in) -> Conv1D's (in, out)
        if tuple(t.shape) != shape:
            raise WeightsError(f"{self.path}: {key} has shape {list(t.shape)}, expected {list(shape)} in the official "
                               f"layout")
        return t.float().contiguous()

    def check_rest(self) -> None:
        """The tied head equal to wte, and nothing left but the causal masks."""
        if not torch.equal(self.take("lm_head.weight"), self.state[NANOGPT_PREFIX + "wte.weight"]):
            raise WeightsError(f"{self.path}: lm_head.weight differs from transformer.wte.weight; nanoGPT ties them")
        ignored = {k for k in self.state if k.endswith(".attn.bias") and k.startswith(NANOGPT_PREFIX + "h.")}  # masks
        if unexpected := sorted(set(self.state) - self.used - ignored):
            raise WeightsError(f"{self.path}: unexpected tensor {unexpected[0]}"
                               f"{f' and {len(unexpected) - 1} more' if len(unexpected) > 1 else ''} (not part of "
                               f"nanoGPT's GPT with n_layer={self.config.n_layer}, bias={self.bias})")


def read_nanogpt(path: Path) -> tuple[GPT2Config, dict[str, torch.Tensor]]:
    """nanoGPT's ckpt.pt (see formats/checkpoints.py's docstring), by the official names, strictly accounted."""
    ckpt = load_nanogpt(path)
    args = ckpt["model_args"]
    config = nanogpt_config(path, args)
    check_size(config, path)
    state = NanoState(path, ckpt["model"], config, bool(args.get("bias", True)), args["vocab_size"])
    out = {name: state.official(name, shape) for name, shape in expected_shapes(config).items()}
    state.check_rest()
    return config, out
