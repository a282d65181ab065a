"""`gpt2 convert SRC DST --to hf|llmc|gguf`: a checkpoint from any format the engine reads (a Hugging Face directory,
nanoGPT's ckpt.pt, llm.c's model file, a GGUF) written as a Hugging Face directory (transformers and every `gpt2`
command load it), llm.c's model file (llm.c's train_gpt2.c loads it) or a GGUF (llama.cpp runs it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..formats.checkpoints import checkpoint_kind, read_checkpoint
from ..formats.files import check_not_replacing, check_seekable, what_is, written_into
from ..formats.gguf import GGUF_SEEKS, write_gguf
from ..formats.llmc import write_llmc
from ..core.config import GPT2Config
from ..core.tokenizer import load_tokenizer
from ..formats.hf import CHECKPOINT_FILES, CONFIG, load_weights, save_checkpoint, weights_from_tensors
from ..core.weights import GPT2Weights, named_tensors
from ..options import UsageError, add_overwrite_option

TARGETS = {"hf": ("f32",), "llmc": ("f32", "bf16"), "gguf": ("f32", "f16", "q8_0")}
LLMC_DTYPES = {"f32": "float32", "bf16": "bfloat16"}
KINDS = {"hf": "a Hugging Face directory", "nanogpt": "nanoGPT's ckpt.pt", "llmc": "llm.c's model file",
         "gguf": "a GGUF file"}


def read_any(src: Path) -> tuple[str, GPT2Config, GPT2Weights]:
    """(the source's kind, its config, its float32 weights), whatever format it is in."""
    kind = checkpoint_kind(src)
    if kind == "hf":
        config = GPT2Config.from_json(src / CONFIG)
        return kind, config, load_weights(src, config)
    config, tensors = read_checkpoint(src)
    return kind, config, weights_from_tensors(tensors, config, src)


def check_destination(src: Path, dst: Path, to: str, dtype: str, overwrite: bool = False) -> None:
    """Refuse, before anything is read, a target or type that does not exist, writing over the source, a model
    already at the destination unless `overwrite`, and a destination of the wrong kind (a directory for one file;
    a file, socket or device for a directory)."""
    if to not in TARGETS:
        raise UsageError(f"--to {to}: expected one of {', '.join(TARGETS)}")
    if dtype not in TARGETS[to]:
        raise UsageError(f"--type {dtype}: a {to} checkpoint is written as {' or '.join(TARGETS[to])}")
    check_not_the_source(src, dst)
    check_not_replacing(dst, overwrite, CHECKPOINT_FILES)
    if to == "hf":
        if dst.exists() and not dst.is_dir():
            raise UsageError(f"{dst}: {'a file' if dst.is_file() else what_is(dst)}; a Hugging Face checkpoint is a "
                             "directory")
        return
    if dst.is_dir():
        raise UsageError(f"{dst}: a directory; a{'n llm.c model' if to == 'llmc' else ' GGUF'} is one file")
    written_into(dst)  # a socket or a block device is refused before the checkpoint is read
    if to == "gguf":
        check_seekable(dst, GGUF_SEEKS)  # a FIFO too, before the checkpoint is read and half a file is written


def check_not_the_source(src: Path, dst: Path) -> None:
    """Refuse a destination that is the source, or an existing path inside a source directory: one of its files
    (config.json, the weights, the BPE files) or folders, which writing would destroy while it is being read. A new
    file beside them (model.gguf next to model.safetensors, as Hugging Face repositories keep several formats)
    replaces nothing and is allowed."""
    if dst.exists() and dst.resolve() == src.resolve():
        raise UsageError(f"{dst}: is the source itself; write the converted checkpoint somewhere else")
    target = dst.resolve()  # through links and `..`, also past a folder not made yet (src/new/../config.json)
    if target.exists() and src.is_dir() and target.is_relative_to(src.resolve()):
        raise UsageError(f"{dst}: an existing {'folder' if target.is_dir() else 'file'} of the source checkpoint {src}, "
                         "which writing would destroy; write the converted checkpoint somewhere else (or to a new "
                         "file)")


def convert(src: Path, dst: Path, to: str, dtype: str = "f32", overwrite: bool = False) -> str:
    """Write `src` as `to` at `dst` (a model already there only if `overwrite`); returns the source's kind."""
    check_destination(src, dst, to, dtype, overwrite)
    kind, config, weights = read_any(src)
    bpe = load_tokenizer(src if kind == "hf" else None).source
    if to == "hf":
        save_checkpoint(dst, config, weights, bpe)
        return kind
    dst.parent.mkdir(parents=True, exist_ok=True)
    if to == "llmc":
        write_llmc(dst, config, named_tensors(weights), LLMC_DTYPES[dtype])
    else:
        write_gguf(dst, config, named_tensors(weights), bpe, dtype)
    return kind


def add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint between Hugging Face, nanoGPT, llm.c and GGUF formats",
                       description="Read a checkpoint in any format the engine reads (a Hugging Face directory, "
                                   "nanoGPT's ckpt.pt, llm.c's model .bin, a GGUF; told apart by content) and write it "
                                   "as a Hugging Face directory, llm.c's model file or a GGUF that llama.cpp runs.",
                       epilog="examples:\n  gpt2 convert out/ckpt.pt gpt2-nano --to hf\n"
                              "  gpt2 convert weights gpt2_124M.bin --to llmc\n"
                              "  gpt2 convert weights gpt2-q8_0.gguf --to gguf --type q8_0\n"
                              "  gpt2 convert gpt2_124M_bf16.bin hf-out --to hf",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, metavar="SRC", help="the checkpoint to read")
    p.add_argument("dst", type=Path, metavar="DST", help="where to write (a directory for hf, a file for llmc and gguf)")
    p.add_argument("--to", required=True, choices=sorted(TARGETS), help="the format to write")
    p.add_argument("--type", default="f32", choices=["f32", "bf16", "f16", "q8_0"],
                   help="the stored type (default f32; llmc also bf16, llm.c's version 5 file; gguf also f16 and "
                        "q8_0, llama.cpp's)")
    add_overwrite_option(p, "a file or checkpoint already at DST")
    p.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    kind = convert(args.src, args.dst, args.to, args.type, args.overwrite)
    print(f"gpt2 convert: {args.src} ({KINDS[kind]}) written to {args.dst} as {args.to} ({args.type})", file=sys.stderr)
    return 0
