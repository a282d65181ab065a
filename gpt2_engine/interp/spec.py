"""Steering as data: what to add where, checked against the model, apart from how it is applied (steering.py).

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

The runtime's plans carry these as they are (runtime/plan.py names the type only for checking), and a request's
edits are checked once, when it is built (check_steering); the spec grammar of `--steer` and of the server's
"steering" field is parsed here too.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.config import GPT2Config
from ..core.errors import SteeringError
from ..core.scalars import as_int, as_real, described
from ..formats.vectors import as_vector, read_vector
from .hooks import hook_names
from .sae import HEAD_POINTS, SAE

POSITIONS = ("all", "prompt", "generated")


ACTIONS = ("add", "clamp", "project")


UNSTEERABLE = ("attn.hook_attn_scores", "attn.hook_pattern")  # [B, nh, T, S]: not one row per token


BETWEEN_BLOCKS = ("hook_resid_pre", "hook_resid_post")  # where the native decode path keeps running
# The largest value an edit may add to an activation. GPT-2's activations stay below about 1e4; past 1e12, what the
# layers downstream do with an edit (a projection sums thousands of its values, a layer norm squares them) can leave
# float32's range, and the logits turn NaN: a steering that large is refused up front, like an infinite one.
MAX_EDIT = 1e12


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
            v = as_real(getattr(self, name))  # numpy's and torch's scalars are numbers; a bool is not
            if v is None or not math.isfinite(v):
                raise SteeringError(f"steering {name} must be a finite number, got {described(getattr(self, name))}")
            object.__setattr__(self, name, v)
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
        for name, t in (("vector", self.vector), ("bias", self.bias)):
            if t is not None:
                self._check_row(name, t, shape)

    def _check_row(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        """SteeringError unless `t` is one row of the hook (`shape`, or flat, with leading 1s)."""
        want = math.prod(shape)
        if t.numel() != want:
            raise SteeringError(f"steering {name} at {self.hook} has {t.numel()} values ({list(t.shape)}); "
                                f"that hook is {want} wide{' per head' if self.head is not None else ''}")
        row = tuple(t.shape[next((i for i, n in enumerate(t.shape) if n != 1), t.dim()):])  # leading 1s dropped
        if row not in (shape, (want,)):  # [8, 8] on a 64-wide hook has the count but not the meaning
            shapes = " or ".join(str(list(s)) for s in dict.fromkeys([shape, (want,)]))
            raise SteeringError(f"steering {name} at {self.hook}: shape {list(t.shape)}; expected {shapes} "
                                f"(leading 1s allowed)")

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
    index = as_int(feature)  # numpy's integers and 0-d integer tensors too; True is not feature 1
    if index is None:
        raise SteeringError(f"steering feature: expected an integer (this SAE's features are 0..{sae.d_sae - 1}), got "
                            f"{described(feature)}")
    if not 0 <= index < sae.d_sae:
        raise SteeringError(f"steering feature {index}: this SAE's features are 0..{sae.d_sae - 1}")
    return index


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


SPEC_KEYS = ("sae", "feature", "coef", "clamp", "vector", "hook", "positions", "head")


SPEC_GRAMMAR = ("sae=SAE,feature=N[,hook=HOOK][,coef=X | ,clamp=VALUE] or vector=FILE,hook=HOOK[,coef=X | ,clamp=VALUE] "
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


def from_fields(fields: Mapping[str, Any], sae: Callable[[str, str | None], SAE],
                vector: Callable[[str], torch.Tensor], where: str = "--steer") -> Steering:
    """A Steering from a spec's fields (strings from the command line, JSON values from a request): `sae` and
    `vector` resolve the names they give (a directory or a registered name, with the hook= given if any: OpenAI's SAE
    files do not record theirs; a file or a registered name)."""
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
        if "head" in fields:
            raise SteeringError(f"{where}: an SAE steers at its own head; leave out head=")
        if "feature" not in fields:
            raise SteeringError(f"{where}: sae= needs feature=N (which latent)")
        model = sae(str(fields["sae"]), str(fields["hook"]) if "hook" in fields else None)
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

