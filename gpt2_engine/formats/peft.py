"""LoRA adapters in Hugging Face PEFT's file format (what `PeftModel.from_pretrained(GPT2LMHeadModel..., dir)` reads).

adapter_config.json (peft_type LORA, r, lora_alpha, target_modules, fan_in_fan_out true, since GPT-2's projections
are Conv1D) and adapter_model.safetensors, whose keys name nn.Linear layers: `base_model.model.transformer.h.{i}.attn
.c_attn.lora_A.weight` is A^T (r, in) and `...lora_B.weight` is B^T (out, r). The engine keeps A and B in the Conv1D
orientation (in, r) and (r, out) (core/lora.py), so the transposes happen here, at the file boundary only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..core.config import GPT2Config, read_json
from ..core.errors import GPT2EngineError, InputError
from ..core.lora import ALL_TARGETS, TARGETS, LoraAdapter, LoraError, LoraSettings, module_name, target_shape
from .files import atomic_write, output_directory, what_is
from .hf import WEIGHT_LIMIT, check_values, read_tensors, weights_fingerprint

ADAPTER_CONFIG = "adapter_config.json"


ADAPTER_WEIGHTS = "adapter_model.safetensors"


ADAPTER_BASE = "adapter_base.json"  # the engine's: which base the adapter was trained on (see check_base)


PEFT_PREFIX = "base_model.model.transformer."  # PeftModel wraps GPT2LMHeadModel, which holds the transformer


def peft_config(adapter: LoraAdapter) -> dict:
    """adapter_config.json as PEFT writes it for GPT-2 (LoraConfig's fields; the rest are PEFT's defaults)."""
    s = adapter.settings
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": adapter.base or None,
            "r": s.r, "lora_alpha": s.alpha, "lora_dropout": s.dropout, "target_modules": list(s.targets),
            "fan_in_fan_out": True, "bias": "none", "use_rslora": s.rslora, "use_dora": False,
            "modules_to_save": None, "init_lora_weights": True, "layers_to_transform": None, "rank_pattern": {},
            "alpha_pattern": {}, "inference_mode": True, "revision": None}


def save_adapter(directory: str | Path, adapter: LoraAdapter) -> None:
    """Write the adapter in PEFT's format; each file is written beside its destination and renamed over it."""
    from safetensors.torch import save_file

    directory = output_directory(Path(directory))
    tensors = {PEFT_PREFIX + name + ".weight": t.t().contiguous() for name, t in adapter.tensors.items()}
    for name, write in ((ADAPTER_WEIGHTS, lambda p: save_file(tensors, p, metadata={"format": "pt"})),
                        (ADAPTER_CONFIG, lambda p: Path(p).write_text(json.dumps(peft_config(adapter), indent=2) + "\n",
                                                                       encoding="utf-8"))):
        atomic_write(directory / name, write)
    # the base's fingerprint in a file of its own: PEFT warns about keys its config does not know, and a safetensors
    # header's metadata is written in no fixed order (an exact resume must write identical files)
    if adapter.base_fingerprint:
        base = {"base_model_name_or_path": adapter.base or None, "weights_fingerprint": adapter.base_fingerprint}
        atomic_write(directory / ADAPTER_BASE,
                     lambda p: Path(p).write_text(json.dumps(base, indent=2) + "\n", encoding="utf-8"))
    else:
        (directory / ADAPTER_BASE).unlink(missing_ok=True)


def recorded_base(directory: str | Path) -> str:
    """The base_model_name_or_path an adapter directory records ("" when none, or when it is not readable)."""
    try:
        cfg = read_json(Path(directory) / ADAPTER_CONFIG, "a PEFT adapter config")
    except (OSError, ValueError, InputError):
        return ""  # load_adapter says why
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    return base if isinstance(base, str) else ""


def check_base(adapter: LoraAdapter, directory: Path, base: str | Path) -> None:
    """An adapter applied to weights other than those it was trained on gives a silently different model: refuse
    it, unless the caller forces it. Adapters without a fingerprint (peft's) cannot be checked."""
    if not adapter.base_fingerprint:
        return
    found = weights_fingerprint(Path(base))
    if found != adapter.base_fingerprint:
        raise LoraError(f"{directory}: this adapter was trained on another base ({adapter.base or 'unnamed'}, weights "
                        f"fingerprint {adapter.base_fingerprint}) than {base} (fingerprint {found}); pass --force "
                        "(force=True) to apply it anyway")


def is_adapter(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


# adapter_config.json's fields that must keep plain LoRA's value (on the projections only): (key, PEFT's default,
# whether a value is plain LoRA's)
PLAIN_LORA = (("use_dora", False, lambda v: not v), ("bias", "none", lambda v: v == "none"),
              ("modules_to_save", None, lambda v: not v), ("rank_pattern", {}, lambda v: not v),
              ("alpha_pattern", {}, lambda v: not v), ("layer_replication", None, lambda v: not v))
FLAGS = ("use_rslora", "fan_in_fan_out")  # true, false or absent: bool("false") is True


def read_adapter_config(directory: Path) -> dict:
    """adapter_config.json, checked to say plain LoRA."""
    if not directory.is_dir():
        raise LoraError(f"{directory}: not a directory (expected a PEFT adapter: {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    path = directory / ADAPTER_CONFIG
    try:
        cfg = read_json(path, "a PEFT adapter config")
    except FileNotFoundError:
        raise LoraError(f"{directory}: no {ADAPTER_CONFIG}; not a PEFT adapter directory") from None
    except InputError as e:
        raise LoraError(str(e)) from None
    except (OSError, ValueError) as e:
        raise LoraError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise LoraError(f"{path}: peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else None!r}, expected 'LORA'")
    for key, default, plain in PLAIN_LORA:
        if not plain(cfg.get(key, default)):
            raise LoraError(f"{path}: {key}={cfg.get(key)!r} is not supported (plain LoRA on the projections only)")
    for key in FLAGS:
        if cfg.get(key) not in (None, True, False):
            raise LoraError(f"{path}: {key} is {json.dumps(cfg[key])[:60]}, expected true or false")
    if not isinstance(cfg.get("base_model_name_or_path") or "", str):
        raise LoraError(f"{path}: base_model_name_or_path is {cfg['base_model_name_or_path']!r}, expected a string")
    return cfg


PEFT_DEFAULT_TARGETS = ["c_attn"]  # what PEFT adapts in a GPT-2 whose config gives no target_modules


def target_list(cfg: dict, path: Path) -> list[str] | None:
    """adapter_config.json's target_modules as a list of names (PEFT's default where absent); None for one regular
    expression, which PEFT matches against whole module names and which is not checked here (Python's re has no
    time limit, and a crafted pattern can backtrack for minutes on one module name); LoraError for another type."""
    targets = cfg.get("target_modules")
    if targets is None:
        return PEFT_DEFAULT_TARGETS
    if isinstance(targets, str):
        return list(ALL_TARGETS) if targets == "all-linear" else None  # PEFT's shorthand: every projection
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoraError(f"{path}: target_modules is {json.dumps(targets)[:80]}, expected a list of module names (or "
                        "one regular expression)")
    return targets


def excluded_list(cfg: dict, path: Path) -> list[str]:
    """adapter_config.json's exclude_modules as a list of names ([] where absent); LoraError for a regular expression
    (not matched here, as target_modules' is not) or another type."""
    excluded = cfg.get("exclude_modules")
    if excluded is None:
        return []
    if not isinstance(excluded, list) or not all(isinstance(e, str) for e in excluded):
        raise LoraError(f"{path}: exclude_modules is {json.dumps(excluded)[:80]}, expected a list of module names (a "
                        "regular expression is not supported)")
    return excluded


def layer_list(cfg: dict, path: Path) -> list[int] | None:
    """adapter_config.json's layers_to_transform as a list (None: every layer), its layers_pattern GPT-2's "h";
    LoraError for another type or pattern."""
    layers, pattern = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
    if pattern not in (None, "", [], "h", ["h"]):
        raise LoraError(f"{path}: layers_pattern {pattern!r} is not GPT-2's (its layers are transformer.h.N)")
    if type(layers) is int:
        return [layers]
    if layers is None:
        return None
    if layers == []:
        raise LoraError(f"{path}: layers_to_transform is [], which selects no layer (PEFT finds nothing to adapt); "
                        "leave it out for every layer")
    if not isinstance(layers, list) or not all(type(i) is int for i in layers):
        raise LoraError(f"{path}: layers_to_transform is {json.dumps(layers)[:80]}, expected a layer index or a list "
                        "of them")
    return layers


def check_selected(cfg: dict, path: Path, tensors: dict[str, torch.Tensor], config: GPT2Config) -> None:
    """Refuse what PEFT would not apply as the file says: a target_modules entry that names none of GPT-2's
    projections (PEFT raises where none matches; q_proj is another model's), and an update to a projection that
    target_modules or layers_to_transform leave out (PEFT leaves it unloaded: applying it is another model).
    Selection as PEFT's check_target_module_exists: a module is picked by an entry its full name
    (transformer.h.N.attn.c_attn) is, or ends with after a dot; layers_to_transform narrows a list's picks."""
    targets, layers, excluded = target_list(cfg, path), layer_list(cfg, path), excluded_list(cfg, path)
    stems = [module_name(i, t) for i in range(config.n_layer) for t in ALL_TARGETS]
    adapted = {name.rpartition(".")[0] for name in tensors}
    check_not_excluded(path, [s for s in stems if s in adapted], excluded)
    if targets is None:
        return
    for entry in targets:
        if not any(picks(entry, stem) for stem in stems):
            raise LoraError(f"{path}: target_modules entry {entry!r} names none of GPT-2's projections (c_attn, "
                            "attn.c_proj, c_fc, mlp.c_proj; c_proj for both)")
    named = "" if "target_modules" in cfg else " (PEFT's default for GPT-2, as the config gives none)"
    check_updated_modules(path, [s for s in stems if s in adapted], targets, named, layers)


def check_not_excluded(path: Path, stems: list[str], excluded: list[str]) -> None:
    """LoraError for an updated module (of `stems`) that an exclude_modules entry leaves out."""
    for stem in stems:
        if entry := next((e for e in excluded if picks(e, stem)), None):
            raise LoraError(f"{path}: exclude_modules entry {entry!r} leaves out {stem}, which the adapter's weights "
                            "update (PEFT would not load that update)")


def check_updated_modules(path: Path, stems: list[str], targets: list[str], named: str, layers: list[int] | None) -> None:
    """LoraError for an updated module (of `stems`) that the targets (`named`: where they come from) or the layers
    leave out."""
    for stem in stems:
        layer = int(stem.split(".")[1])
        if not any(picks(entry, stem) for entry in targets):
            raise LoraError(f"{path}: target_modules {targets}{named} does not select {stem}, which the adapter's "
                            "weights update (PEFT would not load that update)")
        if layers is not None and layer not in layers:
            raise LoraError(f"{path}: layers_to_transform {layers} leaves out layer {layer}, whose {stem} the "
                            "adapter's weights update (PEFT would not load that update)")


def picks(entry: str, stem: str) -> bool:
    """Whether a target_modules entry selects the module `stem` (h.N.attn.c_attn), as PEFT matches one."""
    return f"transformer.{stem}" == entry or f"transformer.{stem}".endswith("." + entry)


def config_number(cfg: dict, path: Path, key: str, default: float) -> float:
    """A number of adapter_config.json (`default` where absent or null); LoraError for a string or a bool, which
    PEFT's arithmetic would not take for a number either."""
    value = cfg.get(key)
    if value is None:
        return default
    if type(value) not in (int, float):
        raise LoraError(f"{path}: {key} is {json.dumps(value)[:60]}, expected a number")
    return float(value)


def adapter_tensor(key: str, t: torch.Tensor, modules: dict[str, str], config: GPT2Config,
                   path: Path, rank: int | None = None) -> tuple[str, str, int]:
    """(engine name, target, rank) of one tensor of the file, its name, shape and values checked against the model;
    `rank` (adapter_config.json's r, where it is one) is the rank an expected shape names."""
    name = key.removeprefix(PEFT_PREFIX).replace(".default.", ".")
    stem, _, kind = name.removesuffix(".weight").rpartition(".")
    if not key.startswith(PEFT_PREFIX) or stem not in modules or kind not in ("lora_A", "lora_B") \
            or not name.endswith(".weight"):
        raise LoraError(f"{path}: unexpected tensor {key!r} (expected {PEFT_PREFIX}h.N.<module>.lora_A|lora_B.weight "
                        f"for the {config.n_layer} layers of this model)")
    if t.dim() == 0:
        raise LoraError(f"{path}: {key} is a scalar, expected a matrix")
    fan_in, fan_out = target_shape(config, modules[stem])
    r = t.shape[0] if kind == "lora_A" else t.shape[-1]  # a rank other than r's is load_adapter's to name
    want = (r, fan_in) if kind == "lora_A" else (fan_out, r)
    if t.dim() != 2 or tuple(t.shape) != want:
        named = rank or r
        want = (named, fan_in) if kind == "lora_A" else (fan_out, named)
        raise LoraError(f"{path}: {key} has shape {list(t.shape)}, expected {list(want)} for this model")
    if not t.is_floating_point():
        raise LoraError(f"{path}: {key} has dtype {t.dtype}, expected a float")
    try:  # as a checkpoint's weights are: a NaN here makes every logit NaN
        check_values(path, key, t, limit=None)
    except GPT2EngineError as e:
        raise LoraError(str(e)) from None
    return stem + "." + kind, modules[stem], r


def adapter_tensors(path: Path, config: GPT2Config,
                    rank: int | None = None) -> tuple[dict[str, torch.Tensor], set[str], set[int]]:
    """(A and B by engine name in Conv1D orientation, the targets they adapt, their ranks), each paired; `rank` as
    adapter_tensor's."""
    try:
        raw = read_tensors(path)
    except GPT2EngineError as e:
        raise LoraError(str(e)) from None
    modules = {module_name(i, t): t for i in range(config.n_layer) for t in TARGETS}
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    ranks: set[int] = set()
    for key, t in raw.items():
        name, target, r = adapter_tensor(key, t, modules, config, path, rank)
        tensors[name] = t.float().t().contiguous()
        targets.add(target)
        ranks.add(r)
    for name in list(tensors):
        other = name[:-1] + ("B" if name.endswith("A") else "A")
        if other not in tensors:
            raise LoraError(f"{path}: {PEFT_PREFIX}{name}.weight has no {other.rpartition('.')[2]} to pair with")
    if not tensors:
        raise LoraError(f"{path}: holds no LoRA tensors")
    return tensors, targets, ranks


def load_adapter(directory: str | Path, config: GPT2Config) -> LoraAdapter:
    """Read a PEFT LoRA adapter for this model (written by peft or by the engine), checking every tensor."""
    directory = Path(directory)
    cfg = read_adapter_config(directory)
    path = adapter_file(directory, ADAPTER_WEIGHTS)
    if path is None:
        raise LoraError(f"{directory}: no {ADAPTER_WEIGHTS} (the engine reads adapters in safetensors)")
    r = cfg.get("r", 8)
    tensors, targets, ranks = adapter_tensors(path, config, r if type(r) is int and r >= 1 else None)
    if ranks != {r}:
        raise LoraError(f"{directory / ADAPTER_CONFIG}: r={r!r}, but the tensors have rank {sorted(ranks)}")
    config_path = directory / ADAPTER_CONFIG
    check_selected(cfg, config_path, tensors, config)
    rslora = cfg.get("use_rslora")  # checked a bool: "false" would be a scale alpha / sqrt(r) the file did not ask for
    alpha = config_number(cfg, config_path, "lora_alpha", 8.0)
    dropout = config_number(cfg, config_path, "lora_dropout", 0.0)
    try:
        settings = LoraSettings(r=r, alpha=alpha, dropout=dropout, targets=tuple(t for t in ALL_TARGETS if t in targets),
                                rslora=bool(rslora))
    except (TypeError, ValueError, LoraError) as e:  # LoraSettings' own checks name the field, not the file
        raise LoraError(f"{directory / ADAPTER_CONFIG}: {e}") from None
    if settings.scale > WEIGHT_LIMIT:
        raise LoraError(f"{directory / ADAPTER_CONFIG}: lora_alpha {settings.alpha:g} over r {settings.r} scales the "
                        f"update by {settings.scale:.3g}, expected at most {WEIGHT_LIMIT:g} (a scale this large "
                        "overflows float32 activations)")
    check_updates(directory, settings, tensors)
    return LoraAdapter(settings, tensors, cfg.get("base_model_name_or_path") or "", base_fingerprint(directory))


def adapter_file(directory: Path, name: str) -> Path | None:
    """directory/name where it is a regular file (links followed), None where nothing is; anything else there (a
    FIFO, whose open waits for a writer forever, or a folder) is a LoraError naming it, not a file gone missing."""
    path = directory / name
    try:
        kind = what_is(path)
    except OSError as e:  # a symlink loop
        raise LoraError(f"{path}: cannot be looked at ({e.strerror or e})") from None
    if kind not in (None, "a regular file"):
        raise LoraError(f"{path}: {kind}, not a regular file")
    if kind is None and path.is_symlink():  # a link to nothing: the file was meant to be there
        raise LoraError(f"{path}: a link to {os.readlink(path)}, which does not exist")
    return None if kind is None else path


def check_updates(directory: Path, settings: LoraSettings, tensors: dict[str, torch.Tensor]) -> None:
    """Each projection's update scale * A B held to the bound a checkpoint's weights are (WEIGHT_LIMIT): finite
    tensors with a huge lora_alpha (1e308) or huge values (1e30) made every logit NaN. The bound |(A B)_ij| <=
    |A_i,:| |B_:,j| costs a norm per row and column; only an adapter past it pays for the product, to name its size."""
    s = settings.scale
    for name in sorted(n for n in tensors if n.endswith(".lora_A")):
        a, b = tensors[name], tensors[name.removesuffix("lora_A") + "lora_B"]  # (in, r), (r, out)
        bound = s * float(a.double().norm(dim=1).max()) * float(b.double().norm(dim=0).max())
        if bound <= WEIGHT_LIMIT:
            continue
        largest = s * float((a.double() @ b.double()).abs().max())
        if not largest <= WEIGHT_LIMIT:  # NaN included
            raise LoraError(f"{directory}: its update to {name.removesuffix('.lora_A')} (lora_A x lora_B x the scale "
                            f"{s:.3g}, from lora_alpha {settings.alpha:g} and r {settings.r}) holds values up to "
                            f"{largest:.3g}, expected at most {WEIGHT_LIMIT:g} like any weight (larger ones overflow "
                            "float32 activations)")


def base_fingerprint(directory: Path) -> str:
    """The fingerprint adapter_base.json records ("" where there is none: adapters written by peft)."""
    path = adapter_file(directory, ADAPTER_BASE)
    if path is None:
        return ""
    try:
        found = read_json(path, "the adapter's base record").get("weights_fingerprint")
    except InputError as e:
        raise LoraError(str(e)) from None
    except (OSError, ValueError, AttributeError) as e:
        raise LoraError(f"{path}: not readable JSON with a \"weights_fingerprint\" ({e})") from None
    if not isinstance(found, str):
        raise LoraError(f"{path}: \"weights_fingerprint\" must be a string, got {found!r}")
    return found

