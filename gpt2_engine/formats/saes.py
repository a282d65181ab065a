"""Sparse autoencoders' files: SAELens's directory (cfg.json + sae_weights.safetensors) and OpenAI's
sparse_autoencoder state dict, read without running their code into an SAEConfig (SAELens's names) and float32
weights whose every shape is checked (interp/sae.py computes with them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.config import read_json
from ..core.errors import GPT2EngineError
from .files import what_is
from .pickles import load_pickle

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


# SAELens's cfg.json fields the engine reads: (name, the names older SAELens versions gave it, JSON type, default).
# A field is looked up by each of its names in turn, at the top level and then under "metadata" (SAELens >= 6).
SAELENS_FIELDS = (
    ("architecture", (), str, "standard"),
    ("activation_fn", ("activation_fn_str",), str, "relu"),
    ("activation_fn_kwargs", (), dict, {}),  # {"k": K} for topk before SAELens 6
    ("k", (), int, None),
    ("d_in", (), int, 0),
    ("d_sae", (), int, 0),
    ("hook_name", ("hook_point",), str, None),
    ("hook_head_index", ("hook_point_head_index",), int, None),
    ("apply_b_dec_to_input", (), bool, True),
    ("normalize_activations", (), (str, bool), "none"),  # a bool before SAELens 6
    ("reshape_activations", (), str, None),  # default: "hook_z" at a hook_z, else "none"
    ("rescale_acts_by_decoder_norm", (), bool, True),
    ("model_from_pretrained_kwargs", (), dict, {}),
    ("prepend_bos", (), bool, True),
)


JSON_TYPES = {str: "a string", int: "an integer", bool: "true or false", dict: "an object"}


def of_type(value: Any, kind: type | tuple[type, ...]) -> bool:
    """Whether a JSON value is of `kind`; JSON's true and false are not integers here."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


def saelens_fields(raw: dict, cfg_path: Path) -> dict[str, Any]:
    """SAELENS_FIELDS' values in a cfg.json (flat before SAELens 6, under `metadata` since), each of its type."""
    meta = raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {}
    out = {}
    for name, aliases, kind, default in SAELENS_FIELDS:
        found = [where[n] for n in (name, *aliases) for where in (raw, meta) if where.get(n) is not None]
        value = found[0] if found else default
        if value is not None and not of_type(value, kind):
            expected = " or ".join(JSON_TYPES[k] for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise SAEError(f"{cfg_path}: {name} is {value!r}, expected {expected}")
        out[name] = value
    kwargs_k = out["activation_fn_kwargs"].get("k")
    if out["k"] is None and kwargs_k is not None:
        if not of_type(kwargs_k, int):
            raise SAEError(f"{cfg_path}: activation_fn_kwargs k is {kwargs_k!r}, expected an integer")
        out["k"] = kwargs_k
    return out


def saelens_architecture(f: dict[str, Any], cfg_path: Path) -> str:
    """The architecture: SAELens before 6 wrote a topk SAE as a standard one with a topk activation function."""
    architecture, act = f["architecture"], f["activation_fn"]
    if act == "topk" and architecture == "standard":
        architecture = "topk"
    if architecture not in ARCHITECTURES:
        raise SAEError(f"{cfg_path}: architecture {architecture!r} is not supported (expected one of "
                       f"{', '.join(ARCHITECTURES)})")
    if architecture == "standard" and act != "relu":
        raise SAEError(f"{cfg_path}: activation_fn {act!r} is not supported for a standard SAE (expected relu)")
    return architecture


def saelens_config(f: dict[str, Any], hook_name: str | None, cfg_path: Path) -> SAEConfig:
    """The SAEConfig of a cfg.json's fields (saelens_fields); `hook_name` overrides the file's hook."""
    architecture = saelens_architecture(f, cfg_path)
    normalize = f["normalize_activations"]
    if isinstance(normalize, bool):  # SAELens before 6
        normalize = "expected_average_only_in" if normalize else "none"
    if normalize not in NORMALIZATIONS:
        raise SAEError(f"{cfg_path}: normalize_activations {normalize!r} is not supported (expected one of "
                       f"{', '.join(NORMALIZATIONS)})")
    hook = hook_name or f["hook_name"]
    if not hook:
        raise SAEError(f"{cfg_path}: no hook_name; pass hook_name= (the hook point the SAE reads)")
    reshape = f["reshape_activations"]
    if reshape is None:
        reshape = "hook_z" if hook.endswith("hook_z") else "none"
    if reshape not in ("none", "hook_z"):
        raise SAEError(f"{cfg_path}: reshape_activations {reshape!r} is not supported (expected none or hook_z)")
    return SAEConfig(
        architecture=architecture, d_in=f["d_in"], d_sae=f["d_sae"], hook_name=hook,
        hook_head_index=f["hook_head_index"], apply_b_dec_to_input=f["apply_b_dec_to_input"],
        normalize_activations=normalize, reshape_activations=reshape, k=f["k"],
        rescale_acts_by_decoder_norm=architecture == "topk" and f["rescale_acts_by_decoder_norm"],
        model_from_pretrained_kwargs=dict(f["model_from_pretrained_kwargs"]), prepend_bos=f["prepend_bos"])


def read_saelens(directory: Path, hook_name: str | None) -> tuple[SAEConfig, dict[str, torch.Tensor]]:
    """SAELens's format: cfg.json (flat before SAELens 6, `metadata` since) + sae_weights.safetensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg_path, weights_path = directory / SAELENS_CONFIG, directory / SAELENS_WEIGHTS
    for f in (cfg_path, weights_path):
        if not f.is_file():
            there = f"{f.name} is {what_is(f)}, not a regular file" if f.exists() else f"no {f.name}"
            raise SAEError(f"--sae {directory}: {there} (expected SAELens's directory with {SAELENS_CONFIG} and "
                           f"{SAELENS_WEIGHTS})")
    try:
        raw = read_json(cfg_path)
    except (OSError, ValueError) as e:
        raise SAEError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise SAEError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    config = saelens_config(saelens_fields(raw, cfg_path), hook_name, cfg_path)
    try:
        tensors = load_file(weights_path)
    except (SafetensorError, OSError) as e:
        raise SAEError(f"{weights_path}: not a readable safetensors file ({e})") from None
    if "scaling_factor" in tensors:  # SAELens < 6 saved it; all ones means none
        if not torch.all(tensors.pop("scaling_factor") == 1):
            raise SAEError(f"{weights_path}: a finetuning scaling_factor other than 1 is not supported")
    return config, checked(config, tensors, str(weights_path))


OPENAI_TENSORS = ("encoder.weight", "decoder.weight", "pre_bias", "latent_bias")


def openai_activation(state: dict, path: Path) -> tuple[str, int | None]:
    """(architecture, k) of OpenAI's `activation` and its state: TopK (with a ReLU after it) or ReLU."""
    activation = state.get("activation", "ReLU")
    options = state.get("activation_state_dict") or {}
    if activation == "ReLU":
        return "standard", None
    if activation != "TopK":
        raise SAEError(f"{path}: activation {activation!r} is not supported (expected TopK or ReLU)")
    if not isinstance(options, dict):
        raise SAEError(f"{path}: activation_state_dict is a {type(options).__name__}, expected a dict")
    if options.get("postact_fn", "ReLU") != "ReLU":
        raise SAEError(f"{path}: TopK postact_fn {options.get('postact_fn')!r} is not supported (expected ReLU)")
    if not of_type(options.get("k"), int):
        raise SAEError(f"{path}: TopK k is {options.get('k')!r}, expected an integer")
    return "topk", options["k"]


def read_openai(path: Path, hook_name: str | None) -> tuple[SAEConfig, dict[str, torch.Tensor]]:
    """OpenAI's sparse_autoencoder state dict (Autoencoder.state_dict()): read with weights_only, so a pickle can
    hold tensors, strings and numbers only. TopK files take layer-normed input, as that repo's model.py does."""
    if not hook_name:
        raise SAEError(f"--sae {path}: OpenAI's format does not record its hook point; pass hook_name (e.g. "
                       f"'blocks.6.hook_resid_post' for its resid_post_mlp layer 6)")
    try:
        state = load_pickle(path)
    except ValueError as e:
        raise SAEError(f"{path}: not a state dict torch can read safely ({e})") from None
    if not isinstance(state, dict) or "encoder.weight" not in state:
        raise SAEError(f"{path}: expected OpenAI's sparse_autoencoder state dict (encoder.weight, decoder.weight, "
                       f"pre_bias, latent_bias)")
    architecture, k = openai_activation(state, path)
    for name in OPENAI_TENSORS:
        if not isinstance(state.get(name), torch.Tensor):
            raise SAEError(f"{path}: missing tensor {name}")
    if state["encoder.weight"].dim() != 2:
        raise SAEError(f"{path}: encoder.weight has shape {list(state['encoder.weight'].shape)}, expected "
                       f"[n_latents, d_model]")
    n_latents, d = state["encoder.weight"].shape
    config = SAEConfig(architecture=architecture, d_in=int(d), d_sae=int(n_latents), hook_name=hook_name,
                       normalize_activations="layer_norm" if architecture == "topk" else "none",
                       reshape_activations="hook_z" if hook_name.endswith("hook_z") else "none", k=k,
                       prepend_bos=False, format="openai")
    tensors = {"W_enc": state["encoder.weight"].T, "W_dec": state["decoder.weight"].T, "b_enc": state["latent_bias"],
               "b_dec": state["pre_bias"]}
    return config, checked(config, tensors, str(path))


# Each architecture's tensors of shape [d_sae] besides W_enc [d_in, d_sae], W_dec [d_sae, d_in] and b_dec [d_in];
# a gated SAE's file may also hold a b_enc, which it does not use.
SAE_LATENT_TENSORS = {"standard": ("b_enc",), "topk": ("b_enc",), "jumprelu": ("b_enc", "threshold"),
                      "gated": ("b_gate", "b_mag", "r_mag")}
SAE_UNUSED = {"gated": ("b_enc",)}


def sae_shapes(config: SAEConfig, where: str) -> dict[str, tuple[int, ...]]:
    """Every tensor an SAE of this config holds, with its shape; the config's sizes checked first."""
    d_in, d_sae = config.d_in, config.d_sae
    if d_in <= 0 or d_sae <= 0:
        raise SAEError(f"{where}: d_in and d_sae must be positive, got {d_in} and {d_sae}")
    if config.architecture == "topk" and not (config.k and 0 < config.k <= d_sae):
        raise SAEError(f"{where}: topk needs k in 1..{d_sae}, got {config.k}")
    shapes = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    return shapes | {name: (d_sae,) for name in SAE_LATENT_TENSORS[config.architecture]}


def checked(config: SAEConfig, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The weights as contiguous float32, each shape checked against the config and each value finite, as a model's
    weights are; a missing or extra tensor is an error."""
    shapes = sae_shapes(config, where)
    if missing := [n for n in shapes if n not in tensors]:
        raise SAEError(f"{where}: missing tensor {missing[0]} for a {config.architecture} SAE")
    if extra := [n for n in tensors if n not in shapes and n not in SAE_UNUSED.get(config.architecture, ())]:
        raise SAEError(f"{where}: unexpected tensor {extra[0]} for a {config.architecture} SAE")
    out = {}
    for name, shape in shapes.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise SAEError(f"{where}: {name} has shape {list(t.shape)}, expected {list(shape)} (d_in {config.d_in}, "
                           f"d_sae {config.d_sae})")
        if not t.is_floating_point():
            raise SAEError(f"{where}: {name} has dtype {t.dtype}, expected a floating-point dtype")
        out[name] = t.float().contiguous()
        if not bool(torch.isfinite(out[name]).all()):
            bad = int((~torch.isfinite(out[name])).sum())
            raise SAEError(f"{where}: {name} holds {bad} NaN/Inf values, expected finite weights")
    return out
