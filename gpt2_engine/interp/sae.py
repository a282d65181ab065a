"""Sparse autoencoders (SAEs) on the engine's forward: SAELens's and OpenAI's files, read without running their
code, spliced in at a hook point, and evaluated as SAELens evaluates them.

An SAE reads the activation a at one hook point (interp/hooks.py's names, TransformerLens's), encodes it into d_sae
sparse features and decodes a reconstruction:

    x = a, flattened over heads for hook_z       [..., d_in]        hook_sae_input
    n = normalize(x)                             (none | layer_norm | constant_norm_rescale)
    pre = (n - b_dec) @ W_enc + b_enc            [..., d_sae]       hook_sae_acts_pre  (b_dec only if apply_b_dec_to_input)
    f = activation(pre)                          relu | topk | jumprelu | gated          hook_sae_acts_post
    r = f @ W_dec + b_dec                        [..., d_in]        hook_sae_recons
    out = unnormalize(r), reshaped like a                           hook_sae_output (+ hook_sae_error = a - out)

The model an SAE was trained on. SAELens trains on TransformerLens's HookedTransformer, loaded as the SAE's
`model_from_pretrained_kwargs` say; some of those options change what appears at a hook while leaving the model's
function alone. The engine's activations are Hugging Face's, so at the SAE's hook it presents what that loading
would have shown, as an affine map a = p * scale + shift, runs the SAE on p, and maps the result back:

- center_writing_weights: every write into the residual stream (W_E, W_pos, W_O, b_O, W_out, b_out) has its mean
  over d_model removed. The residual stream is a sum of writes, so it appears centred too: p = a - mean(a) at
  hook_embed, hook_pos_embed, hook_resid_*, hook_attn_out and hook_mlp_out. Exact because every reader of the
  stream is a LayerNorm, which subtracts the mean first: adding mean(a) back changes nothing downstream.
- fold_value_biases: b_V moves into b_O (b_O + b_V W_O). Each row of the attention pattern sums to 1, so a head's
  output pattern @ (v + b_V) = pattern @ v + b_V: p = a - b_V at attn.hook_v and attn.hook_z.
- fold_ln: the LayerNorms' weight and bias move into the next projections, so ln*.hook_normalized shows the
  normalized input without the affine: p = (a - bias) / weight. TransformerLens then centres the weights that read
  it (q/k/v, the MLP's input, the unembedding) over their input, free since a normalized input has mean 0, so a
  replacement's mean is ignored downstream: the way back is a = (p - mean(p)) * weight + bias.

Options that change no activation at the hook (center_unembed: only the logits, by a constant per position; dtype
and device) are accepted; any other is refused by name. SAE math runs in float32 whatever the model's weights.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..core.config import GPT2Config
from ..core.scalars import as_int
from ..formats.saes import SAELENS_CONFIG, SAELENS_WEIGHTS, SAEConfig, SAEError, read_openai, read_saelens
from .hooks import hook_names
from ..core.weights import GPT2Weights, split_qkv

SAE_POINTS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error",
              "hook_sae_output")
HEAD_POINTS = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z")  # [B, T, nh, hs]
CENTRED_POINTS = ("hook_embed", "hook_pos_embed", "hook_resid_pre", "hook_resid_mid", "hook_resid_post",
                  "hook_attn_out", "hook_mlp_out")
NO_EFFECT_OPTIONS = ("center_unembed", "dtype", "torch_dtype", "device", "n_devices", "move_to_device",
                     "default_prepend_bos", "default_padding_side", "trust_remote_code")
LN_EPS = 1e-5  # SAELens's and OpenAI's layer_norm normalization: x / (unbiased std + 1e-5)


@dataclass(frozen=True)
class Affine:
    """The activation TransformerLens would show at a hook, p, from the engine's a: a = p * scale + shift."""

    shift: torch.Tensor | None = None  # broadcast against the activation
    scale: torch.Tensor | None = None
    centre: bool = False  # the readers ignore p's mean (fold_ln's centred weights): restore removes it


    def present(self, a: torch.Tensor) -> torch.Tensor:
        p = a if self.shift is None else a - self.shift
        return p if self.scale is None else p / self.scale

    def restore(self, p: torch.Tensor) -> torch.Tensor:
        if self.centre:
            p = p - p.mean(dim=-1, keepdim=True)
        a = p if self.scale is None else p * self.scale
        return a if self.shift is None else a + self.shift


def feature_indices(features: Any, d_sae: int) -> list[int]:
    """`features` (a list, array or tensor of integers) as Python ints in 0..d_sae-1; SAEError otherwise (-1 would
    pick the last feature, silently)."""
    if isinstance(features, torch.Tensor):
        features = features.tolist()
    if isinstance(features, (str, bytes)) or not isinstance(features, Iterable):
        raise SAEError(f"features: expected a list of feature indices, got {type(features).__name__}")
    given = list(features)
    chosen = [as_int(f) for f in given]  # numpy's and torch's integers too; True is not feature 1
    bad = next((k for k, f in enumerate(chosen) if f is None or not 0 <= f < d_sae), None)
    if not chosen or bad is not None:
        raise SAEError(f"features: expected indices in 0..{d_sae - 1}, got {'none' if not chosen else repr(given[bad])}")
    return chosen  # type: ignore[return-value]


class SAE:
    """A sparse autoencoder: its config and float32 weights W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_in],
    b_dec [d_in], and per architecture threshold [d_sae] (jumprelu) or b_gate, b_mag, r_mag [d_sae] (gated)."""

    def __init__(self, config: SAEConfig, weights: Mapping[str, torch.Tensor]) -> None:
        self.config = config
        self.W_enc, self.b_enc = weights["W_enc"], weights.get("b_enc")
        self.W_dec, self.b_dec = weights["W_dec"], weights["b_dec"]
        self.threshold = weights.get("threshold")
        self.b_gate, self.b_mag, self.r_mag = weights.get("b_gate"), weights.get("b_mag"), weights.get("r_mag")
        # topk with rescale: |W_dec row| once (SAELens multiplies the pre-activations by it, then divides it out)
        self.dec_norm = self.W_dec.norm(dim=-1) if config.rescale_acts_by_decoder_norm else None  # [d_sae]
        self.digest = sae_digest(config, weights)  # what it computes, once: steering keys the prefix cache by it

    @classmethod
    def load(cls, path: str | Path, hook_name: str | None = None, *,
             norm_scaling_factor: float | None = None) -> SAE:
        """An SAE from SAELens's directory (cfg.json + sae_weights.safetensors) or OpenAI's state dict (a .pt file;
        `hook_name` is required, that format does not record it). `hook_name` overrides the file's hook.
        `norm_scaling_factor`: the expected_average_only_in factor SAELens's registry gives for a release (folded
        into the weights as SAELens folds it; without it that normalization is left out, as SAELens's disk loader
        leaves it)."""
        if not isinstance(path, (str, Path)):
            raise SAEError(f"path: expected a directory or file path, got {type(path).__name__}")
        if hook_name is not None and not isinstance(hook_name, str):
            raise SAEError(f"hook_name: expected a hook point's name (e.g. blocks.6.hook_resid_pre) or None, got "
                           f"{type(hook_name).__name__}")
        p = Path(path)
        if not p.exists():
            raise SAEError(f"--sae {path}: no such file or directory (expected SAELens's directory with {SAELENS_CONFIG} "
                           f"and {SAELENS_WEIGHTS}, or OpenAI's .pt state dict)")
        if p.is_dir() or p.name in (SAELENS_CONFIG, SAELENS_WEIGHTS):
            config, weights = read_saelens(p if p.is_dir() else p.parent, hook_name)
        elif p.suffix in (".pt", ".pth"):
            config, weights = read_openai(p, hook_name)
        else:
            raise SAEError(f"--sae {path}: expected SAELens's directory ({SAELENS_CONFIG} + {SAELENS_WEIGHTS}) or "
                           f"OpenAI's .pt state dict, got a {p.suffix or 'suffix-less'} file")
        if config.normalize_activations == "expected_average_only_in" and norm_scaling_factor is not None:
            weights["W_enc"] = weights["W_enc"] * norm_scaling_factor
            weights["W_dec"] = weights["W_dec"] / norm_scaling_factor
            weights["b_dec"] = weights["b_dec"] / norm_scaling_factor
        return cls(config, weights)

    def to(self, device: torch.device | str) -> SAE:
        """This SAE with its weights on `device` (itself where they are all there): what a model on a GPU splices.
        The digest is the loaded SAE's (the same values)."""
        names = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "b_gate", "b_mag", "r_mag", "dec_norm")
        try:
            device = torch.device(device)
            moved = {n: None if (t := getattr(self, n)) is None else t.to(device) for n in names}
        except (RuntimeError, TypeError, AssertionError) as e:  # torch without CUDA asserts
            raise SAEError(f"device {device}: {str(e).splitlines()[0][:200]}") from None
        if all(moved[n] is getattr(self, n) for n in names):
            return self
        out = object.__new__(SAE)
        out.__dict__.update(self.__dict__, **moved)
        return out

    @property
    def hook_name(self) -> str:
        return self.config.hook_name

    @property
    def d_in(self) -> int:
        return self.config.d_in

    @property
    def d_sae(self) -> int:
        return self.config.d_sae

    def __repr__(self) -> str:
        c = self.config
        return f"SAE({c.architecture}, {c.hook_name}, d_in={c.d_in}, d_sae={c.d_sae}{f', k={c.k}' if c.k else ''})"

    def select(self, features: Sequence[int]) -> SAE | None:
        """The SAE cut down to `features` (its encoder columns, decoder rows): each of them activates exactly as in
        the whole SAE, at a fraction of the encoding work. None for topk, where a feature fires only if it beats
        every other feature's pre-activation."""
        chosen = feature_indices(features, self.d_sae)
        if self.config.architecture == "topk":
            return None
        index = torch.tensor(chosen)
        weights = {"W_enc": self.W_enc[:, index], "W_dec": self.W_dec[index], "b_dec": self.b_dec}
        for name in ("b_enc", "threshold", "b_gate", "b_mag", "r_mag"):
            if (t := getattr(self, name)) is not None:
                weights[name] = t[index]
        return SAE(replace(self.config, d_sae=len(index)), weights)

    # -- the SAE's own math, on activations as the SAE sees them ([..., d_in]) ------------------------------------

    def normalize(self, x: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """(the SAE's input after its normalization, the map that undoes it on a reconstruction)."""
        how = self.config.normalize_activations
        if how == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            std = (x - mu).std(dim=-1, keepdim=True)  # unbiased, as SAELens's and OpenAI's LN
            return (x - mu) / (std + LN_EPS), lambda r: r * std + mu
        if how == "constant_norm_rescale":
            coeff = math.sqrt(self.d_in) / x.norm(dim=-1, keepdim=True)
            return x * coeff, lambda r: r / coeff
        return x, lambda r: r

    def pre_activations(self, n: torch.Tensor) -> torch.Tensor:
        """[..., d_in] normalized input -> [..., d_sae]: the encoder's output before the activation (for gated SAEs,
        the magnitude path's, as SAELens's hook_sae_acts_pre)."""
        if self.config.apply_b_dec_to_input:
            n = n - self.b_dec
        if self.config.architecture == "gated":
            return n @ (self.W_enc * self.r_mag.exp()) + self.b_mag
        return n @ self.W_enc + self.b_enc

    def activate(self, n: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """[..., d_sae] pre-activations -> feature activations f."""
        arch = self.config.architecture
        if arch == "topk":
            if self.dec_norm is not None:
                pre = pre * self.dec_norm
            top = pre.topk(self.config.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, top.indices, top.values.relu())
        if arch == "jumprelu":
            return pre.relu() * (pre > self.threshold)
        if arch == "gated":  # the gate decides which features fire, the magnitude path how strongly
            gate = (n - self.b_dec if self.config.apply_b_dec_to_input else n) @ self.W_enc + self.b_gate
            return (gate > 0) * pre.relu()
        return pre.relu()

    def reconstruct(self, f: torch.Tensor) -> torch.Tensor:
        """[..., d_sae] features -> [..., d_in] reconstruction r in the normalized space (hook_sae_recons)."""
        if self.dec_norm is not None:
            f = f / self.dec_norm
        return f @ self.W_dec + self.b_dec

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d_in] (or [..., nh, hs] for a hook_z SAE) -> [..., d_sae] feature activations."""
        x = self.flatten(self.checked(x, self.d_in, "x").float())
        n, _ = self.normalize(x)
        return self.activate(n, self.pre_activations(n))

    def decode(self, f: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """[..., d_sae] features -> [..., d_in] reconstruction. An SAE that normalizes its input maps back with the
        statistics of the input `x` the features came from, which it then needs."""
        r = self.reconstruct(self.checked(f, self.d_sae, "f").float())
        if self.config.normalize_activations in ("layer_norm", "constant_norm_rescale"):
            if x is None:
                raise SAEError(f"decode: this SAE normalizes its input ({self.config.normalize_activations}); pass the "
                               f"input x the features came from")
            r = self.normalize(self.flatten(x.float()))[1](r)
        return r

    def checked(self, t: Any, width: int, name: str) -> torch.Tensor:
        """`t` itself, once it is a dense tensor of rows `width` wide (or a head-shaped [..., nh, hs] of that width)."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dim() == 0:
            got = f"a {t.dim()}-dimensional tensor" if isinstance(t, torch.Tensor) and t.dim() == 0 else \
                type(t).__name__ if not isinstance(t, torch.Tensor) else f"a {t.layout} tensor"
            raise SAEError(f"{name}: expected a tensor [..., {width}], got {got}")
        if t.shape[-1] != width and not (t.dim() >= 2 and t.shape[-2] * t.shape[-1] == width == self.d_in):
            raise SAEError(f"{name}: expected a tensor [..., {width}], got shape {list(t.shape)}")
        return t

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """A head-shaped activation [..., nh, hs] flattened to [..., nh*hs] where the SAE reads every head."""
        return x.flatten(-2) if x.shape[-1] != self.d_in and x.dim() >= 2 and x.shape[-2] * x.shape[-1] == self.d_in else x

    # -- against a model ----------------------------------------------------------------------------------------

    def check(self, config: GPT2Config) -> None:
        """Raise SAEError unless this SAE's hook exists in a model with this config and its width matches there."""
        c = self.config
        if c.hook_name not in set(hook_names(config)):
            raise SAEError(f"SAE hook {c.hook_name!r}: not a hook point of this model (expected names like "
                           f"'blocks.6.hook_resid_pre' for layers 0..{config.n_layer - 1})")
        point = c.hook_name.split(".", 2)[-1] if c.hook_name.startswith("blocks.") else c.hook_name
        if point in ("attn.hook_attn_scores", "attn.hook_pattern") or point.endswith("hook_scale"):
            raise SAEError(f"SAE hook {c.hook_name!r}: SAEs read residual, attention (q/k/v/z), MLP or layer-norm "
                           f"outputs, not {point}")
        if c.hook_head_index is not None and point not in HEAD_POINTS:
            raise SAEError(f"SAE hook_head_index {c.hook_head_index}: a head index applies to attention hooks "
                           f"(hook_q/k/v/z), not {c.hook_name}")
        if point in HEAD_POINTS and c.hook_head_index is not None:
            if not 0 <= c.hook_head_index < config.n_head:
                raise SAEError(f"SAE hook_head_index {c.hook_head_index}: expected 0..{config.n_head - 1}")
            want = config.head_size
        elif point.startswith("mlp."):
            want = config.mlp_width
        else:
            want = config.n_embd
        if c.d_in != want:
            raise SAEError(f"SAE d_in {c.d_in} does not match {c.hook_name} of this model, which is {want} wide")
        presentation(c, config, None)  # the model options, checked now rather than at the first forward


@dataclass(frozen=True)
class Site:
    """Where an SAE reads, for the presentation of one model option: its config, the model, the activation there."""

    c: SAEConfig
    config: GPT2Config
    weights: GPT2Weights | None  # None: the options are only checked
    a: torch.Tensor | None

    @property
    def point(self) -> str:
        return self.c.hook_name.split(".", 2)[-1] if self.c.hook_name.startswith("blocks.") else self.c.hook_name

    @property
    def layer(self) -> int | None:
        return int(self.c.hook_name.split(".")[1]) if self.c.hook_name.startswith("blocks.") else None


def centred(s: Site) -> Affine | None:
    """center_writing_weights: the residual stream's writes have their mean removed (see the module docstring)."""
    if s.weights is not None and s.point in CENTRED_POINTS:
        return Affine(shift=s.a.mean(dim=-1, keepdim=True))
    return None


def value_bias_folded(s: Site) -> Affine | None:
    """fold_value_biases: b_V moved into b_O, so the heads' values show without it."""
    if s.weights is not None and s.point in ("attn.hook_v", "attn.hook_z"):
        b_v = split_qkv(s.weights.blocks[s.layer].c_attn.bias)[2].float()  # [C]
        return Affine(shift=b_v.view(s.config.n_head, s.config.head_size))  # [nh, hs]
    return None


def ln_folded(s: Site) -> Affine | None:
    """fold_ln: the layer norm's affine moved into the next projections, so hook_normalized shows it undone."""
    if s.weights is None or not s.point.endswith("hook_normalized"):
        return None
    blocks = s.weights.blocks
    ln = s.weights.ln_f if s.layer is None else (blocks[s.layer].ln_1 if s.point.startswith("ln1") else blocks[s.layer].ln_2)
    if bool((ln.weight == 0).any()):
        raise SAEError(f"fold_ln at {s.c.hook_name}: a layer-norm weight is 0, so the unscaled activation cannot be "
                       f"recovered")
    return Affine(shift=ln.bias.float(), scale=ln.weight.float(), centre=True)


def attention_refactored(s: Site) -> Affine | None:
    """refactor_factored_attn_matrices: changes q/k/v/z themselves, which no affine map of one activation undoes."""
    if s.point in HEAD_POINTS:
        raise SAEError(f"SAE model option refactor_factored_attn_matrices changes {s.point}; the engine cannot present "
                       f"it (expected an SAE trained without it, or at another hook)")
    return None


# TransformerLens's loading options (set to True) that change what a hook shows -> the map that undoes each
PRESENTATIONS = {"center_writing_weights": centred, "fold_value_biases": value_bias_folded, "fold_ln": ln_folded,
                 "refactor_factored_attn_matrices": attention_refactored}


def presentation(c: SAEConfig, config: GPT2Config, weights: GPT2Weights | None,
                 a: torch.Tensor | None = None) -> Affine:
    """The map from the engine's activation `a` at the SAE's hook to what the SAE's TransformerLens model showed
    there (see the module docstring); the options are checked (and nothing computed) when `weights` is None."""
    site, affine = Site(c, config, weights, a), Affine()
    for option, value in c.model_from_pretrained_kwargs.items():
        if option in NO_EFFECT_OPTIONS or value in (False, None):
            continue
        present = PRESENTATIONS.get(option) if value is True else None
        if present is None:
            raise SAEError(f"SAE model option {option}={value!r} is not supported (expected center_writing_weights, "
                           f"fold_value_biases, fold_ln, refactor_factored_attn_matrices or "
                           f"{', '.join(NO_EFFECT_OPTIONS[:2])})")
        affine = present(site) or affine
    return affine


@dataclass
class Spliced:
    """One SAE at its hook during a forward: what it saw and made, by SAELens's names (`hook_sae_*`), in the
    presented (TransformerLens) space; `record` says which of them to keep."""

    sae: SAE
    weights: GPT2Weights
    config: GPT2Config
    use_error_term: bool = False
    record: Callable[[str], bool] = lambda name: False
    replace: Callable[[torch.Tensor], torch.Tensor] | None = None  # instead of the SAE's output (an ablation)
    leaf: bool = False  # features as an autograd leaf (seen["leaf"]), the error added back as a constant
    seen: dict[str, torch.Tensor] = field(default_factory=dict)

    def __call__(self, a: torch.Tensor, name: str) -> torch.Tensor:
        """The engine's activation a at the hook -> the activation that flows on (its SAE reconstruction)."""
        c, affine = self.sae.config, presentation(self.sae.config, self.config, self.weights, a)
        p = affine.present(a)  # TransformerLens's activation, hook-shaped
        x = p[..., c.hook_head_index, :] if c.hook_head_index is not None else self.sae.flatten(p)  # [..., d_in]
        keep = {}
        n, unnormalize = self.sae.normalize(x)
        pre = self.sae.pre_activations(n)
        f = self.sae.activate(n, pre)
        if self.leaf:  # gradients with respect to the features themselves (attribution)
            f = self.seen["leaf"] = f.detach().requires_grad_(True)
        r = self.sae.reconstruct(f)
        out = unnormalize(r).view(x.shape)
        if self.replace is not None:
            out = self.replace(x)
        keep.update(hook_sae_input=x, hook_sae_acts_pre=pre, hook_sae_acts_post=f, hook_sae_recons=r)
        exact = self.leaf or self.use_error_term  # reconstruction + error: the activation itself flows on
        if exact and not self.leaf:
            error = x - out
            keep["hook_sae_error"] = error.view(p.shape) if c.hook_head_index is None else error
            out = out + error
        keep["hook_sae_output"] = out.view(p.shape) if c.hook_head_index is None else out
        for point, value in keep.items():
            if self.record(f"{name}.{point}"):
                self.seen[f"{name}.{point}"] = value
        if c.hook_head_index is None:
            restored = affine.restore(out.view(p.shape))
        else:
            p = p.clone()
            p[..., c.hook_head_index, :] = out
            restored = a.clone()  # the other heads flow on as they were, to the bit
            restored[..., c.hook_head_index, :] = affine.restore(p)[..., c.hook_head_index, :]
        if not exact:
            return restored
        # reconstruction + error is the activation: `a` itself flows on, to the bit (recomputed, it would differ by a
        # rounding, which a quantized model's int8 activations can turn into a visible change); with `leaf`, the
        # gradient still runs through the decoder, since restored - restored.detach() is 0 in value
        return a if not self.leaf else a + (restored - restored.detach())


def sae_digest(config: SAEConfig, weights: Mapping[str, torch.Tensor]) -> str:
    """sha256 of an SAE's config and weights (about 0.1 s for a 24,576-feature SAE of GPT-2 small)."""
    h = hashlib.sha256(repr(config).encode())
    for name in sorted(weights):
        h.update(name.encode())
        h.update(memoryview(weights[name].detach().float().contiguous().numpy()))
    return h.hexdigest()[:32]


def sae_point_names(saes: Sequence[SAE]) -> list[str]:
    """The SAELens cache names the spliced SAEs add: {hook}.hook_sae_input, ..."""
    return [f"{sae.hook_name}.{point}" for sae in saes for point in SAE_POINTS]


def check_saes(saes: SAE | Sequence[SAE], config: GPT2Config) -> list[SAE]:
    """The SAEs as a list, each checked against the model; two at one hook are an error (which would run?)."""
    saes = [saes] if isinstance(saes, SAE) else list(saes)
    seen: set[str] = set()
    for sae in saes:
        if not isinstance(sae, SAE):
            raise SAEError(f"saes: expected gpt2_engine.SAE objects (SAE.load(path)), got {type(sae).__name__}")
        sae.check(config)
        if sae.hook_name in seen:
            raise SAEError(f"saes: two SAEs at {sae.hook_name}; splice one per hook point")
        seen.add(sae.hook_name)
    return saes


# -- files ------------------------------------------------------------------------------------------------------


# -- evaluation, as SAELens's evals.py defines its metrics --------------------------------------------------------


def kl_per_position(base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...]: KL(base || new) over the next-token distribution, as SAELens's _kl."""
    return F.kl_div(new.log_softmax(-1), base.log_softmax(-1), reduction="none", log_target=True).sum(-1)


@dataclass
class SAEMetrics:
    """SAELens's eval metrics (sae_lens/evals.py), accumulated over batches: per-token means, explained variance
    from float64 sums (1 - E|x - x_hat|^2 / (E|x|^2 - |E x|^2)), cross-entropy over every next-token prediction,
    KL over every position, and each feature's density (the fraction of tokens it fires on)."""

    d_in: int
    d_sae: int
    tokens: int = 0
    predictions: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    sum_x: torch.Tensor | None = None  # [d_in] float64
    fired: torch.Tensor | None = None  # [d_sae] float64

    def add_tokens(self, x: torch.Tensor, out: torch.Tensor, f: torch.Tensor) -> None:
        """x, out [N, d_in] the SAE's input and reconstruction (presented space); f [N, d_sae] its features."""
        x64, out64 = x.double(), out.double()
        resid = (x64 - out64).pow(2).sum(-1)  # [N]
        cos = (x64 / x64.norm(dim=-1, keepdim=True) * (out64 / out64.norm(dim=-1, keepdim=True))).sum(-1)
        self.add("mse", resid.sum())
        self.add("cossim", cos.sum())
        self.add("l0", (f != 0).sum(-1).double().sum())
        self.add("l1", f.abs().sum(-1).double().sum())
        self.add("sq_norm", x64.pow(2).sum())
        self.sum_x = x64.sum(0) if self.sum_x is None else self.sum_x + x64.sum(0)
        fired = (f != 0).sum(0).double()
        self.fired = fired if self.fired is None else self.fired + fired
        self.tokens += x.shape[0]

    def add_logits(self, ids: torch.Tensor, plain: torch.Tensor, spliced: torch.Tensor, ablated: torch.Tensor) -> None:
        """ids [B, T]; logits [B, T, V] without the SAE, with it, and with the hook zeroed."""
        target = ids[:, 1:].reshape(-1)
        for key, logits in (("ce_loss_without_sae", plain), ("ce_loss_with_sae", spliced),
                            ("ce_loss_with_ablation", ablated)):
            ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target, reduction="sum")
            self.add(key, ce.double())
        self.add("kl_div_with_sae", kl_per_position(plain, spliced).double().sum())
        self.add("kl_div_with_ablation", kl_per_position(plain, ablated).double().sum())
        self.predictions += target.numel()
        self.add("positions", float(ids.numel()))

    def add(self, key: str, value: torch.Tensor | float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def result(self) -> dict[str, Any]:
        n, s = max(self.tokens, 1), self.sums
        variance = s.get("sq_norm", 0.0) / n - float((self.sum_x / n).pow(2).sum()) if self.sum_x is not None else 0.0
        mse = s.get("mse", 0.0) / n
        out: dict[str, Any] = {
            "mse": mse, "explained_variance": (1.0 if mse < 1e-10 else 0.0) if variance < 1e-10 else 1 - mse / variance,
            "l0": s.get("l0", 0.0) / n, "l1": s.get("l1", 0.0) / n, "cossim": s.get("cossim", 0.0) / n,
        }
        if self.predictions:
            p, positions = self.predictions, s["positions"]
            ce = {k: s[k] / p for k in ("ce_loss_without_sae", "ce_loss_with_sae", "ce_loss_with_ablation")}
            kl = {k: s[k] / positions for k in ("kl_div_with_sae", "kl_div_with_ablation")}
            gap = ce["ce_loss_with_ablation"] - ce["ce_loss_without_sae"]
            out.update(ce, ce_loss_score=(ce["ce_loss_with_ablation"] - ce["ce_loss_with_sae"]) / gap if gap else float("nan"))
            out.update(kl, kl_div_score=(kl["kl_div_with_ablation"] - kl["kl_div_with_sae"]) / kl["kl_div_with_ablation"]
                       if kl["kl_div_with_ablation"] else float("nan"))
        out["tokens"] = self.tokens
        out["feature_density"] = (self.fired / n).tolist() if self.fired is not None else []
        return out
