"""`gpt2 finetune`: train GPT-2 on your own text with the engine's hand-written backward (train/trainer.py), the whole
model or (--lora) a LoRA adapter on a frozen base, float32 or quantized (--quantize: QLoRA).

This module reads the command line and the data, and renders the trainer's events: a tqdm bar on stderr (step, loss,
learning rate, tokens/s, ETA), the evaluations and samples above it, every event as a line of the --log JSONL, and a
summary line at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch
from tqdm import tqdm

from ..formats.checkpoints import read_checkpoint
from ..core.config import PRESETS, GPT2Config
from ..formats.shards import TokenStream, shard_files
from ..core.errors import WeightsError
from ..core.lora import ALL_TARGETS, LoraSettings, parse_targets
from ..core.quantize import FORMATS, quantize_weights
from ..core.tokenizer import Tokenizer, load_tokenizer
from ..core.weights import GPT2Weights
from ..formats.hf import (CHECKPOINT_WRITES, CONFIG, find_weights_file, load_weights, weights_fingerprint,
                          weights_from_tensors)
from ..formats.peft import ADAPTER_BASE, ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ..formats.files import check_not_an_input, files_of
from ..documents import expand_paths, read_documents
from ..options import UsageError, add_overwrite_option, positive_int, progress_bar, seed_value, thread_count
from ..runtime.generate import two_samples
from ..train.step import initial_weights, trainable_copy
from ..train.trainer import (LAST, Base, Eval, Event, Output, Sample, Saved, Started, Step, Stopped, Trainer,
                             TrainSettings, record)
from .merge import merge_lora

INIT_NAMES = {"small": "gpt2", "medium": "gpt2-medium", "large": "gpt2-large", "xl": "gpt2-xl"}


# What a run writes at the top of --out, replacing what is there at each save: a checkpoint, or a LoRA run's adapter
SAVED_FILES = CHECKPOINT_WRITES + (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_BASE)


# The folders of --out a run replaces whole: the resume state (written as last.new, the one before renamed last.old)
SAVED_FOLDERS = {LAST: "the run's resume state", LAST + ".new": "the resume state being written",
                 LAST + ".old": "the resume state being replaced"}


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise ValueError
    return value


fraction.__name__ = "fraction in [0, 1)"


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise ValueError
    return value


non_negative_float.__name__ = "non-negative number"


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise ValueError
    return value


positive_float.__name__ = "positive number"

MAX_ACCUMULATE = 4096  # micro-batches an update: past this, one update outlasts any run a CPU finishes
MAX_EPOCHS = 10_000


def at_most(parse: Callable[[str], float], limit: int) -> Callable[[str], float]:
    """A flag's parser that also refuses values above `limit`, saying so (1e9 epochs started a run without end)."""
    def bounded(text: str) -> float:
        value = parse(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{text}: at most {limit:,}")
        return value

    bounded.__name__ = parse.__name__
    return bounded


def add_finetune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "finetune", help="train the model on your own text (hand-written backward, AdamW)",
        description="Fine-tune GPT-2 on text files, .jsonl files (one {\"text\": ...} per line), folders of them or "
                    "stdin (-), with the engine's own backward pass and AdamW. Writes the best validation checkpoint "
                    "to --out in the official layout (transformers and gpt2 --weights both load it), the latest to "
                    "--out/last with the state that --resume continues from exactly. Token shards (gpt2 tokenize, "
                    "llm.c's .bin) are read memory-mapped, as the token stream they hold.",
        epilog="example: gpt2 finetune notes/ --weights weights --out runs/notes --steps 300 --sample-every 100")
    p.add_argument("data", nargs="+", metavar="DATA", help="text or .jsonl files, folders of them, or - for stdin; or llm.c token shards (.bin files or a folder of them, e.g. from gpt2 tokenize), memory-mapped")
    p.add_argument("--weights", type=Path, metavar="DIR",
                   help="checkpoint to start from (default weights/, or the demo model when weights/ holds none; "
                        "`demo` names it); with --init, only its BPE files are used")
    p.add_argument("--init", metavar="CONFIG",
                   help="train from scratch instead: small|medium|large|xl, a preset name (gpt2, gpt2-medium, ...) "
                        "or a config.json; GPT-2's initialisation")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where checkpoints go")
    p.add_argument("--context", type=positive_int, metavar="N", help="tokens a window (default min(512, n_positions))")
    p.add_argument("--batch-size", type=positive_int, default=4, metavar="B", help="windows a micro-batch (default 4)")
    p.add_argument("--accumulate", type=at_most(positive_int, MAX_ACCUMULATE), default=1, metavar="K",
                   help="micro-batches an update (gradient accumulation; default 1)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=positive_int, metavar="N", help="updates to train for")
    length.add_argument("--epochs", type=at_most(positive_float, MAX_EPOCHS), metavar="E", help="passes over the data (default 1)")
    p.add_argument("--lr", type=positive_float, default=1e-4, help="peak learning rate (default 1e-4)")
    p.add_argument("--min-lr", type=non_negative_float, help="learning rate at the end of the cosine decay (default lr/10)")
    p.add_argument("--warmup", type=int, metavar="N", help="updates of linear warmup (default 5%% of them, at most 100)")
    p.add_argument("--weight-decay", type=non_negative_float, default=0.1,
                   help="AdamW's decoupled weight decay on the 2-D weight matrices (default 0.1)")
    p.add_argument("--decay-embeddings", action="store_true", help="apply weight decay to wte and wpe too")
    p.add_argument("--clip", type=non_negative_float, default=1.0, help="global gradient-norm clip, 0 for none (default 1.0)")
    p.add_argument("--dropout", type=fraction, default=0.0,
                   help="dropout on embeddings, attention and residual paths (GPT-2 pretrained with 0.1; default 0)")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val", nargs="+", metavar="FILE", help="validation files (default: a fraction of DATA)")
    val.add_argument("--val-fraction", type=fraction, default=0.05, metavar="F",
                     help="fraction of the documents held out for validation (default 0.05)")
    p.add_argument("--eval-every", type=positive_int, metavar="N", help="updates between evaluations (default: 10 a run)")
    p.add_argument("--sample-every", type=int, default=0, metavar="N", help="updates between samples (default: none)")
    p.add_argument("--sample-prompt", default="", metavar="TEXT", help="prompt of the samples (default <|endoftext|>)")
    p.add_argument("--sample-tokens", type=positive_int, default=40, metavar="N", help="tokens a sample (default 40)")
    p.add_argument("--save-every", type=positive_int, metavar="N", help="updates between saves of last/ (default: at each evaluation)")
    p.add_argument("--early-stopping", type=positive_int, metavar="PATIENCE",
                   help="stop after this many evaluations without a new best")
    p.add_argument("--recompute", action="store_true",
                   help="keep only each block's input and recompute the rest in the backward (activation "
                        "checkpointing): much less memory, about a third more time a step, the same results")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out/last exactly")
    add_overwrite_option(p, "a model already in --out")
    lora = p.add_argument_group("LoRA", "train a low-rank adapter on the frozen base instead of the whole model; the "
                                        "checkpoints are then adapters in PEFT's format")
    lora.add_argument("--lora", type=positive_int, metavar="R", help="train a LoRA adapter of rank R")
    lora.add_argument("--lora-alpha", type=positive_float, metavar="A", help="its scale is A / R (default 2R)")
    lora.add_argument("--lora-dropout", type=fraction, metavar="P", help="dropout on the adapters' input (default 0)")
    lora.add_argument("--lora-targets", metavar="NAMES",
                      help=f"projections to adapt, comma-separated (default {','.join(ALL_TARGETS)}; c_proj: both)")
    lora.add_argument("--quantize", choices=list(FORMATS),
                      help="freeze the base in blockwise int8 or int4 (QLoRA: about a quarter / an eighth of the "
                           "memory); the adapters stay float32")
    lora.add_argument("--merge", action="store_true",
                      help="at the end, also write the base with the best adapter merged in to OUT/merged")
    p.add_argument("--seed", type=seed_value, default=0, help="data order, dropout masks and the adapters' init (default 0)")
    p.add_argument("--threads", type=thread_count, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--log", type=Path, metavar="FILE.jsonl", help="append every event (steps, evaluations, ...) as JSON lines")
    p.set_defaults(run=run_finetune)


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    if args.warmup is not None and args.warmup < 0:
        raise UsageError(f"--warmup: expected an integer >= 0, got {args.warmup}")
    if args.sample_every < 0:
        raise UsageError(f"--sample-every: expected an integer >= 0, got {args.sample_every}")
    return TrainSettings(context=args.context, batch_size=args.batch_size, accumulate=args.accumulate,
                         steps=args.steps, epochs=args.epochs, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup,
                         weight_decay=args.weight_decay, decay_embeddings=args.decay_embeddings,
                         clip=args.clip or None, dropout=args.dropout, val_fraction=args.val_fraction,
                         eval_every=args.eval_every, sample_every=args.sample_every, sample_prompt=args.sample_prompt,
                         sample_tokens=args.sample_tokens, save_every=args.save_every,
                         early_stopping=args.early_stopping, seed=args.seed, recompute=args.recompute)


def init_config(spec: str) -> GPT2Config:
    """The config that --init names: small|medium|large|xl, a preset, or a config.json file."""
    name = INIT_NAMES.get(spec, spec)
    if name in PRESETS:
        return PRESETS[name]
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        try:
            return GPT2Config.from_json(path)
        except WeightsError as e:
            raise UsageError(f"--init: {e}") from None
    raise UsageError(f"--init: {spec!r} is neither small|medium|large|xl, a preset ({', '.join(PRESETS)}) nor a "
                     "config.json file")


def lora_from_args(args: argparse.Namespace) -> LoraSettings | None:
    """The adapter settings, or None for full fine-tuning; flags that need --lora without it are errors."""
    if args.lora is None:
        for flag, value in (("--lora-alpha", args.lora_alpha), ("--lora-dropout", args.lora_dropout),
                            ("--lora-targets", args.lora_targets), ("--merge", args.merge or None),
                            ("--quantize", args.quantize)):
            if value is not None:
                extra = " (QLoRA; full fine-tuning trains float32 weights)" if flag == "--quantize" else ""
                raise UsageError(f"{flag} needs --lora R{extra}")
        return None
    if args.init:
        raise UsageError("--lora adapts a pretrained model; --init trains one from scratch (use one or the other)")
    return LoraSettings(r=args.lora, alpha=args.lora_alpha or 2.0 * args.lora, dropout=args.lora_dropout or 0.0,
                        targets=parse_targets(args.lora_targets) if args.lora_targets is not None else ALL_TARGETS)


def read_data(args: argparse.Namespace, stdin: IO[bytes]) -> tuple[list[str] | TokenStream, list[str] | TokenStream | None]:
    """(training data, validation data or None): token shards as the memory-mapped stream they hold, or the texts
    of the documents; --val must be of the same kind as DATA."""
    shards = shard_files(args.data)  # llm.c's token shards: memory-mapped, trained on as the stream they hold
    if shards is not None:
        stream = TokenStream.of(shards)
        val_shards = shard_files(args.val) if args.val else None
        if args.val and val_shards is None:
            raise UsageError("--val: give token shards too when DATA is token shards")
        return stream, TokenStream.of(val_shards) if val_shards else None
    docs = read_documents(expand_paths(args.data), stdin)
    if not docs:
        raise UsageError("no documents: DATA named no files with text")
    val = [text for _, text in read_documents(expand_paths(args.val), stdin)] if args.val else None
    if args.val and shard_files(args.val) is not None:
        raise UsageError("--val: give text too when DATA is text")
    return [text for _, text in docs], val


@dataclass(frozen=True)
class Start:
    """What a run starts from: the model's config, the tokenizer, the weights (trainable, or the frozen base of an
    adapter) and what the checkpoints record of them."""

    config: GPT2Config
    tokenizer: Tokenizer
    weights: GPT2Weights
    base: str  # the resume check's name for the weights
    fingerprint: str  # the base file's, recorded in an adapter ("" for --init)


def start_from_init(args: argparse.Namespace, lora: LoraSettings | None) -> Start:
    """--init: GPT-2's initialisation of the config it names; the BPE files of --weights where it is a directory."""
    config = init_config(args.init)
    tokenizer = load_tokenizer(args.weights if args.weights.is_dir() else None)
    weights = initial_weights(config, torch.Generator().manual_seed(args.seed))
    return Start(config, tokenizer, weights,
                 "init:" + json.dumps(config.to_json_dict(), sort_keys=True) + f":seed={args.seed}", "")


def start_from_file(args: argparse.Namespace, lora: LoraSettings | None) -> Start:
    """nanoGPT's ckpt.pt or llm.c's model file (formats/checkpoints.py), with GPT-2's BPE."""
    config, tensors = read_checkpoint(args.weights)
    tokenizer = load_tokenizer(None)
    base = fingerprint = weights_fingerprint(args.weights)
    weights = weights_from_tensors(tensors, config, args.weights)
    if lora is None:
        weights = trainable_copy(weights, config)
    elif args.quantize:
        weights = quantize_weights(weights, args.quantize)
        base += f":{args.quantize}"
    return Start(config, tokenizer, weights, base, fingerprint)


def start_from_directory(args: argparse.Namespace, lora: LoraSettings | None) -> Start:
    """A checkpoint directory in the official layout: owned float32 copies to train, or (LoRA) the frozen base used
    in place from the mapped file, or quantized with its float32 pages released as it goes."""
    find_weights_file(args.weights)
    config = GPT2Config.from_json(args.weights / CONFIG)
    tokenizer = load_tokenizer(args.weights)
    base = fingerprint = weights_fingerprint(args.weights)
    if lora is None:
        weights = trainable_copy(load_weights(args.weights, config), config)
    else:
        weights = load_weights(args.weights, config, resident=not args.quantize)
        if args.quantize:
            weights = quantize_weights(weights, args.quantize, find_weights_file(args.weights))
            base += f":{args.quantize}"
    return Start(config, tokenizer, weights, base, fingerprint)


def build_trainer(args: argparse.Namespace, stdin: IO[bytes]) -> Trainer:
    settings = settings_from_args(args)
    lora = lora_from_args(args)
    data, val = read_data(args, stdin)
    load = start_from_init if args.init else start_from_file if args.weights.is_file() else start_from_directory
    start = load(args, lora)
    if start.tokenizer.n_vocab > start.config.vocab_size:
        raise UsageError(f"the tokenizer has {start.tokenizer.n_vocab} tokens, more than the model's vocab_size "
                         f"{start.config.vocab_size}")
    base = Base(start.base, lora, str(args.weights.resolve()) if lora else "", start.fingerprint if lora else "")
    return Trainer(start.weights, start.config, start.tokenizer, data, settings, val_texts=val, base=base,
                   output=Output(args.out, args.resume, args.overwrite),
                   sampler=functools.partial(two_samples, config=start.config, tokenizer=start.tokenizer))


class Progress:
    """The run on stderr: a tqdm bar (step, loss, learning rate, tokens/s) and, above it, the evaluations, samples
    and the reason a run stopped early; each event also as a line of the --log JSONL."""

    def __init__(self, log: IO[str] | None) -> None:
        self.log, self.bar, self.log_failed = log, None, False
        self.first_eval: Eval | None = None
        self.last_eval: Eval | None = None
        self.show: dict[type, Callable] = {Started: self.started, Step: self.stepped, Eval: self.evaluated,
                                           Sample: self.sampled, Saved: lambda event: None, Stopped: self.stopped}

    def __call__(self, event: Event) -> None:
        if self.log is not None:
            try:
                self.log.write(json.dumps(record(event)) + "\n")
                self.log.flush()
            except OSError as e:  # a full disk under the log, not under --out
                self.log_failed = True
                raise UsageError(f"--log {self.log.name}: cannot write ({e.strerror or e})") from None
        self.show[type(event)](event)

    def started(self, event: Started) -> None:
        print(f"finetune: {event.parameters:,} parameters | {event.train_tokens:,} training tokens in "
              f"{event.windows:,} windows | {event.val_tokens:,} validation tokens | {event.steps:,} updates "
              f"of {event.tokens_per_step:,} tokens" + (f" | resuming at update {event.first_step}"
                                                          if event.first_step else ""), file=sys.stderr)
        if event.warning:
            print(f"gpt2 finetune: warning: {event.warning}", file=sys.stderr)
        self.bar = progress_bar(total=event.steps, initial=event.first_step, desc="finetune", unit="step")

    def stepped(self, event: Step) -> None:
        self.bar.update(1)
        self.bar.set_postfix_str(f"loss {event.loss:.4f} | lr {event.lr:.2e} | {event.tokens_per_second:,.0f} tok/s")

    def evaluated(self, event: Eval) -> None:
        self.first_eval = self.first_eval or event
        self.last_eval = event
        tqdm.write(f"step {event.step}: validation loss {event.val_loss:.4f}, perplexity {event.val_ppl:.2f}"
                   + (" (best, saved)" if event.best else ""), file=sys.stderr)

    def sampled(self, event: Sample) -> None:
        tqdm.write(f"step {event.step}: greedy: {event.greedy!r}\nstep {event.step}: sampled: {event.sampled!r}",
                   file=sys.stderr)

    def stopped(self, event: Stopped) -> None:
        tqdm.write(f"step {event.step}: {event.reason}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log is not None:
            try:
                self.log.close()
            except OSError as e:  # what a failed write left buffered: named once, by __call__
                if not self.log_failed:
                    raise UsageError(f"--log {self.log.name}: cannot write ({e.strerror or e})") from None


def open_log(path: Path | None) -> IO[str] | None:
    """--log FILE, opened to append (None without it)."""
    if path is None:
        return None
    try:
        return open(path, "a", encoding="utf-8")
    except OSError as e:
        raise UsageError(f"--log {path}: cannot write ({e.strerror or e})") from None


def summary(trainer: Trainer, progress: Progress, out: Path, wall: float) -> str:
    """The last line: the best validation loss (from the first evaluation's) and where it is saved, the tokens and
    updates trained, the wall time."""
    result = trainer.result([])
    first, last = progress.first_eval, progress.last_eval
    if result.best_val_loss is not None:
        before = f" (from {first.val_loss:.4f} at step {first.step})" if first and first is not last else ""
        head = (f"best validation loss {result.best_val_loss:.4f} (perplexity {math.exp(result.best_val_loss):.2f}) "
                f"at step {result.best_step}{before}, saved in {out}")
    else:
        head = f"no validation data; the last model is saved in {out}"
    if trainer.lora is not None:
        head = head.replace("saved in", "adapter saved in")
    return f"finetune: {head} | {result.tokens:,} tokens trained in {result.steps} updates | {wall:.1f} s"


def check_out(args: argparse.Namespace) -> None:
    """Refuse an --out that is, or holds, the --weights checkpoint trained from: --overwrite would replace the very
    model the run starts from (convert and merge-lora refuse their sources the same way)."""
    if getattr(args, "weights", None) is None or args.out is None or args.resume:
        return
    base, out = Path(args.weights).resolve(), Path(args.out).resolve()
    if base == out or base.is_relative_to(out):
        raise UsageError(f"--out {args.out}: holds the --weights checkpoint {args.weights} the run starts from; write "
                         "the run somewhere else")


def check_log(args: argparse.Namespace) -> None:
    """Refuse a --log that is one of the run's inputs (a DATA or --val file, a file of the --weights checkpoint) or
    lies in a DATA or --val folder: appending JSON lines would damage it, or be read as training text next time."""
    if args.log is None:
        return
    inputs: dict[Path, str] = {}
    for flag, paths in (("DATA", args.data), ("--val", args.val or [])):
        for given in (Path(p) for p in paths if p != "-"):
            if given.is_dir() and Path(args.log).resolve().is_relative_to(given.resolve()):
                raise UsageError(f"--log {args.log}: is in {given}, a {flag} folder whose files are read as training "
                                 f"text; write the log somewhere else")
            inputs[given] = f"a {flag} file"
    inputs.update(files_of(getattr(args, "weights", None), "the --weights checkpoint"))
    inputs.update(files_of(getattr(args, "init", None), "the --init config"))
    if args.resume and args.out is not None:  # the state the run goes on from
        inputs.update(files_of(Path(args.out) / "last", "the run's resume state"))
    check_not_an_input(Path(args.log), inputs, "--log")
    check_log_not_saved(args)


def check_log_not_saved(args: argparse.Namespace) -> None:
    """Refuse a --log that names a file the run saves into --out (with --overwrite the save replaced the log,
    silently; without it the log, made first, looked like a model already there), existing yet or not."""
    try:
        log, out = Path(args.log).resolve(), Path(args.out).resolve()
    except (OSError, RuntimeError):
        return  # a symlink loop: opening the log names it
    if log.parent == out and log.name in SAVED_FILES:
        raise UsageError(f"--log {args.log}: is {log.name} in --out {args.out}, a file of the checkpoint the run saves "
                         "there, which replaces the log; write the log somewhere else")
    folders = {**SAVED_FOLDERS, **({"merged": "--merge's checkpoint"} if getattr(args, "merge", False) else {})}
    for name, what in folders.items():
        if log.is_relative_to(out / name):
            raise UsageError(f"--log {args.log}: is in {args.out / name}, {what}, which the run replaces whole; write "
                             "the log somewhere else")


def run_finetune(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    check_out(args)
    check_log(args)
    trainer = build_trainer(args, sys.stdin.buffer)
    progress = Progress(open_log(args.log))
    t0 = time.perf_counter()
    try:
        for event in trainer.run():
            progress(event)
    finally:
        progress.close()
    print(summary(trainer, progress, args.out, time.perf_counter() - t0), file=sys.stderr)
    if args.merge:
        merge_lora(args.weights, args.out, args.out / "merged", overwrite=True,
                   in_adapter=True)  # the run owns its --out
        print(f"finetune: the base with the adapter merged in is saved in {args.out / 'merged'}", file=sys.stderr)
    return 0
