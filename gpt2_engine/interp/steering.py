"""Steering applied: each edit (interp/spec.py's Steering, what to add where) made to the rows it covers while the
model runs, through a Tap on the one forward (SteeringTap); lm-evaluation-harness's steered-model files; the SAEs and
vectors a server offers by name (SteeringRegistry).

A row's position, not the pass it runs in, decides which edits reach it, so decoding with the KV cache, batching and
speculative verify passes apply the same edits a whole-sequence recompute applies (runtime/runner.py).

An SAE's vectors live in the space its TransformerLens model showed at the hook (interp/sae.py's presentation): its
decoder row d is lifted into the engine's activation by the linear part of that map, U(d) = restore(d) - restore(0)
(d itself for center_writing_weights, since every reader of the residual stream removes the mean first; (d - mean d)
* ln.weight under fold_ln), which is what adding d there does to the model's function.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..core.config import GPT2Config
from ..core.errors import SteeringError
from ..core.weights import GPT2Weights
from ..formats.pickles import load_pickle
from .sae import SAE, presentation
from .spec import Steering, check_steering, from_fields, row_dims


# lm-evaluation-harness's steered model names Hugging Face modules; the hook point each one's output is
# a request's steering fields as JSON gives them (the command line's are text, read by from_fields): "3" is no feature
JSON_TYPES: dict[str, type | tuple[type, ...]] = {"sae": str, "vector": str, "hook": str, "positions": str, "feature": int,
                                                 "head": int, "coef": (int, float), "clamp": (int, float)}
JSON_TYPE_NAMES = {str: "a string", int: "an integer", (int, float): "a number"}
HF_MODULES = {"wte": "hook_embed", "wpe": "hook_pos_embed", "ln_f": "ln_final.hook_normalized"}
HF_BLOCK_MODULES = {"": "hook_resid_post", "attn": "hook_attn_out", "mlp": "hook_mlp_out", "ln_1": "ln1.hook_normalized",
                    "ln_2": "ln2.hook_normalized", "mlp.c_fc": "mlp.hook_pre", "mlp.act": "mlp.hook_post"}


def load_lm_eval(path: str | Path, config: GPT2Config) -> list[Steering]:
    """The edits of lm-evaluation-harness's steered-model file ({hookpoint: {steering_vector, steering_coefficient,
    action, bias, head_index}}, Hugging Face module names such as 'h.3'), read without running code: 'add' adds
    coefficient * vector at every position, 'clamp' sets the component along the vector to the coefficient."""
    p = Path(path)
    try:
        raw = load_pickle(p)  # weights only: nothing in it runs
    except (ValueError, OSError) as e:
        raise SteeringError(f"steering file {path}: not a readable torch file ({e})") from None
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


# --- applying edits to the rows of a forward pass --------------------------------------------------------------------


def apply(s: Steering, a: torch.Tensor, weights: GPT2Weights, config: GPT2Config) -> torch.Tensor:
    """The rows `a` with edit `s` applied: a [n, *row] (hook_shape) -> [n, *row], in a's dtype, on a's device."""
    part = a if s.head is None else a[:, s.head]  # [n, hs] for one head
    if s.action == "project":
        shifted = part if s.bias is None else part - s.bias.to(a.device).view(part.shape[1:])
        d = s.vector.to(a.device).view(part.shape[1:])
        proj = (shifted * d).flatten(1).sum(dim=-1).view(-1, *[1] * (part.dim() - 1))  # [n, 1...]
        edited = part + d * (s.value - proj)
    elif s.sae is None:  # a plain direction
        edited = part + s.coef * s.vector.to(a.device).view(part.shape[1:])
    else:
        edited = part + sae_delta(s, a, weights, config)
    if s.head is None:
        return edited.to(a.dtype)
    out = a.clone()
    out[:, s.head] = edited
    return out

def sae_delta(s: Steering, a: torch.Tensor, weights: GPT2Weights, config: GPT2Config) -> torch.Tensor:
    """[n, *row] -> what from_sae or clamp adds to the rows (to the head's slice, for a one-head SAE), lifted
    from the SAE's presented space into the engine's (see the module docstring)."""
    sae, c = s.sae, s.sae.config
    affine = presentation(c, config, weights, a)
    p = affine.present(a.float())  # [n, *row]: as the SAE's TransformerLens model showed it
    if s.action == "add":
        d = (s.coef * s.vector.to(a.device)).expand(a.shape[0], -1)  # [n, d_in]
    else:
        x = p[:, c.hook_head_index] if c.hook_head_index is not None else sae.flatten(p)  # [n, d_in]
        one = sae.select([s.feature])  # only this latent's encoder column, where that gives its exact value
        # the SAE stays where it was loaded; on a GPU, only the one latent's column moves (topk reads them all)
        f = (one.to(a.device).encode(x)[:, 0] if one is not None
             else sae.encode(x.to(sae.W_enc.device))[:, s.feature].to(a.device))  # [n]
        d = (s.value - f)[:, None] * sae.W_dec[s.feature].to(a.device)  # [n, d_in]: its change, decoded
        if sae.dec_norm is not None:
            d = d / sae.dec_norm[s.feature].to(a.device)
        unnormalize = sae.normalize(x)[1]
        d = unnormalize(d) - unnormalize(torch.zeros_like(d))  # the SAE's input scale, its shift cancelled
    if c.hook_head_index is not None:
        full = torch.zeros_like(p)
        full[:, c.hook_head_index] = d
        lifted = affine.restore(full) - affine.restore(torch.zeros_like(full))
        return lifted[:, c.hook_head_index]  # [n, hs]
    d = d.view(p.shape)
    return affine.restore(d) - affine.restore(torch.zeros_like(d))  # [n, *row]


class SteeredRows(NamedTuple):
    """One sequence's rows in a forward: which rows of the flattened activation, each row's position in its
    sequence, how long its prompt is (rows at positions below it are prompt rows), and its edits."""

    steering: tuple[Steering, ...]
    rows: torch.Tensor  # [n] long
    positions: torch.Tensor  # [n] long
    prompt_len: int


def covered(s: Steering, r: SteeredRows) -> torch.Tensor:
    """The rows of `r` that `s` edits, as indices into the flattened activation."""
    if s.positions == "all":
        return r.rows
    return r.rows[r.positions < r.prompt_len if s.positions == "prompt" else r.positions >= r.prompt_len]


@dataclass
class SteeringTap:
    """A Tap (core/model.py) that applies each sequence's edits to its rows. The activations' leading dimensions
    ([B, T], [1, R] for a pass's rows, [N] at the head) flatten to the rows that `SteeredRows.rows` index."""

    weights: GPT2Weights
    config: GPT2Config
    groups: list[SteeredRows]
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
                    sel = sel.to(flat.device)
                    flat[sel] = apply(s, flat[sel], self.weights, self.config)
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
                groups.append(SteeredRows(g.steering, new[keep], g.positions[keep], g.prompt_len))
        return SteeringTap(self.weights, self.config, groups) if groups else None


def sequence_tap(weights: GPT2Weights, config: GPT2Config, steering: Sequence[Steering], start: int, T: int,
                 prompt_len: int | None = None) -> SteeringTap | None:
    """The tap for one sequence's T tokens at positions [start, start + T) (prompt_len None: all are prompt rows,
    as in scoring); None without edits."""
    if not steering:
        return None
    positions = torch.arange(start, start + T)
    return SteeringTap(weights, config, [SteeredRows(tuple(steering), torch.arange(T), positions,
                                              start + T if prompt_len is None else prompt_len)])


def batch_tap(weights: GPT2Weights, config: GPT2Config, steering: Sequence[Steering], rows: int) -> SteeringTap | None:
    """The tap that edits every one of `rows` rows as prompt rows (scoring's batches); None without edits."""
    if not steering:
        return None
    check_scoring(steering)
    return SteeringTap(weights, config, [SteeredRows(tuple(steering), torch.arange(rows), torch.zeros(rows, dtype=torch.long), 1)])


def check_scoring(steering: Sequence[Steering]) -> None:
    """Raise SteeringError for edits that would reach nothing of a scored text (positions 'generated')."""
    if any(s.positions == "generated" for s in steering):
        raise SteeringError("steering positions 'generated' reach no token of a scored text (every scored token is "
                            "given, none generated); use 'all' or 'prompt'")


# --- specs: the command line's --steer and the server's "steering" field ---------------------------------------------


@dataclass(frozen=True)
class SteeringRegistry:
    """The SAEs and vectors a server offers by name (`gpt2 serve --sae NAME=DIR --steering-vector NAME=FILE`): a
    request's "steering" specs name them, never a path on the server's disk."""

    saes: Mapping[str, SAE] = field(default_factory=dict)
    vectors: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def sae(self, name: str, hook: str | None = None) -> SAE:
        if name not in self.saes:
            raise SteeringError(f"steering: no SAE named {name!r} on this server (it serves "
                                f"{', '.join(map(repr, self.saes)) or 'none: start it with --sae NAME=DIR'})")
        if hook is not None and hook != self.saes[name].hook_name:
            raise SteeringError(f"steering: the SAE {name!r} reads {self.saes[name].hook_name}, not {hook}; "
                                "leave out hook= (a served SAE steers at its own hook)")
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
            for key, value in spec.items():
                kind = JSON_TYPES.get(key)
                if kind is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                    raise SteeringError(f"steering[{i}].{key}: expected {JSON_TYPE_NAMES[kind]}, got "
                                        f"{json.dumps(value)[:60]}")
            out.append(from_fields(spec, self.sae, self.vector, where=f"steering[{i}]"))
        return check_steering(out, config)

    def describe(self) -> dict[str, Any]:
        """What GET /v1/steering lists: each SAE's hook and width, each vector's length."""
        return {"saes": [{"name": n, "hook": s.hook_name, "d_sae": s.d_sae} for n, s in self.saes.items()],
                "vectors": [{"name": n, "size": int(v.numel())} for n, v in self.vectors.items()]}
