"""`gpt2 merge-lora BASE ADAPTER OUT`: fold a LoRA adapter into its base, W + s A B, and write the result as an
ordinary checkpoint in the official layout (transformers, `gpt2 --weights` and every tool load it; no adapter code
needed). `gpt2 finetune --lora ... --merge` runs the same function on the run's best adapter."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core.config import GPT2Config
from ..formats.peft import check_base, load_adapter
from ..core.lora import merge
from ..core.tokenizer import load_tokenizer
from ..formats.files import check_not_replacing
from ..formats.hf import CHECKPOINT_FILES, CONFIG, find_weights_file, load_weights, save_checkpoint
from ..formats.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ..options import UsageError, add_force_option, add_overwrite_option
from ..train.trainer import OPTIMIZER, STATE


def merge_lora(base: Path, adapter: Path, out: Path, force: bool = False, overwrite: bool = False,
               in_adapter: bool = False) -> None:
    """Write base + adapter, merged, to `out` (official layout; each file written beside its destination and
    renamed over it); an adapter recording another base is an error unless `force`, a model already in `out`
    unless `overwrite`, and `out` inside the adapter's folder unless `in_adapter` (a caller that owns that folder)."""
    find_weights_file(base)
    check_out(base, adapter, out, overwrite, in_adapter)
    config = GPT2Config.from_json(base / CONFIG)
    lora = load_adapter(adapter, config)
    if not force:
        check_base(lora, adapter, base)
    tokenizer = load_tokenizer(base)
    save_checkpoint(out, config, merge(load_weights(base, config), lora), tokenizer.source)


def check_out(base: Path, adapter: Path, out: Path, overwrite: bool, in_adapter: bool) -> None:
    """Refuse an `out` that is the base or the adapter, lies inside the base (or the adapter, unless `in_adapter`),
    holds an adapter or a run's resume state, or holds a model and not `overwrite`."""
    for given, what in ((base, "the base checkpoint"), (adapter, "the adapter")):
        if out.resolve() == given.resolve():
            raise UsageError(f"{out}: is {what} itself; write the merged model somewhere else")
    if out.resolve().is_relative_to(base.resolve()):  # e.g. the base run's last/, whose optimizer state would go stale
        raise UsageError(f"{out}: is inside the base checkpoint {base}; write the merged model somewhere else")
    if not in_adapter and out.resolve().is_relative_to(adapter.resolve()):
        # a model of hundreds of MB would travel with the adapter (copied, uploaded, served) and a later run there
        # replace it; finetune --merge alone writes one there, OUT/merged in the run folder it owns
        raise UsageError(f"{out}: is inside the adapter {adapter}; write the merged model somewhere else")
    held = [name for name in (ADAPTER_CONFIG, STATE, OPTIMIZER) if (out / name).exists()]
    if held:  # an adapter run's last/: a model beside its state would make the folder neither (--overwrite too)
        raise UsageError(f"{out}: holds an adapter or a run's resume state ({', '.join(held)}); write the merged "
                         f"model somewhere else")
    check_not_replacing(out, overwrite, CHECKPOINT_FILES + (ADAPTER_CONFIG, ADAPTER_WEIGHTS))


def add_merge_lora(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("merge-lora", help="fold a LoRA adapter into its base model and save the result",
                       description="Merge a LoRA adapter (PEFT's format: from gpt2 finetune --lora or peft) into the "
                                   "float32 base checkpoint it was trained on, and write the merged model in the "
                                   "official layout.",
                       epilog="example: gpt2 merge-lora weights runs/notes-lora runs/notes-merged")
    p.add_argument("base", type=Path, metavar="BASE", help="the base checkpoint directory")
    p.add_argument("adapter", type=Path, metavar="ADAPTER", help="the adapter directory (adapter_config.json, ...)")
    p.add_argument("out", type=Path, metavar="OUT", help="where the merged checkpoint goes")
    add_force_option(p)
    add_overwrite_option(p, "a model already in OUT")
    p.set_defaults(run=run_merge_lora)


def run_merge_lora(args: argparse.Namespace) -> int:
    merge_lora(args.base, args.adapter, args.out, args.force, args.overwrite)
    print(f"merge-lora: {args.adapter} merged into {args.base}, saved in {args.out}", file=sys.stderr)
    return 0
