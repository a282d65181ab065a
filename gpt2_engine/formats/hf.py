"""Hugging Face checkpoints, as the Hub publishes GPT-2: a directory with config.json and model.safetensors (or
pytorch_model.bin), read through a name table with strict accounting into core.weights' types, and written back.

The official files (`openai-community/gpt2` on the Hub) store every projection in Conv1D layout, weight shape
(in, out), so a projection is `x @ W + b`. We keep that layout: the safetensors file is memory-mapped and, in float32,
its tensors are used in place, never copied. Every tensor of the file is used once or deliberately ignored (the
causal-mask buffers, the tied lm_head once checked equal to wte), every shape is checked, and a mismatch names the
file, the tensor, the expected and the found shape.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..core.config import GPT2Config, check_size
from ..core.errors import WeightsError
from ..core.pages import FilePages, file_mapping, file_pages, release_pages
from ..core.weights import (Allocator, Block, GPT2Weights, LayerNorm, Linear, PanelMatrix, expected_shapes,
                            named_tensors)
from .files import OutputError, atomic_write, output_directory, what_is
from .pickles import load_pickle

DEFAULT_WEIGHTS = Path("weights")  # the project's default checkpoint directory


# The demo model (scripts/demo.py, `make demo`): a small GPT-2 trained offline where the official weights cannot be
# downloaded, built into the project checkout's .cache/demo/; `latest` is a link to the newest build. "demo" names
# it wherever a checkpoint directory is asked for, from any working directory (demo_caches).
DEMO_CACHE = Path(".cache/demo")  # in the project checkout
DEMO_LATEST = "latest"


DEMO_NAME = "demo"


SAFETENSORS = "model.safetensors"


PYTORCH_BIN = "pytorch_model.bin"


CONFIG = "config.json"


CHECKPOINT_FILES = (CONFIG, SAFETENSORS, PYTORCH_BIN)  # what writing a checkpoint into a folder replaces


# Checkpoint formats we recognise but do not read, so that the error can say what was found.
OTHER_FORMATS = ("tf_model.h5", "flax_model.msgpack", "model.ckpt.index", "64-8bits.tflite", "rust_model.ot")


# Buffers that transformers saves with the weights but that are not parameters: the causal mask.
IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")


def weights_directory(given: Path | None) -> tuple[Path, str]:
    """The checkpoint directory that a `--weights` value names, and a line for the user when it is not `given`.

    None is the default: `weights/`, or the demo model when `weights/` holds no checkpoint and the demo is built (the
    line says so). "demo" names the demo model, unless a directory of that name exists.
    """
    if given is None:
        if not _has_checkpoint(DEFAULT_WEIGHTS) and (demo := demo_weights()) is not None:
            return demo, (f"{DEFAULT_WEIGHTS}/ holds no checkpoint; using the demo model ({_shown(demo)}; "
                          "`make weights` downloads GPT-2's)")
        return DEFAULT_WEIGHTS, ""
    if str(given) == DEMO_NAME and not given.exists():
        if (demo := demo_weights()) is None:
            raise WeightsError(f"{DEMO_NAME}: the demo model is not built (looked in "
                               f"{' and '.join(f'{c}/' for c in demo_caches())}; `make demo` builds it in the project's "
                               "checkout)")
        return demo, ""
    return given, ""


def demo_caches() -> list[Path]:
    """Where the demo model is looked for, in order: the project checkout this package lives in (an editable
    install's; `make demo` builds it there), then the user's cache, $XDG_CACHE_HOME or ~/.cache, under gpt2-engine/
    (as huggingface_hub keeps ~/.cache/huggingface). Never the working directory: a command finds it from anywhere."""
    checkout = Path(__file__).absolute().parents[2]  # gpt2_engine/formats/hf.py -> the checkout holding the package
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt2-engine" / "demo"
    return ([checkout / DEMO_CACHE] if (checkout / "pyproject.toml").is_file() else []) + [user]


def demo_weights() -> Path | None:
    """The demo model's directory (the `latest` link) in the first of demo_caches() that holds a build, or None."""
    return next((c / DEMO_LATEST for c in demo_caches() if _has_checkpoint(c / DEMO_LATEST)), None)


def weights_fingerprint(directory: Path) -> str:
    """Which checkpoint this is: the first 16 hex digits of the sha256 of its weights file, whole (an edit of one
    layer, as model-editing methods make, changes it; sampling the file would miss that). A LoRA adapter records its
    base's, and a resumed run checks it."""
    import hashlib

    digest = hashlib.sha256()
    with open(directory if directory.is_file() else find_weights_file(directory), "rb") as f:  # or a checkpoint file
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _has_checkpoint(directory: Path) -> bool:
    return (directory / SAFETENSORS).is_file() or (directory / PYTORCH_BIN).is_file()


def _shown(link: Path) -> str:
    """`link` as the directory it points to, relative to the working directory where it is below it."""
    target = link.resolve()
    try:
        return str(target.relative_to(Path.cwd()))
    except ValueError:
        return str(target)


def find_weights_file(directory: Path) -> Path:
    """The checkpoint file to read in `directory`: model.safetensors, else pytorch_model.bin."""
    if not directory.exists():
        raise WeightsError(f"{directory}: weights directory does not exist (run `make weights`, or `make demo` offline, or copy the official files there)")
    if not directory.is_dir():
        raise WeightsError(f"{directory}: expected a directory holding {CONFIG} and {SAFETENSORS} or {PYTORCH_BIN}, "
                           f"found {what_is(directory)}")
    for name in (SAFETENSORS, PYTORCH_BIN):
        if (directory / name).is_file():
            return directory / name
        if (directory / name).exists():  # a FIFO or a folder by that name: not missing, and never to be opened
            raise WeightsError(f"{directory / name}: {what_is(directory / name)}, not a regular file")
    others = [name for name in OTHER_FORMATS if (directory / name).exists()]
    if others:
        raise WeightsError(f"{directory}: unsupported weights format {others[0]}; expected {SAFETENSORS} or {PYTORCH_BIN}")
    if (directory / "ckpt.pt").exists():  # nanoGPT's out_dir: its checkpoint is read as a file
        raise WeightsError(f"{directory}: no {SAFETENSORS} or {PYTORCH_BIN}, but nanoGPT's ckpt.pt: pass the file, "
                           f"{directory / 'ckpt.pt'}")
    raise WeightsError(f"{directory}: no {SAFETENSORS} or {PYTORCH_BIN} found (run `make weights`, or `make demo` offline, or copy the official files there)")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint file, memory-mapped where the format allows."""
    if path.name.endswith(".safetensors"):
        try:
            with safe_open(str(path), framework="pt") as f:
                return {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            raise WeightsError(f"{path}: not a readable safetensors file ({_one_line(e)})") from None
    try:
        state = load_pickle(path, mmap=True)
    except ValueError as e:
        raise WeightsError(f"{path}: not a readable PyTorch checkpoint ({e})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise WeightsError(f"{path}: expected a dict of tensors (a state_dict), found {type(state).__name__}")
    return state


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] or type(e).__name__


def load_weights(directory: str | Path, config: GPT2Config, dtype: torch.dtype = torch.float32,
                 resident: bool = True, panels: bool = False, alloc: Allocator | None = None) -> GPT2Weights:
    """Read and check every tensor of the checkpoint in `directory`; raise WeightsError on any mismatch.

    `dtype` is that of the weight matrices (and wte); everything else stays float32. resident=False: the pages that
    checking read are released again (release_pages), for a caller that quantizes the matrices one at a time.
    panels: keep the projections in panels (PanelMatrix) where their shape allows; float32 ones only where the file
    is memory-mapped, and with the file's matrix beside them (PanelMatrix.plain: its pages released until a GEMM
    reads them). alloc: where the panels are written (pages.HugeArena.take; None: new tensors).
    """
    path = find_weights_file(Path(directory))
    raw = read_tensors(path)  # memory-mapped, or a legacy pickle of the file's size
    check_size(config, path, copied=0)  # float32 is used in place; other dtypes are copied one tensor at a time
    return weights_from_tensors(raw, config, path, dtype, resident, panels, alloc)


def weights_from_tensors(raw: dict[str, torch.Tensor], config: GPT2Config, path: Path,
                         dtype: torch.dtype = torch.float32, resident: bool = True, panels: bool = False,
                         alloc: Allocator | None = None) -> GPT2Weights:
    """load_weights' checks and assembly, on tensors by official name (read from `path`, which errors name)."""
    expected = expected_shapes(config)
    tensors, lm_head = official_tensors(raw, expected, config, path)
    check_tensors(tensors, lm_head, expected, path, resident)
    return Assembly(tensors, path, dtype, resident, panels, alloc).weights(config)


def official_tensors(raw: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], config: GPT2Config,
                     path: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The name table's accounting: (the tensors by official name, the lm_head if the file has one); the causal
    masks are ignored, and an unexpected or doubled name is an error."""
    tensors: dict[str, torch.Tensor] = {}
    lm_head: torch.Tensor | None = None
    unexpected: list[str] = []
    for full_name, tensor in raw.items():
        name = full_name.removeprefix("transformer.")  # GPT2LMHeadModel saves with the prefix, the Hub files without
        if IGNORED.fullmatch(name):
            continue
        if name == "lm_head.weight":
            lm_head = tensor
        elif name not in expected:
            unexpected.append(full_name)
        elif name in tensors:
            raise WeightsError(f"{path}: tensor {name} appears twice (with and without the 'transformer.' prefix)")
        else:
            tensors[name] = tensor
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise WeightsError(f"{path}: unexpected tensor {unexpected[0]}{more} (not part of GPT-2 with n_layer={config.n_layer})")
    return tensors, lm_head


def check_tensors(tensors: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                  expected: dict[str, tuple[int, ...]], path: Path, resident: bool) -> None:
    """Every expected tensor present, of its shape, floating-point and finite; the lm_head equal to wte."""
    release = None if resident else path
    for name, shape in expected.items():
        if name not in tensors:
            raise WeightsError(f"{path}: missing tensor {name} (expected shape {list(shape)})")
        _check_tensor(path, name, tensors[name], shape, release)
    if lm_head is None:
        return
    _check_tensor(path, "lm_head.weight", lm_head, expected["wte.weight"], release)
    if not torch.equal(lm_head, tensors["wte.weight"]):
        diff = (lm_head.float() - tensors["wte.weight"].float()).abs().max().item()
        raise WeightsError(f"{path}: lm_head.weight differs from wte.weight (max |diff| {diff:.3g}); GPT-2 ties them")
    if not resident:
        release_pages(lm_head, path)
        release_pages(tensors["wte.weight"], path)


class Assembly:
    """Checked tensors by official name made into GPT2Weights. `dtype` applies to the matrices that matmuls read
    (and wte); biases, layer norms and wpe stay float32 (mixed precision). See load_weights for the rest."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: Path, dtype: torch.dtype, resident: bool,
                 panels: bool, alloc: Allocator | None) -> None:
        self.tensors, self.path, self.dtype, self.resident, self.panels, self.alloc = (
            tensors, path, dtype, resident, panels, alloc)
        self.mappings: list[FilePages] = []  # the file's mappings found so far: one /proc/self/maps read for each

    def t(self, name: str, target: torch.dtype = torch.float32) -> torch.Tensor:
        tensor = self.tensors[name]
        if tensor.dtype == target:
            return tensor
        converted = tensor.to(target)
        if not self.resident:  # the conversion read the file's pages back in; the copy is what is kept
            release_pages(tensor, self.path)
        return converted

    def in_file(self, tensor: torch.Tensor) -> FilePages | None:
        """The pages under `tensor` if it lies in a mapping of the file."""
        for mapping in self.mappings:
            if (pages := mapping.within(tensor)) is not None:
                return pages
        if (mapping := file_mapping(tensor, self.path)) is None:
            return None
        self.mappings.append(mapping)
        return mapping.within(tensor)

    def lin(self, prefix: str) -> Linear:
        weight, dtype = self.tensors[prefix + ".weight"], self.dtype
        if self.panels and PanelMatrix.fits(weight.shape) and weight.is_contiguous():
            if dtype == torch.bfloat16:
                kept = PanelMatrix.of(weight, dtype, alloc=self.alloc)
                if not self.resident:
                    release_pages(weight, self.path)
                return Linear(kept, self.t(prefix + ".bias"))
            # float32: the file's matrix stays beside the panels (PanelMatrix.plain), so only where it is that very
            # matrix, in the mapping; decode reads the panels, and a GEMM's first call reads its pages back
            if dtype == weight.dtype == torch.float32 and (pages := self.in_file(weight)) is not None:
                kept = PanelMatrix.of(weight, dtype, keep=True, alloc=self.alloc)
                pages.release(weight)
                return Linear(kept, self.t(prefix + ".bias"))
        return Linear(self.t(prefix + ".weight", dtype), self.t(prefix + ".bias"))

    def ln(self, prefix: str) -> LayerNorm:
        return LayerNorm(self.t(prefix + ".weight"), self.t(prefix + ".bias"))

    def block(self, i: int) -> Block:
        return Block(ln_1=self.ln(f"h.{i}.ln_1"), c_attn=self.lin(f"h.{i}.attn.c_attn"),
                     attn_c_proj=self.lin(f"h.{i}.attn.c_proj"), ln_2=self.ln(f"h.{i}.ln_2"),
                     c_fc=self.lin(f"h.{i}.mlp.c_fc"), mlp_c_proj=self.lin(f"h.{i}.mlp.c_proj"))

    def weights(self, config: GPT2Config) -> GPT2Weights:
        blocks = tuple(self.block(i) for i in range(config.n_layer))
        wte = self.t("wte.weight", self.dtype)
        return GPT2Weights(wte=wte, wpe=self.t("wpe.weight"), blocks=blocks, ln_f=self.ln("ln_f"), head=wte)


GENERATION_CONFIG = {"bos_token_id": 50256, "eos_token_id": 50256}


def save_checkpoint(directory: str | Path, config: GPT2Config, weights: GPT2Weights, bpe_source: Path) -> None:
    """Write `weights` in the official layout: config.json, model.safetensors (Conv1D shapes, official names, no
    `transformer.` prefix, the tied head left out, as the Hub's files), generation_config.json, and the BPE files
    vocab.json and merges.txt copied from `bpe_source` (a checkpoint directory or the packaged files). Each file is
    written beside its destination and renamed over it, so a reader never sees half a file; a directory this call
    made is removed again when a write fails (a full disk), so a failed save leaves no checkpoint-shaped folder."""
    import shutil

    made = not Path(directory).exists()
    directory = output_directory(Path(directory))
    check_members(directory)
    try:
        write_checkpoint(directory, config, weights, bpe_source)
    except BaseException:
        if made:
            shutil.rmtree(directory, ignore_errors=True)
        raise


# What write_checkpoint writes into a folder (pytorch_model.bin: a stale one is removed)
CHECKPOINT_WRITES = (SAFETENSORS, PYTORCH_BIN, CONFIG, "generation_config.json", "vocab.json", "merges.txt")


def check_members(directory: Path) -> None:
    """Refuse, before anything is written, a folder where a checkpoint file is something other than a regular file
    (links followed): atomic_write writes into a FIFO or device, as cp does, which for one file of a set replaced
    together is never meant (a FIFO blocks, after the files before it were replaced)."""
    for name in CHECKPOINT_WRITES:
        try:
            kind = what_is(directory / name)
        except OSError as e:  # a symlink loop
            raise OutputError(f"{directory / name}: cannot be looked at ({e.strerror or e})") from None
        if kind not in (None, "a regular file"):
            raise OutputError(f"{directory / name}: {kind}, not a regular file; a checkpoint's files are replaced, "
                              "never written into")


def write_checkpoint(directory: Path, config: GPT2Config, weights: GPT2Weights, bpe_source: Path) -> None:
    """save_checkpoint's files, into `directory`."""
    import json
    import shutil

    from safetensors.torch import save_file

    def atomic(name: str, write) -> None:
        atomic_write(directory / name, write)

    def text(content: str):
        return lambda tmp: Path(tmp).write_text(content, encoding="utf-8")

    tensors = {name: t.detach().to(torch.float32).contiguous() for name, t in named_tensors(weights).items()}
    atomic(SAFETENSORS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    # A pytorch_model.bin of the model this one replaces (finetune --overwrite) would leave the folder holding two
    # different models: this loader reads model.safetensors first, another tool might not.
    stale = directory / PYTORCH_BIN
    if stale.is_file() or stale.is_symlink():
        stale.unlink()
    atomic(CONFIG, text(json.dumps(config.to_json_dict(), indent=2) + "\n"))
    atomic("generation_config.json", text(json.dumps(GENERATION_CONFIG, indent=2) + "\n"))
    for (vocab, merges) in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (bpe_source / vocab).is_file() and (bpe_source / merges).is_file():
            atomic("vocab.json", lambda tmp, src=bpe_source / vocab: shutil.copyfile(src, tmp))
            atomic("merges.txt", lambda tmp, src=bpe_source / merges: shutil.copyfile(src, tmp))
            return
    raise WeightsError(f"{bpe_source}: no BPE files (vocab.json + merges.txt or encoder.json + vocab.bpe) to copy")


CHECK_CHUNK = 1 << 20  # elements checked for NaN/Inf at a time

# The dtypes a checkpoint's tensors are read in (torch's float8 types, for one, have no isfinite, and no GPT-2
# checkpoint is stored in them).
READ_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}

# The largest |weight| a checkpoint may hold. A finite weight near float32's limit (wte all 1e38) passes the NaN check
# and turns every logit into NaN at the first matmul; trained weights are nowhere near: the largest in the trained
# and random fixtures is 2.3 (ln_f.weight), and a layer norm's gain or a projection in the thousands would already
# be a model of overflowing activations. 1e4 leaves three orders of magnitude above any trained weight and refuses
# what is not one, by name, at load; checking it costs the same single pass as the NaN check (the chunk's max |w|).
WEIGHT_LIMIT = 1e4


def check_values(path: Path, name: str, tensor: torch.Tensor, limit: float | None = WEIGHT_LIMIT,
                 release: Path | None = None) -> None:
    """A checkpoint tensor's dtype one the engine reads and its values finite and (with `limit`) at most `limit` in
    magnitude, in one pass over chunks; with `release` (the mapped file), each chunk's pages are released once read."""
    if tensor.dtype not in READ_DTYPES:
        kind = str(tensor.dtype).removeprefix("torch.")
        raise WeightsError(f"{path}: tensor {name} has dtype {kind}, expected one of {', '.join(READ_DTYPES.values())}")
    # in chunks: a check over all of wte at once holds temporaries of its size (about 250 MB more at the peak)
    flat, largest = tensor.reshape(-1), 0.0
    pages = None if release is None else file_pages(flat, release)
    for i in range(0, flat.numel(), CHECK_CHUNK):
        chunk = float(flat[i : i + CHECK_CHUNK].abs().amax())  # NaN where the chunk holds one
        if math.isnan(chunk) or chunk > largest:  # and no later chunk replaces a NaN
            largest = chunk
        if pages is not None:
            pages.release(flat[i : i + CHECK_CHUNK])
    if not math.isfinite(largest):
        bad = int((~torch.isfinite(tensor)).sum())
        raise WeightsError(f"{path}: tensor {name} holds {bad} NaN/Inf values, expected finite weights")
    if limit is not None and largest > limit:
        raise WeightsError(f"{path}: tensor {name} holds values up to {largest:.3g} in magnitude, expected at most "
                           f"{limit:g} (trained GPT-2 weights are of order 1; larger ones overflow float32 activations)")


def _check_tensor(path: Path, name: str, tensor: torch.Tensor, shape: tuple[int, ...],
                  release: Path | None = None) -> None:
    """Shape, then check_values: the dtype, finite values of a plausible size."""
    if tuple(tensor.shape) != shape:
        raise WeightsError(f"{path}: tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}")
    check_values(path, name, tensor, WEIGHT_LIMIT, release)

