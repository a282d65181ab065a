"""nanoGPT's `ckpt.pt`, read into the official names."""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.config import GPT2_VOCAB, GPT2Config
from ..core.errors import WeightsError
from ..core.weights import MATRICES, expected_shapes

NANOGPT_PREFIX = "transformer."


COMPILED_PREFIX = "_orig_mod."  # what torch.compile's wrapper adds to every key


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

