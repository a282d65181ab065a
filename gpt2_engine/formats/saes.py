"""Sparse autoencoders' files: SAELens's directory (cfg.json + sae_weights.safetensors) and OpenAI's
sparse_autoencoder state dict, read without running their code into an SAEConfig (SAELens's names) and float32
weights whose every shape is checked (interp/sae.py computes with them)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.errors import GPT2EngineError

SAELENS_CONFIG, SAELENS_WEIGHTS = "cfg.json", "sae_weights.safetensors"

ARCHITECTURES = ("standard", "topk", "jumprelu", "gated")


NORMALIZATIONS = ("none", "layer_norm", "expected_average_only_in", "constant_norm_rescale")


class SAEError(GPT2EngineError):
    """A sparse autoencoder that cannot be read, or does not fit the model or hook it is used with."""


@dataclass(frozen=True)
class SAEConfig:
    """What an SAE file says, under SAELens's names (`hook_name`, `d_sae`, ...)."""

    architecture: str  # one of ARCHITECTURES
    d_in: int
    d_sae: int
    hook_name: str
    hook_head_index: int | None = None
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"  # one of NORMALIZATIONS
    reshape_activations: str = "none"  # "none" | "hook_z"
    k: int | None = None  # topk
    rescale_acts_by_decoder_norm: bool = False  # topk: pre-activations scaled by |W_dec row| (SAELens >= 6)
    model_from_pretrained_kwargs: Mapping[str, Any] = field(default_factory=dict)
    prepend_bos: bool = True  # SAELens's default: its training prompts began with <|endoftext|>
    format: str = "saelens"  # "saelens" | "openai"


def read_saelens(directory: Path, hook_name: str | None) -> tuple[SAEConfig, dict[str, torch.Tensor]]:
    """SAELens's format: cfg.json (flat before SAELens 6, `metadata` since) + sae_weights.safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg_path, weights_path = directory / SAELENS_CONFIG, directory / SAELENS_WEIGHTS
    for f in (cfg_path, weights_path):
        if not f.is_file():
            raise SAEError(f"--sae {directory}: no {f.name} (expected SAELens's directory with {SAELENS_CONFIG} and "
                           f"{SAELENS_WEIGHTS})")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SAEError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise SAEError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    meta = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}

    def get(*names: str, default: Any = None) -> Any:
        for name in names:
            for where in (raw, meta):
                if name in where and where[name] is not None:
                    return where[name]
        return default

    architecture = get("architecture", default="standard")
    act = get("activation_fn", "activation_fn_str", default="relu")
    k = get("k", default=(get("activation_fn_kwargs", default={}) or {}).get("k"))
    if act == "topk" and architecture == "standard":
        architecture = "topk"  # SAELens before 6: a standard SAE with a topk activation function
    if architecture not in ARCHITECTURES:
        raise SAEError(f"{cfg_path}: architecture {architecture!r} is not supported (expected one of "
                       f"{', '.join(ARCHITECTURES)})")
    if architecture == "standard" and act != "relu":
        raise SAEError(f"{cfg_path}: activation_fn {act!r} is not supported for a standard SAE (expected relu)")
    normalize = get("normalize_activations", default="none")
    if isinstance(normalize, bool):  # SAELens before 6
        normalize = "expected_average_only_in" if normalize else "none"
    if normalize not in NORMALIZATIONS:
        raise SAEError(f"{cfg_path}: normalize_activations {normalize!r} is not supported (expected one of "
                       f"{', '.join(NORMALIZATIONS)})")
    hook = hook_name or get("hook_name", "hook_point")
    if not hook:
        raise SAEError(f"{cfg_path}: no hook_name; pass hook_name= (the hook point the SAE reads)")
    reshape = get("reshape_activations", default="hook_z" if str(hook).endswith("hook_z") else "none")
    if reshape not in ("none", "hook_z"):
        raise SAEError(f"{cfg_path}: reshape_activations {reshape!r} is not supported (expected none or hook_z)")
    kwargs = get("model_from_pretrained_kwargs", default={}) or {}
    if not isinstance(kwargs, dict):
        raise SAEError(f"{cfg_path}: model_from_pretrained_kwargs: expected an object, got {kwargs!r}")
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as e:
        raise SAEError(f"{weights_path}: not a readable safetensors file ({e})") from None
    if "scaling_factor" in tensors:  # SAELens < 6 saved it; all ones means none
        if not torch.all(tensors.pop("scaling_factor") == 1):
            raise SAEError(f"{weights_path}: a finetuning scaling_factor other than 1 is not supported")
    config = SAEConfig(
        architecture=architecture, d_in=int(get("d_in", default=0)), d_sae=int(get("d_sae", default=0)),
        hook_name=str(hook), hook_head_index=get("hook_head_index", "hook_point_head_index"),
        apply_b_dec_to_input=bool(get("apply_b_dec_to_input", default=True)), normalize_activations=normalize,
        reshape_activations=reshape, k=None if k is None else int(k),
        rescale_acts_by_decoder_norm=architecture == "topk" and bool(get("rescale_acts_by_decoder_norm", default=True)),
        model_from_pretrained_kwargs=dict(kwargs), prepend_bos=bool(get("prepend_bos", default=True)))
    return config, checked(config, tensors, str(weights_path))


def read_openai(path: Path, hook_name: str | None) -> tuple[SAEConfig, dict[str, torch.Tensor]]:
    """OpenAI's sparse_autoencoder state dict (Autoencoder.state_dict()): read with weights_only, so a pickle can
    hold tensors, strings and numbers only. TopK files take layer-normed input, as that repo's model.py does."""
    if not hook_name:
        raise SAEError(f"--sae {path}: OpenAI's format does not record its hook point; pass hook_name (e.g. "
                       f"'blocks.6.hook_resid_post' for its resid_post_mlp layer 6)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an unpickling error names what the file tried to load; a truncated file, its offset
        raise SAEError(f"{path}: not a state dict torch can read safely ({str(e).splitlines()[0][:200]})") from None
    if not isinstance(state, dict) or "encoder.weight" not in state:
        raise SAEError(f"{path}: expected OpenAI's sparse_autoencoder state dict (encoder.weight, decoder.weight, "
                       f"pre_bias, latent_bias)")
    activation = state.get("activation", "ReLU")
    options = state.get("activation_state_dict", {}) or {}
    if activation == "TopK":
        if options.get("postact_fn", "ReLU") != "ReLU":
            raise SAEError(f"{path}: TopK postact_fn {options.get('postact_fn')!r} is not supported (expected ReLU)")
        architecture, k = "topk", int(options["k"])
    elif activation == "ReLU":
        architecture, k = "standard", None
    else:
        raise SAEError(f"{path}: activation {activation!r} is not supported (expected TopK or ReLU)")
    for name in ("encoder.weight", "decoder.weight", "pre_bias", "latent_bias"):
        if not isinstance(state.get(name), torch.Tensor):
            raise SAEError(f"{path}: missing tensor {name}")
    n_latents, d = state["encoder.weight"].shape
    config = SAEConfig(architecture=architecture, d_in=int(d), d_sae=int(n_latents), hook_name=hook_name,
                       normalize_activations="layer_norm" if activation == "TopK" else "none",
                       reshape_activations="hook_z" if hook_name.endswith("hook_z") else "none", k=k,
                       prepend_bos=False, format="openai")
    tensors = {"W_enc": state["encoder.weight"].T, "W_dec": state["decoder.weight"].T, "b_enc": state["latent_bias"],
               "b_dec": state["pre_bias"]}
    return config, checked(config, tensors, str(path))


def checked(config: SAEConfig, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The weights as contiguous float32, each shape checked against the config; a missing or extra one is an error."""
    d_in, d_sae = config.d_in, config.d_sae
    shapes = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    shapes.update({"jumprelu": {"b_enc": (d_sae,), "threshold": (d_sae,)},
                   "gated": {"b_gate": (d_sae,), "b_mag": (d_sae,), "r_mag": (d_sae,)}}.get(config.architecture,
                                                                                           {"b_enc": (d_sae,)}))
    if d_in <= 0 or d_sae <= 0:
        raise SAEError(f"{where}: d_in and d_sae must be positive, got {d_in} and {d_sae}")
    if config.architecture == "topk" and not (config.k and 0 < config.k <= d_sae):
        raise SAEError(f"{where}: topk needs k in 1..{d_sae}, got {config.k}")
    if missing := [n for n in shapes if n not in tensors]:
        raise SAEError(f"{where}: missing tensor {missing[0]} for a {config.architecture} SAE")
    if extra := [n for n in tensors if n not in shapes and not (config.architecture == "gated" and n == "b_enc")]:
        raise SAEError(f"{where}: unexpected tensor {extra[0]} for a {config.architecture} SAE")
    out = {}
    for name, shape in shapes.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise SAEError(f"{where}: {name} has shape {list(t.shape)}, expected {list(shape)} (d_in {d_in}, "
                           f"d_sae {d_sae})")
        out[name] = t.float().contiguous()
    return out

