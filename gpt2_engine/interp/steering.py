"""Steering: edit an activation at a hook point while the model runs, to test what a direction or an SAE feature does.

A Steering is one edit at one hook point (interp/hooks.py's names, TransformerLens's), applied to the rows (token
positions) it covers:

    add       a + coef * vector                          a direction: a file's vector, or an SAE's decoder row
    clamp     a + U(decode(f') - decode(f))               f = the SAE's features of a, f' = f with one latent set to
                                                          `value`: only that latent's contribution changes, so the
                                                          SAE's reconstruction error cancels (BioNeMo's recipe)
    project   a + d (value - <a - bias, d>)               lm-evaluation-harness's "clamp": a's component along the
                                                          unit direction d set to `value`

`positions` says which rows: "all", "prompt" (rows whose input token is a prompt token) or "generated" (rows fed a
generated token). A row's position, not the pass it runs in, decides, so decoding with the KV cache, batching and
speculative verify passes apply the same edits a whole-sequence recompute applies (runtime/runner.py).

An SAE's vectors live in the space its TransformerLens model showed at the hook (interp/sae.py's presentation): its
decoder row d is lifted into the engine's activation by the linear part of that map, U(d) = restore(d) - restore(0)
(d itself for center_writing_weights, since every reader of the residual stream removes the mean first; (d - mean d)
* ln.weight under fold_ln), which is what adding d there does to the model's function.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ..core.config import GPT2Config
from ..core.errors import GenerationError
from .hooks import hook_names
from .sae import HEAD_POINTS, SAE, presentation
from ..core.weights import GPT2Weights

POSITIONS = ("all", "prompt", "generated")
ACTIONS = ("add", "clamp", "project")
UNSTEERABLE = ("attn.hook_attn_scores", "attn.hook_pattern")  # [B, nh, T, S]: not one row per token
VECTOR_SUFFIXES = (".pt", ".pth", ".safetensors", ".npy")
BETWEEN_BLOCKS = ("hook_resid_pre", "hook_resid_post")  # where the native decode path keeps running
# The largest value an edit may add to an activation. GPT-2's activations stay below about 1e4; past 1e12, what the
# layers downstream do with an edit (a projection sums thousands of its values, a layer norm squares them) can leave
# float32's range, and the logits turn NaN: a steering that large is refused up front, like an infinite one.
MAX_EDIT = 1e12

# lm-evaluation-harness's steered model names Hugging Face modules; the hook point each one's output is
HF_MODULES = {"wte": "hook_embed", "wpe": "hook_pos_embed", "ln_f": "ln_final.hook_normalized"}
HF_BLOCK_MODULES = {"": "hook_resid_post", "attn": "hook_attn_out", "mlp": "hook_mlp_out", "ln_1": "ln1.hook_normalized",
                    "ln_2": "ln2.hook_normalized", "mlp.c_fc": "mlp.hook_pre", "mlp.act": "mlp.hook_post"}


class SteeringError(GenerationError):
    """A steering that does not fit the model, or a file or spec that does not say one."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="steering")


def point_of(hook: str) -> str:
    """A hook's point within its block ('blocks.3.mlp.hook_post' -> 'mlp.hook_post'), or the hook itself."""
    return hook.split(".", 2)[-1] if hook.startswith("blocks.") else hook


def hook_shape(hook: str, config: GPT2Config) -> tuple[int, ...]:
    """The trailing shape of one row of the activation at `hook`: [C], [4C] or [nh, hs]."""
    point = point_of(hook)
    if point in HEAD_POINTS:
        return (config.n_head, config.head_size)
    return (config.mlp_width,) if point.startswith("mlp.") else (config.n_embd,)


def row_dims(hook: str) -> int:
    """How many trailing dimensions one row of the activation at `hook` has (2 for the heads' q/k/v/z)."""
    return 2 if point_of(hook) in HEAD_POINTS else 1


@dataclass(frozen=True, eq=False)
class Steering:
    """One edit at one hook point (see the module docstring). `Steering(hook, vector, coef)` adds coef * vector;
    `from_sae`, `clamp`, `load` and `project` make the others. `head`: edit one attention head's slice of a q/k/v/z
    hook only (the vector then has the head size). `key` identifies the edit (the prefix cache keys by it)."""

    hook: str
    vector: torch.Tensor | None = None
    coef: float = 1.0
    positions: str = "all"
    head: int | None = field(default=None, kw_only=True)
    action: str = field(default="add", kw_only=True)
    sae: SAE | None = field(default=None, kw_only=True)  # from_sae: the vector is in its presented space; clamp
    feature: int | None = field(default=None, kw_only=True)
    value: float = field(default=0.0, kw_only=True)  # clamp and project: the value set
    bias: torch.Tensor | None = field(default=None, kw_only=True)  # project: lm-eval's bias
    key: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.hook, str) or not self.hook:
            raise SteeringError(f"steering hook must be a hook point name like 'blocks.6.hook_resid_pre', got {self.hook!r}")
        if self.positions not in POSITIONS:
            raise SteeringError(f"steering positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        if self.action not in ACTIONS:
            raise SteeringError(f"steering action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        for name in ("coef", "value"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SteeringError(f"steering {name} must be a finite number, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.action != "clamp":
            object.__setattr__(self, "vector", as_vector(self.vector, f"steering vector at {self.hook}"))
        if self.bias is not None:
            object.__setattr__(self, "bias", as_vector(self.bias, f"steering bias at {self.hook}"))
        self._check_size()
        object.__setattr__(self, "key", self._digest())

    def _check_size(self) -> None:
        """Refuse an edit whose values could overflow the model's float32 activations (see MAX_EDIT)."""
        if self.action == "clamp":  # sets a latent: adds (value - f) times its decoder row
            what, peak = f"clamp {self.value:g}", abs(self.value) * float(self.sae.W_dec[self.feature].abs().max())
        elif self.action == "project":  # along a unit direction
            what, peak = f"value {self.value:g}", abs(self.value)
        else:
            what, peak = f"coef {self.coef:g}", abs(self.coef) * float(self.vector.abs().max())
        if not peak <= MAX_EDIT:
            raise SteeringError(f"steering at {self.hook}: {what} adds values up to {peak:.3g}; at most {MAX_EDIT:g} "
                                f"keeps the model's float32 activations from overflowing into NaN logits")

    # --- the ways to make one ---------------------------------------------------------------------------------------

    @classmethod
    def from_sae(cls, sae: SAE, feature: int, coef: float = 1.0, positions: str = "all") -> Steering:
        """Add coef * the SAE's decoder row for `feature` (SAELens's raw W_dec row, as Neuronpedia steers) at its hook."""
        feature = check_feature(sae, feature)
        return cls(sae.hook_name, sae.W_dec[feature], coef, positions, head=sae.config.hook_head_index, sae=sae,
                   feature=feature)

    @classmethod
    def clamp(cls, sae: SAE, feature: int, value: float, positions: str = "all") -> Steering:
        """Set the SAE's latent `feature` to `value` at its hook: add decode(clamped) - decode(original), so nothing
        else of the activation changes."""
        feature = check_feature(sae, feature)
        return cls(sae.hook_name, None, 1.0, positions, head=sae.config.hook_head_index, action="clamp", sae=sae,
                   feature=feature, value=value)

    @classmethod
    def project(cls, hook: str, direction: Any, value: float, positions: str = "all", *,
                bias: Any = None, head: int | None = None) -> Steering:
        """Set the component of (a - bias) along `direction` (normalized here) to `value`: lm-evaluation-harness's
        steered model's 'clamp' action."""
        d = as_vector(direction, f"steering direction at {hook}")
        norm = float(d.norm())
        if norm == 0:
            raise SteeringError(f"steering direction at {hook} is zero; a clamp needs a direction")
        return cls(hook, d / norm, 1.0, positions, head=head, action="project", value=value, bias=bias)

    @classmethod
    def load(cls, path: str | Path, hook: str, coef: float = 1.0, positions: str = "all", *,
             head: int | None = None) -> Steering:
        """Add coef * a vector read from a .pt (a tensor, loaded without running code), .safetensors (one tensor)
        or .npy file at `hook`."""
        return cls(hook, read_vector(path), coef, positions, head=head)

    # --- against a model --------------------------------------------------------------------------------------------

    def check(self, config: GPT2Config) -> None:
        """Raise SteeringError unless this edit fits a model with this config: a steerable hook, a vector of the
        hook's width (or its head's)."""
        if self.hook not in set(hook_names(config)):
            raise SteeringError(f"steering hook {self.hook!r}: not a hook point of this model (expected names like "
                                f"'blocks.6.hook_resid_pre' for layers 0..{config.n_layer - 1})")
        point = point_of(self.hook)
        if point in UNSTEERABLE or point.endswith("hook_scale"):
            raise SteeringError(f"steering hook {self.hook!r}: {point} is not one row per token; steer a residual, "
                                f"attention (q/k/v/z, attn_out), MLP or layer-norm output")
        shape = hook_shape(self.hook, config)
        if self.head is not None:
            if point not in HEAD_POINTS:
                raise SteeringError(f"steering head {self.head}: only q/k/v/z hook points have heads, not {self.hook}")
            if not 0 <= self.head < config.n_head:
                raise SteeringError(f"steering head {self.head}: expected 0..{config.n_head - 1}")
            shape = shape[1:]
        if self.action == "clamp":
            self.sae.check(config)
            return
        want = math.prod(shape)
        for name, t in (("vector", self.vector), ("bias", self.bias)):
            if t is not None and t.numel() != want:
                raise SteeringError(f"steering {name} at {self.hook} has {t.numel()} values ({list(t.shape)}); "
                                    f"that hook is {want} wide{' per head' if self.head is not None else ''}")

    def apply(self, a: torch.Tensor, weights: GPT2Weights, config: GPT2Config) -> torch.Tensor:
        """The edited rows: a [n, *row] (hook_shape) -> [n, *row], in a's dtype."""
        part = a if self.head is None else a[:, self.head]  # [n, hs] for one head
        if self.action == "project":
            shifted = part if self.bias is None else part - self.bias.view(part.shape[1:])
            d = self.vector.view(part.shape[1:])
            proj = (shifted * d).flatten(1).sum(dim=-1).view(-1, *[1] * (part.dim() - 1))  # [n, 1...]
            edited = part + d * (self.value - proj)
        elif self.sae is None:  # a plain direction
            edited = part + self.coef * self.vector.view(part.shape[1:])
        else:
            edited = part + self.sae_delta(a, weights, config)
        if self.head is None:
            return edited.to(a.dtype)
        out = a.clone()
        out[:, self.head] = edited
        return out

    def sae_delta(self, a: torch.Tensor, weights: GPT2Weights, config: GPT2Config) -> torch.Tensor:
        """[n, *row] -> what from_sae or clamp adds to the rows (to the head's slice, for a one-head SAE), lifted
        from the SAE's presented space into the engine's (see the module docstring)."""
        sae, c = self.sae, self.sae.config
        affine = presentation(c, config, weights, a)
        p = affine.present(a.float())  # [n, *row]: as the SAE's TransformerLens model showed it
        if self.action == "add":
            d = (self.coef * self.vector).expand(a.shape[0], -1)  # [n, d_in]
        else:
            x = p[:, c.hook_head_index] if c.hook_head_index is not None else sae.flatten(p)  # [n, d_in]
            one = sae.select([self.feature])  # only this latent's encoder column, where that gives its exact value
            f = (one.encode(x)[:, 0] if one is not None else sae.encode(x)[:, self.feature])  # [n]
            d = (self.value - f)[:, None] * sae.W_dec[self.feature]  # [n, d_in]: the latent's change, decoded
            if sae.dec_norm is not None:
                d = d / sae.dec_norm[self.feature]
            unnormalize = sae.normalize(x)[1]
            d = unnormalize(d) - unnormalize(torch.zeros_like(d))  # the SAE's input scale, its shift cancelled
        if c.hook_head_index is not None:
            full = torch.zeros_like(p)
            full[:, c.hook_head_index] = d
            lifted = affine.restore(full) - affine.restore(torch.zeros_like(full))
            return lifted[:, c.hook_head_index]  # [n, hs]
        d = d.view(p.shape)
        return affine.restore(d) - affine.restore(torch.zeros_like(d))  # [n, *row]

    def __repr__(self) -> str:
        what = {"add": f"add coef={self.coef:g}" + (f" sae feature {self.feature}" if self.sae is not None else ""),
                "clamp": f"clamp sae feature {self.feature} to {self.value:g}",
                "project": f"project to {self.value:g}"}[self.action]
        head = f", head {self.head}" if self.head is not None else ""
        return f"Steering({self.hook}: {what}, positions={self.positions}{head})"

    def _digest(self) -> str:
        h = hashlib.sha256(repr((self.hook, self.action, self.coef, self.positions, self.head, self.feature,
                                 self.value)).encode())
        if self.sae is not None:  # the SAE's own digest, made once when it was loaded
            h.update(self.sae.digest.encode())
        for t in (self.vector, self.bias):
            h.update(b"-" if t is None else memoryview(t.detach().float().contiguous().numpy()))
        return h.hexdigest()[:32]


def check_feature(sae: SAE, feature: int) -> int:
    if not isinstance(sae, SAE):
        raise SteeringError(f"steering: expected a gpt2_engine.SAE (SAE.load(path)), got {type(sae).__name__}")
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < sae.d_sae:
        raise SteeringError(f"steering feature {feature!r}: this SAE's features are 0..{sae.d_sae - 1}")
    return feature


def as_vector(v: Any, what: str) -> torch.Tensor:
    """A float32 tensor from a tensor, an array or a list; one-line errors for anything else."""
    if isinstance(v, torch.Tensor):
        t = v.detach()
    elif isinstance(v, (np.ndarray, list, tuple)):
        try:
            t = torch.as_tensor(np.asarray(v, dtype=np.float32))
        except (TypeError, ValueError):
            raise SteeringError(f"{what}: expected numbers, got {type(v).__name__} that is not numeric") from None
    else:
        raise SteeringError(f"{what}: expected a tensor, an array or a list of numbers, got {type(v).__name__}")
    if not t.is_floating_point() and t.dtype not in (torch.int32, torch.int64):
        raise SteeringError(f"{what}: expected floating-point values, got {t.dtype}")
    t = t.float().contiguous()
    if t.numel() == 0 or not bool(torch.isfinite(t).all()):
        raise SteeringError(f"{what}: expected finite values, got {'nothing' if t.numel() == 0 else 'inf or nan'}")
    return t


def read_vector(path: str | Path) -> torch.Tensor:
    """One vector from a .pt / .pth (a tensor, or a dict holding one; weights_only, so no code runs), .safetensors
    (one tensor) or .npy file (allow_pickle off)."""
    p = Path(path)
    if p.suffix not in VECTOR_SUFFIXES:
        raise SteeringError(f"steering vector {path}: expected a {', '.join(VECTOR_SUFFIXES)} file")
    if not p.is_file():
        raise SteeringError(f"steering vector {path}: no such file")
    try:
        if p.suffix == ".npy":
            found: Any = np.load(p, allow_pickle=False)
        elif p.suffix == ".safetensors":
            from safetensors.torch import load_file

            found = load_file(p)
        else:
            found = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line naming it
        raise SteeringError(f"steering vector {path}: not a readable {p.suffix} file ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:160]})") from None
    if isinstance(found, Mapping):
        tensors = {k: v for k, v in found.items() if isinstance(v, torch.Tensor)}
        if len(tensors) != 1:
            raise SteeringError(f"steering vector {path}: expected one tensor, found {len(tensors)} "
                                f"({', '.join(list(tensors)[:5]) or 'none'})")
        found = next(iter(tensors.values()))
    return as_vector(found, f"steering vector {path}")


def load_lm_eval(path: str | Path, config: GPT2Config) -> list[Steering]:
    """The edits of lm-evaluation-harness's steered-model file ({hookpoint: {steering_vector, steering_coefficient,
    action, bias, head_index}}, Hugging Face module names such as 'h.3'), read without running code: 'add' adds
    coefficient * vector at every position, 'clamp' sets the component along the vector to the coefficient."""
    p = Path(path)
    try:
        raw = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise SteeringError(f"steering file {path}: not a readable torch file ({type(e).__name__})") from None
    if not isinstance(raw, Mapping) or not raw:
        raise SteeringError(f"steering file {path}: expected lm-eval's {{hookpoint: {{steering_vector, ...}}}} dict")
    out = []
    for module, info in raw.items():
        hook = hf_module_hook(str(module), config)
        if not isinstance(info, Mapping) or "steering_vector" not in info:
            raise SteeringError(f"steering file {path}: {module!r} has no steering_vector")
        action, coef = info.get("action", "add"), float(info.get("steering_coefficient", 1.0))
        head = info.get("head_index")
        if action == "add":
            if info.get("bias") is not None:
                raise SteeringError(f"steering file {path}: {module!r}: a bias is for action 'clamp', not 'add'")
            out.append(Steering(hook, info["steering_vector"], coef, head=head))
        elif action == "clamp":
            out.append(Steering.project(hook, info["steering_vector"], coef, bias=info.get("bias"), head=head))
        else:
            raise SteeringError(f"steering file {path}: {module!r}: action {action!r} (expected 'add' or 'clamp')")
    return out


def hf_module_hook(module: str, config: GPT2Config) -> str:
    """A Hugging Face GPT-2 module name ('h.3', 'transformer.h.3.mlp', 'ln_f') -> the hook point of its output."""
    name = module.removeprefix("transformer.")
    if name in HF_MODULES:
        return HF_MODULES[name]
    parts = name.split(".", 2)
    if len(parts) >= 2 and parts[0] == "h" and parts[1].isdigit() and int(parts[1]) < config.n_layer:
        rest = parts[2] if len(parts) == 3 else ""
        if rest in HF_BLOCK_MODULES:
            return f"blocks.{parts[1]}.{HF_BLOCK_MODULES[rest]}"
    raise SteeringError(f"steering hookpoint {module!r}: expected a GPT-2 module whose output is one row per token "
                        f"(h.N, h.N.attn, h.N.mlp, h.N.ln_1, h.N.ln_2, h.N.mlp.c_fc, h.N.mlp.act, wte, wpe, ln_f)")


def check_steering(steering: Sequence[Steering], config: GPT2Config) -> tuple[Steering, ...]:
    """The edits as a tuple, each checked against the model."""
    if isinstance(steering, Steering):
        steering = [steering]
    out = tuple(steering)
    for s in out:
        if not isinstance(s, Steering):
            raise SteeringError(f"steering: expected gpt2_engine.Steering objects, got {type(s).__name__}")
        s.check(config)
    return out


def prompt_key(steering: Sequence[Steering]) -> str | None:
    """What the keys and values of prompt tokens depend on: the edits that reach prompt rows (None: no edit does,
    so a prompt's keys and values are the plain model's)."""
    keys = [s.key for s in steering if s.positions != "generated"]
    return hashlib.sha256("|".join(keys).encode()).hexdigest()[:32] if keys else None


def between_blocks(hook: str) -> bool:
    """Whether an edit at `hook` falls between blocks (or before the first), where the native block runs on."""
    return point_of(hook) in BETWEEN_BLOCKS or hook in ("hook_embed", "hook_pos_embed")


# --- applying edits to the rows of a forward pass --------------------------------------------------------------------


class Rows(NamedTuple):
    """One sequence's rows in a forward: which rows of the flattened activation, each row's position in its
    sequence, how long its prompt is (rows at positions below it are prompt rows), and its edits."""

    steering: tuple[Steering, ...]
    rows: torch.Tensor  # [n] long
    positions: torch.Tensor  # [n] long
    prompt_len: int


def covered(s: Steering, r: Rows) -> torch.Tensor:
    """The rows of `r` that `s` edits, as indices into the flattened activation."""
    if s.positions == "all":
        return r.rows
    return r.rows[r.positions < r.prompt_len if s.positions == "prompt" else r.positions >= r.prompt_len]


@dataclass
class SteeringTap:
    """A Tap (core/model.py) that applies each sequence's edits to its rows. The activations' leading dimensions
    ([B, T], [1, R] for a pass's rows, [N] at the head) flatten to the rows that `Rows.rows` index."""

    weights: GPT2Weights
    config: GPT2Config
    groups: list[Rows]
    points: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.points = frozenset(s.hook for g in self.groups for s in g.steering)

    def wants(self, name: str) -> bool:
        return name in self.points

    def edits(self, name: str) -> bool:
        return name in self.points

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x [..., *row] at hook `name` -> x with each group's edits at `name` applied to its rows, in order."""
        if name not in self.points:
            return x
        k = row_dims(name)
        flat = x.reshape(-1, *x.shape[x.dim() - k :]).clone()  # [rows, *row]: the activation is never written in place
        for g in self.groups:
            for s in g.steering:
                if s.hook == name and len(sel := covered(s, g)):
                    flat[sel] = s.apply(flat[sel], self.weights, self.config)
        return flat.view(x.shape)

    def select(self, rows: torch.Tensor) -> SteeringTap | None:
        """The tap for a subset of the rows (indices into this tap's rows, renumbered from 0 in that order); None
        where no edit reaches them."""
        size = max([int(rows.max()) + 1 if len(rows) else 0] + [int(g.rows.max()) + 1 for g in self.groups if len(g.rows)])
        where = torch.full((size,), -1, dtype=torch.long)  # each old row's new number, -1 where it is left out
        where[rows] = torch.arange(len(rows))
        groups = []
        for g in self.groups:
            new = where[g.rows]
            keep = new >= 0
            if bool(keep.any()):
                groups.append(Rows(g.steering, new[keep], g.positions[keep], g.prompt_len))
        return SteeringTap(self.weights, self.config, groups) if groups else None


def sequence_tap(weights: GPT2Weights, config: GPT2Config, steering: Sequence[Steering], start: int, T: int,
                 prompt_len: int | None = None) -> SteeringTap | None:
    """The tap for one sequence's T tokens at positions [start, start + T) (prompt_len None: all are prompt rows,
    as in scoring); None without edits."""
    if not steering:
        return None
    positions = torch.arange(start, start + T)
    return SteeringTap(weights, config, [Rows(tuple(steering), torch.arange(T), positions,
                                              start + T if prompt_len is None else prompt_len)])


def batch_tap(weights: GPT2Weights, config: GPT2Config, steering: Sequence[Steering], rows: int) -> SteeringTap | None:
    """The tap that edits every one of `rows` rows as prompt rows (scoring's batches); None without edits."""
    if not steering:
        return None
    check_scoring(steering)
    return SteeringTap(weights, config, [Rows(tuple(steering), torch.arange(rows), torch.zeros(rows, dtype=torch.long), 1)])


def check_scoring(steering: Sequence[Steering]) -> None:
    """Raise SteeringError for edits that would reach nothing of a scored text (positions 'generated')."""
    if any(s.positions == "generated" for s in steering):
        raise SteeringError("steering positions 'generated' reach no token of a scored text (every scored token is "
                            "given, none generated); use 'all' or 'prompt'")


# --- specs: the command line's --steer and the server's "steering" field ---------------------------------------------

SPEC_KEYS = ("sae", "feature", "coef", "clamp", "vector", "hook", "positions", "head")
SPEC_GRAMMAR = ("sae=SAE,feature=N[,coef=X | ,clamp=VALUE] or vector=FILE,hook=HOOK[,coef=X | ,clamp=VALUE] "
                "[,positions=all|prompt|generated][,head=H]")


def parse_spec(text: str) -> dict[str, str]:
    """'sae=DIR,feature=123,coef=8' -> {'sae': 'DIR', 'feature': '123', 'coef': '8'}."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not key or not value.strip():
            raise SteeringError(f"--steer {text!r}: expected {SPEC_GRAMMAR}")
        if key in fields:
            raise SteeringError(f"--steer {text!r}: {key} given twice")
        fields[key] = value.strip()
    return fields


def from_fields(fields: Mapping[str, Any], sae: Callable[[str], SAE], vector: Callable[[str], torch.Tensor],
                where: str = "--steer") -> Steering:
    """A Steering from a spec's fields (strings from the command line, JSON values from a request): `sae` and
    `vector` resolve the names they give (a directory or a registered name; a file or a registered name)."""
    if unknown := sorted(set(fields) - set(SPEC_KEYS)):
        raise SteeringError(f"{where}: unknown field {unknown[0]!r}; expected {SPEC_GRAMMAR}")
    if ("sae" in fields) == ("vector" in fields):
        raise SteeringError(f"{where}: give one of sae= or vector=; expected {SPEC_GRAMMAR}")
    if "coef" in fields and "clamp" in fields:
        raise SteeringError(f"{where}: coef adds a direction, clamp sets a value; give one of them")

    def number(key: str, kind: type, default: Any = None) -> Any:
        if key not in fields:
            return default
        raw = fields[key]
        try:
            if isinstance(raw, bool) or (kind is int and isinstance(raw, float)):
                raise ValueError
            value = kind(raw)
        except (TypeError, ValueError):
            raise SteeringError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}, got "
                                f"{raw!r}") from None
        return value

    positions = str(fields.get("positions", "all"))
    head = number("head", int)
    if "sae" in fields:
        if "hook" in fields or "head" in fields:
            raise SteeringError(f"{where}: an SAE steers at its own hook (and head); leave out hook= and head=")
        if "feature" not in fields:
            raise SteeringError(f"{where}: sae= needs feature=N (which latent)")
        model = sae(str(fields["sae"]))
        feature = number("feature", int)
        if "clamp" in fields:
            return Steering.clamp(model, feature, number("clamp", float), positions)
        return Steering.from_sae(model, feature, number("coef", float, 1.0), positions)
    if "feature" in fields:
        raise SteeringError(f"{where}: feature= goes with sae=, not vector=")
    if "hook" not in fields:
        raise SteeringError(f"{where}: vector= needs hook=HOOK (where to add it, e.g. blocks.6.hook_resid_pre)")
    v = vector(str(fields["vector"]))
    if "clamp" in fields:
        return Steering.project(str(fields["hook"]), v, number("clamp", float), positions, head=head)
    return Steering(str(fields["hook"]), v, number("coef", float, 1.0), positions, head=head)


@dataclass(frozen=True)
class SteeringRegistry:
    """The SAEs and vectors a server offers by name (`gpt2 serve --sae NAME=DIR --steering-vector NAME=FILE`): a
    request's "steering" specs name them, never a path on the server's disk."""

    saes: Mapping[str, SAE] = field(default_factory=dict)
    vectors: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def sae(self, name: str) -> SAE:
        if name not in self.saes:
            raise SteeringError(f"steering: no SAE named {name!r} on this server (it serves "
                                f"{', '.join(map(repr, self.saes)) or 'none: start it with --sae NAME=DIR'})")
        return self.saes[name]

    def vector(self, name: str) -> torch.Tensor:
        if name not in self.vectors:
            raise SteeringError(f"steering: no vector named {name!r} on this server (it serves "
                                f"{', '.join(map(repr, self.vectors)) or 'none: start it with --steering-vector NAME=FILE'})")
        return self.vectors[name]

    def build(self, specs: Sequence[Mapping[str, Any]], config: GPT2Config) -> tuple[Steering, ...]:
        """A request's steering specs ({"sae": NAME, "feature": N, "coef": X}, ...) as checked edits."""
        out = []
        for i, spec in enumerate(specs):
            if not isinstance(spec, Mapping):
                raise SteeringError(f"steering[{i}]: expected an object like {{\"sae\": NAME, \"feature\": N, "
                                    f"\"coef\": X}}, got {type(spec).__name__}")
            out.append(from_fields(spec, self.sae, self.vector, where=f"steering[{i}]"))
        return check_steering(out, config)

    def describe(self) -> dict[str, Any]:
        """What GET /v1/steering lists: each SAE's hook and width, each vector's length."""
        return {"saes": [{"name": n, "hook": s.hook_name, "d_sae": s.d_sae} for n, s in self.saes.items()],
                "vectors": [{"name": n, "size": int(v.numel())} for n, v in self.vectors.items()]}
