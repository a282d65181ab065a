"""Fine-tuning (and training from scratch): the data, the loop, evaluation, samples, checkpoints and exact resume.

The loop is a generator of events (Step, Eval, Sample, Saved, Stopped) that `gpt2 finetune` renders as a progress
bar and a JSONL log and that `GPT2.finetune` drains; nothing here prints. The step itself is train/step.py's
hand-written forward and backward and train/optim.py's AdamW. Samples come from the caller's
Sampler (the runtime's generator): training imports nothing of the serving runtime.

Data: the documents are joined with <|endoftext|> after each (gpt-2-simple's convention) into one token stream,
cut into windows of context + 1 tokens that overlap by one (inputs and next-token targets). Window k of the run is
window perm_e[k mod n] of epoch e = k // n, where perm_e is a permutation drawn from (seed, e): the data position of
any step follows from the step number alone, which is what makes a resumed run read the same batches.

LoRA (core/lora.py): with `lora` settings the given weights are the frozen base (float32 or quantized) and only a
new adapter is trained; checkpoints are then the adapter alone, in PEFT's format, everything else as below.

Files in `out`: the best validation checkpoint in the official layout at the top, and `last/` (the latest, also
official, plus optimizer.safetensors and trainer_state.json for --resume). `last/` is replaced by writing
`last.new/` in full, then renaming `last` to `last.old` and `last.new` to `last`: a run killed at any moment leaves
one complete checkpoint, which the next run recovers (recover_last) before it reads anything.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from ..core.config import GPT2Config, read_json
from ..core.errors import GPT2EngineError, InputError, WeightsError, one_line
from ..core.scalars import as_int, as_real, described
from ..formats.files import what_is
from ..formats.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapter, save_adapter
from ..core.lora import LoraAdapter, LoraError, LoraSettings, new_adapter, trainable
from ..formats.shards import TokenStream
from ..core.tokenizer import Tokenizer
from ..formats.hf import SAFETENSORS, save_checkpoint
from ..core.pages import available_memory
from ..core.weights import GPT2Weights, QuantizedMatrix, expected_shapes, named_tensors
from .optim import AdamW, AdamWSettings, clip_factor, learning_rate
from .step import Buffers, adapter_gradients, decayed, forward_loss, zeros_like

STATE = "trainer_state.json"
OPTIMIZER = "optimizer.safetensors"
LAST = "last"
STATE_VERSION = 1


# Below this many validation tokens, the validation loss moves with which few tokens happen to be held out more than
# with the model (its standard error is several percent of the loss), so the "best" checkpoint is chosen on noise.
MIN_VAL_TOKENS = 1000


class TrainError(GPT2EngineError):
    """Training cannot start or go on: bad data or settings, a state that does not match, a non-finite loss."""


@dataclass(frozen=True)
class TrainSettings:
    """Everything that decides a run's trajectory (the resume check compares these) and how it reports."""

    context: int | None = None  # T; None: min(512, n_positions)
    batch_size: int = 4  # B windows a micro-batch
    accumulate: int = 1  # micro-batches an update
    steps: int | None = None  # updates; None: from epochs
    epochs: float | None = None  # passes over the training windows; None with steps None: 1
    lr: float = 1e-4
    min_lr: float | None = None  # None: lr / 10
    warmup: int | None = None  # None: 5% of the updates, at most 100
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    clip: float | None = 1.0  # global gradient norm; None: no clipping
    dropout: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    val_fraction: float = 0.05  # of the documents, when no validation texts are given
    eval_every: int | None = None  # None: 10 evaluations a run
    sample_every: int = 0  # 0: no samples
    sample_prompt: str = ""  # "" : start from <|endoftext|>
    sample_tokens: int = 40
    save_every: int | None = None  # None: at each evaluation
    early_stopping: int | None = None  # evaluations without a new best before stopping
    seed: int = 0
    recompute: bool = False  # activation checkpointing: less memory, one more forward a step, the same results

    def __post_init__(self) -> None:
        self.read_numbers()

        def check(name: str, ok: bool, expected: str) -> None:
            if not ok:
                raise TrainError(f"{name}: expected {expected}, got {getattr(self, name)!r}")

        for name in ("batch_size", "accumulate", "sample_tokens", "context", "steps", "eval_every", "save_every",
                     "early_stopping"):
            check(name, getattr(self, name) is None or getattr(self, name) >= 1, "an integer >= 1")
        check("epochs", self.epochs is None or (self.epochs > 0 and math.isfinite(self.epochs)), "a number > 0")
        check("lr", self.lr > 0 and math.isfinite(self.lr), "a finite number > 0")
        check("min_lr", self.min_lr is None or 0 <= self.min_lr <= self.lr, "a number in [0, lr]")
        check("warmup", self.warmup is None or self.warmup >= 0, "an integer >= 0")
        check("weight_decay", 0 <= self.weight_decay < math.inf, "a finite number >= 0")
        check("clip", self.clip is None or 0 < self.clip < math.inf, "a finite number > 0")
        for name in ("dropout", "beta1", "beta2"):
            check(name, 0 <= getattr(self, name) < 1, "a number in [0, 1)")
        check("val_fraction", 0 <= self.val_fraction < 1, "a fraction in [0, 1)")
        check("sample_every", self.sample_every >= 0, "an integer >= 0")
        check("seed", 0 <= self.seed < 2**63, "an integer in [0, 2^63)")
        for name in ("decay_embeddings", "recompute"):
            check(name, isinstance(getattr(self, name), bool), "True or False")
        check("sample_prompt", isinstance(self.sample_prompt, str), "a string")
        if self.steps is not None and self.epochs is not None:
            raise TrainError("give steps or epochs, not both")

    def read_numbers(self) -> None:
        """Each number field (by its annotation: int, float, or either | None) as a Python int or float (numpy's and
        torch's scalars are numbers, as generate's settings read them: core/scalars.py); a bool, a string or anything
        else is refused by name."""
        for f in fields(self):
            kind, optional = str(f.type).partition(" | ")[0], str(f.type).endswith("| None")
            value = getattr(self, f.name)
            if kind not in ("int", "float") or (value is None and optional):
                continue
            name, integer = f.name, kind == "int"
            read = as_int(value) if integer else as_real(value)
            if read is None:
                raise TrainError(f"{name}: expected {'an integer' if integer else 'a number'}, got {described(value)}")
            if math.isnan(read):
                raise TrainError(f"{name}: expected a finite number, got {described(value)}")
            object.__setattr__(self, name, read)


@dataclass(frozen=True)
class Base:
    """What a run's starting weights are, as its checkpoints record them, and whether it trains them or an adapter."""

    key: str = ""  # the resume check's name for them: their fingerprint (and quantization), or --init's config and seed
    lora: LoraSettings | None = None  # train a new LoRA adapter on the weights, frozen, instead of the weights
    name: str = ""  # with lora: the base's path and fingerprint, which the adapter's files record
    fingerprint: str = ""


@dataclass(frozen=True)
class Output:
    """Where a run's checkpoints go (None: nowhere) and what it does with a run already there."""

    out: Path | None = None
    resume: bool = False  # continue the run saved in out/last exactly
    overwrite: bool = False  # replace a model already in out
    bpe_source: Path | None = None  # where the BPE files written beside each checkpoint come from (None: the tokenizer's)


# --- events -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Started:
    steps: int  # total updates of the run
    first_step: int  # 0, or the step a resumed run continues from
    train_tokens: int
    val_tokens: int
    windows: int  # training windows of context + 1 tokens
    tokens_per_step: int
    parameters: int
    warning: str | None = None  # what the user should know before trusting the run (too little validation text)


@dataclass(frozen=True)
class Step:
    step: int  # 1-based: updates done
    loss: float  # mean cross-entropy of the update's batch (before it)
    lr: float
    grad_norm: float
    tokens: int  # tokens trained on so far
    tokens_per_second: float  # of this update
    elapsed: float  # seconds of training in this run and the runs it resumes


@dataclass(frozen=True)
class Eval:
    step: int
    val_loss: float
    val_ppl: float
    best: bool  # a new best, saved at the top of `out`


@dataclass(frozen=True)
class Sample:
    step: int
    greedy: str
    sampled: str


# (weights, prompt ids, new tokens, seed) -> (greedy text, sampled text): two continuations of the sample prompt
Sampler = Callable[[GPT2Weights, list[int], int, int], tuple[str, str]]


@dataclass(frozen=True)
class Saved:
    step: int
    path: str


@dataclass(frozen=True)
class Stopped:
    step: int
    reason: str


Event = Started | Step | Eval | Sample | Saved | Stopped


@dataclass
class TrainResult:
    steps: int  # updates done
    tokens: int  # tokens trained on
    seconds: float  # wall time of training (this run and the runs it resumes)
    final_loss: float  # the last update's loss
    best_val_loss: float | None  # None without validation data
    best_step: int | None
    saved: str | None  # where the best (or, without validation, the last) checkpoint is
    history: list[dict] = field(default_factory=list)  # every event as a JSON record


def record(event: Event) -> dict:
    """An event as one JSONL log record: {"event": "step", ...its fields}."""
    return {"event": type(event).__name__.lower(), **asdict(event)}


# --- data ---------------------------------------------------------------------------------------------------------

def token_stream(texts: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    """All documents as one stream of token ids, each followed by <|endoftext|>."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text)
        ids.append(tokenizer.eot_id)
    return torch.tensor(ids, dtype=torch.long)


def split_validation(texts: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """(training, validation) documents: every (1 / fraction)-th document held out, so that both span the corpus.
    With too few documents for that (a single file), the last `fraction` of the text of the last document."""
    if fraction == 0 or not texts:
        return texts, []
    every = max(2, round(1 / fraction))
    if len(texts) >= every:
        return [t for i, t in enumerate(texts) if i % every != every - 1], texts[every - 1 :: every]
    last = texts[-1]
    cut = int(len(last) * (1 - fraction))
    cut = last.rfind(" ", 0, cut) + 1 or cut  # at a word boundary where there is one
    return [*texts[:-1], last[:cut]], [last[cut:]] if last[cut:].strip() else []


def window_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the n training windows in `epoch`: a permutation drawn from (seed, epoch) alone."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def batch_windows(stream: torch.Tensor | TokenStream, context: int, windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and targets [len(windows), context] of the given training windows."""
    rows = torch.stack([stream[w * context : w * context + context + 1] for w in windows])  # [B, T + 1]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def eval_batches(stream: torch.Tensor | TokenStream, context: int, batch: int, pad: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The validation stream in consecutive windows, all of it scored once; the last window and the last batch are
    filled out with unscored rows (target -1)."""
    starts = list(range(0, max(1, len(stream) - 1), context))
    for b0 in range(0, len(starts), batch):
        ids = torch.full((batch, context), pad, dtype=torch.long)
        targets = torch.full((batch, context), -1, dtype=torch.long)
        for row, s in enumerate(starts[b0 : b0 + batch]):
            piece = stream[s : s + context + 1]
            ids[row, : len(piece) - 1] = piece[:-1]
            targets[row, : len(piece) - 1] = piece[1:]
        yield ids, targets


def run_windows(first: int, count: int, n: int, seed: int, orders: dict[int, torch.Tensor]) -> list[int]:
    """Which of the n training windows the run's windows first .. first + count - 1 are (see the module docstring);
    `orders` holds the order of the epoch being read, replaced when the next one starts."""
    windows = []
    for k in range(first, first + count):
        epoch = k // n
        if epoch not in orders:
            orders.clear()
            orders[epoch] = window_order(n, seed, epoch)
        windows.append(int(orders[epoch][k % n]))
    return windows


def training_streams(texts: list[str] | TokenStream, val_texts: list[str] | TokenStream | None, tokenizer: Tokenizer,
                     val_fraction: float) -> tuple[torch.Tensor | TokenStream, torch.Tensor | TokenStream]:
    """(training, validation) token streams: token shards as they are, texts tokenized (each document followed by
    <|endoftext|>); without validation texts, `val_fraction` of the training data held out."""
    if isinstance(texts, TokenStream):  # token shards (formats/shards.py), read as they are: nothing is added
        if val_texts is None:
            texts, val_texts = texts.split(val_fraction)
        train: torch.Tensor | TokenStream = texts
    else:
        if not any(t.strip() for t in texts):
            raise TrainError("no training text: every document is empty")
        if val_texts is None:
            texts, val_texts = split_validation(texts, val_fraction)
        train = token_stream(texts, tokenizer)
    if isinstance(val_texts, TokenStream):
        return train, val_texts
    return train, token_stream(val_texts, tokenizer) if val_texts else torch.zeros(0, dtype=torch.long)


# --- memory -------------------------------------------------------------------------------------------------------

def with_context(settings: TrainSettings, config: GPT2Config) -> TrainSettings:
    """The settings with their window length resolved (None: min(512, n_positions)), and their lengths checked
    against the model's context (a sample too long for it would fail at the first sample, after training)."""
    context = settings.context or min(512, config.n_positions)
    if context > config.n_positions:
        raise TrainError(f"context: {context} tokens exceed the model's n_positions {config.n_positions}")
    if settings.sample_every and settings.sample_tokens > config.n_positions:
        raise TrainError(f"sample_tokens: {settings.sample_tokens} tokens exceed the model's n_positions "
                         f"{config.n_positions}")
    return replace(settings, context=context)


def step_bytes(config: GPT2Config, settings: TrainSettings, batch: int, lora: LoraSettings | None,
               quantized: bool) -> int:
    """The memory a run adds to its weights: a step's buffers for `batch` windows, and (full fine-tuning) the
    gradients and AdamW's two moments, float32 each (an adapter's are a rounding error beside its buffers)."""
    buffers = Buffers.nbytes(config, batch, settings.context, settings.dropout, lora=lora, quantized=quantized,
                             recompute=settings.recompute)
    parameters = sum(math.prod(shape) for shape in expected_shapes(config).values())
    return buffers + (0 if lora else 3 * 4 * parameters)


def check_memory(config: GPT2Config, settings: TrainSettings, lora: LoraSettings | None, quantized: bool) -> None:
    """Refuse, before anything is allocated, a micro-batch that would not fit in the memory this machine has
    available; the error names the batch, what it needs and the largest one that fits."""
    available = available_memory()
    need = step_bytes(config, settings, settings.batch_size, lora, quantized)
    if need <= available:
        return
    lo, hi = 0, settings.batch_size  # the largest batch that fits is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if step_bytes(config, settings, mid, lora, quantized) <= available else (lo, mid)
    room = f"at most --batch-size {lo} fits" if lo else "not even --batch-size 1 fits (lower --context)"
    raise TrainError(f"--batch-size {settings.batch_size} x --context {settings.context} needs ~{need / 1e9:,.1f} GB "
                     f"for a step's activations{'' if lora else ', gradients and optimizer state'}; this machine has "
                     f"{available / 1e9:.1f} GB available: {room} (--accumulate makes larger updates of smaller "
                     "micro-batches; --recompute keeps fewer activations)")


@contextmanager
def out_of_memory_as(what: str) -> Iterator[None]:
    """torch's allocation failure inside the block as a one-line TrainError: `what` ran out of memory."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and not any(s in str(e) for s in ("not enough memory", "out of memory")):
            raise
        raise TrainError(f"{what}: out of memory ({one_line(e, 160)}); lower --batch-size or "
                         "--context, or add --recompute") from None


# --- checkpoints --------------------------------------------------------------------------------------------------

def recover_last(out: Path) -> None:
    """Finish or undo a replacement of out/last that a kill interrupted (see the module docstring)."""
    last, new, old = out / LAST, out / (LAST + ".new"), out / (LAST + ".old")
    if not last.exists() and old.exists():
        old.rename(last)  # killed between the two renames: the old one is complete
    shutil.rmtree(new, ignore_errors=True)  # never renamed into place: incomplete, or superseded
    shutil.rmtree(old, ignore_errors=True)


def check_resumable(out: Path) -> None:
    """TrainError unless out/last is a folder holding trainer_state.json as a regular file: missing, it says there is
    nothing to resume; anything else there (a file for the folder, a FIFO, a symlink loop) is named, not called
    missing."""
    for path, expected in ((out / LAST, "a directory"), (out / LAST / STATE, "a regular file")):
        try:
            kind = what_is(path)
        except OSError as e:
            reason = "a symlink loop" if e.errno == errno.ELOOP else f"cannot be looked at ({e.strerror or e})"
            raise TrainError(f"{out}: cannot resume: {path} is {reason}") from None
        if kind is None and path.is_symlink():
            raise TrainError(f"{out}: cannot resume: {path} is a link to {os.readlink(path)}, which does not exist")
        if kind is None:
            raise TrainError(f"{out}: nothing to resume (no {LAST}/{STATE}); run without --resume to start")
        if kind != expected:
            raise TrainError(f"{out}: cannot resume: {path} is {kind}, not {expected}")


def fingerprint(tokens: torch.Tensor | TokenStream) -> str:
    """Which tokens a run trains on (a resumed run checks it): the sha256 of the ids as int64."""
    if isinstance(tokens, TokenStream):
        return tokens.digest()
    return hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:16]


class Trainer:
    """One run: the parameters (owned float32 copies, or a LoRA adapter on a frozen base), their gradients, the
    optimizer and the buffers, set up once."""

    def __init__(self, weights: GPT2Weights, config: GPT2Config, tokenizer: Tokenizer, texts: list[str] | TokenStream,
                 settings: TrainSettings, *, val_texts: list[str] | TokenStream | None = None, base: Base = Base(),
                 output: Output = Output(), sampler: Sampler | None = None) -> None:
        """`sampler`: what draws the samples of `sample_every` (required with it)."""
        if settings.sample_every and sampler is None:
            raise TrainError("sample_every needs a sampler to draw the samples with")
        self.settings = settings = with_context(settings, config)
        self.config, self.tokenizer, self.sampler = config, tokenizer, sampler
        self.out, self.base, self.bpe_source = output.out, base.key, output.bpe_source or tokenizer.source
        self.lora, self.base_name, self.base_fingerprint = base.lora, base.name, base.fingerprint
        quantized = isinstance(weights.head, QuantizedMatrix)
        check_memory(config, settings, base.lora, quantized)
        self.train, self.val = training_streams(texts, val_texts, tokenizer, settings.val_fraction)
        self.windows = (len(self.train) - 1) // settings.context
        if self.windows < 1:
            raise TrainError(f"the training text is {len(self.train)} tokens, shorter than one window of "
                             f"{settings.context + 1}; lower --context or add text")
        self._schedule()
        self._parameters(weights)
        with out_of_memory_as("allocating the training step's buffers"):
            self.buffers = Buffers.allocate(config, settings.batch_size, settings.context, settings.dropout,
                                            lora=base.lora, quantized=quantized,
                                            recompute=settings.recompute)  # evaluation uses them too
        self.generator = torch.Generator().manual_seed(settings.seed)  # dropout masks
        self.step = 0
        self.tokens = 0
        self.elapsed = 0.0
        self.best: tuple[float, int] | None = None  # (val loss, step)
        self.evals_since_best = 0
        self.final_loss = math.nan  # the last update's loss
        if output.out is not None:
            self._prepare_out(output.resume, output.overwrite)
        elif output.resume:
            raise TrainError("resume needs an output directory to resume from")

    def _schedule(self) -> None:
        """The run's length in updates and its learning-rate, evaluation and save schedule (the settings' defaults
        resolved against the data)."""
        s = self.settings
        per_step = s.batch_size * s.accumulate
        self.total = s.steps or max(1, math.ceil((s.epochs or 1.0) * self.windows / per_step))
        self.warmup = s.warmup if s.warmup is not None else min(100, self.total // 20)
        self.min_lr = s.min_lr if s.min_lr is not None else s.lr / 10
        self.eval_every = s.eval_every or max(1, self.total // 10)
        self.save_every = s.save_every or self.eval_every

    def _parameters(self, weights: GPT2Weights) -> None:
        """The trained parameters, their gradients and the optimizer: the owned float32 weights, or (LoRA) a new
        adapter's A and B (views of what the forward reads) on the frozen base, as it is."""
        s, config = self.settings, self.config
        if self.lora is None:
            self.params = named_tensors(weights)  # owned float32 tensors, updated in place
            self.weights = weights
            self.grads_w = zeros_like(weights, config)
            self.grads = named_tensors(self.grads_w)
            decay = {n for n in self.params if decayed(n, s.decay_embeddings)}
        else:
            adapter = new_adapter(config, self.lora, torch.Generator().manual_seed(s.seed), self.base_name)
            self.weights, self.params = trainable(weights, adapter)
            self.grads_w, self.grads = adapter_gradients(self.weights, config, self.lora)
            decay = set(self.params)  # A and B are matrices
        self.optimizer = AdamW(self.params, decay, AdamWSettings(s.beta1, s.beta2, 1e-8, s.weight_decay))

    # -- the run ------------------------------------------------------------------------------------------------

    def run(self) -> Iterator[Event]:
        """Train to the end (or early stopping), yielding events; a non-finite loss raises TrainError."""
        yield self._started()
        if self.step == 0 and len(self.val) > 1:
            yield self._evaluate()
        orders: dict[int, torch.Tensor] = {}  # the current epoch's window order
        with torch.no_grad():
            while self.step < self.total:
                yield self._update(orders)
                if (yield from self._after_update()):
                    break

    def _started(self) -> Started:
        s = self.settings
        warning = None
        if 1 < len(self.val) < MIN_VAL_TOKENS:
            warning = (f"only {len(self.val):,} validation tokens: the best checkpoint would be chosen on noise; give "
                       f"--val FILE or a larger --val-fraction (at least {MIN_VAL_TOKENS:,} tokens)")
        return Started(self.total, self.step, len(self.train), len(self.val), self.windows,
                       s.batch_size * s.accumulate * s.context, sum(p.numel() for p in self.params.values()), warning)

    def _update(self, orders: dict[int, torch.Tensor]) -> Step:
        """One update: each micro-batch's forward and backward into the gradients, the clip, AdamW's step."""
        s, T = self.settings, self.settings.context
        t0 = time.perf_counter()
        for g in self.grads.values():
            g.zero_()
        scale = 1.0 / (s.batch_size * s.accumulate * T)
        loss_sum = 0.0
        with out_of_memory_as(f"update {self.step + 1}"):
            for micro in range(s.accumulate):
                first = (self.step * s.accumulate + micro) * s.batch_size
                ids, targets = batch_windows(self.train, T, run_windows(first, s.batch_size, self.windows, s.seed, orders))
                loss_sum += forward_loss(self.weights, self.config, self.buffers, ids, targets, grads=self.grads_w,
                                         grad_scale=scale, generator=self.generator)
        loss = loss_sum * scale
        if not math.isfinite(loss):
            raise self._diverged(f"the loss became {loss} at step {self.step + 1}")
        norm, factor = clip_factor(self.grads, s.clip)
        lr = learning_rate(self.step, self.total, s.lr, self.min_lr, self.warmup)
        self.optimizer.step(self.grads, lr, factor)
        self.step += 1
        self.tokens += s.batch_size * s.accumulate * T
        seconds = time.perf_counter() - t0
        self.elapsed += seconds
        self.final_loss = loss
        return Step(self.step, loss, lr, norm, self.tokens, s.batch_size * s.accumulate * T / seconds, self.elapsed)

    def _after_update(self) -> Generator[Event, None, bool]:
        """The evaluation, sample and save due after this update, as events; True when early stopping ends the run."""
        s, stop = self.settings, None
        if len(self.val) > 1 and self._due(self.eval_every):
            ev = self._evaluate()
            yield ev
            stop = self._early_stop(ev)
        if s.sample_every and self._due(s.sample_every):
            yield self._sample()
        if self.out is not None and (self._due(self.save_every) or stop):
            yield self._save_last()
        if stop:
            yield Stopped(self.step, stop)
        return bool(stop)

    def _due(self, every: int) -> bool:
        """Whether what is done every `every` updates is due now (everything is, after the last)."""
        return self.step % every == 0 or self.step == self.total

    def _early_stop(self, ev: Eval) -> str | None:
        """Why the run stops after this evaluation (early stopping's patience ran out), or None."""
        patience = self.settings.early_stopping
        if ev.best or not patience or self.evals_since_best < patience:
            return None
        return (f"early stopping: {self.evals_since_best} evaluations without a new best "
                f"(best {self.best[0]:.4f} at step {self.best[1]})")

    def result(self, history: list[dict]) -> TrainResult:
        """The run's outcome (after run() is drained); `history` is its events as records, if the caller kept them."""
        return TrainResult(self.step, self.tokens, self.elapsed, self.final_loss, self.best[0] if self.best else None,
                           self.best[1] if self.best else None, None if self.out is None else str(self.out), history)

    # -- evaluation and samples -----------------------------------------------------------------------------------

    def validation_loss(self) -> float:
        """Mean cross-entropy over every validation token (no dropout)."""
        total, count = 0.0, 0
        with torch.no_grad():
            for ids, targets in eval_batches(self.val, self.settings.context, self.settings.batch_size,
                                             self.tokenizer.eot_id):
                total += forward_loss(self.weights, self.config, self.buffers, ids, targets)
                count += int((targets >= 0).sum())
        return total / count

    def _evaluate(self) -> Eval:
        with out_of_memory_as(f"the evaluation at step {self.step}"):
            loss = self.validation_loss()
        if not math.isfinite(loss):  # never a best checkpoint, and no last/ saved after it
            raise self._diverged(f"the validation loss became {loss} at step {self.step}")
        best = self.best is None or loss < self.best[0]
        if best:
            self.best, self.evals_since_best = (loss, self.step), 0
            if self.out is not None:
                self._save_model(self.out)
        else:
            self.evals_since_best += 1
        return Eval(self.step, loss, math.exp(min(loss, 700.0)), best)

    def _diverged(self, what: str) -> TrainError:
        """The error that ends a run whose loss is no longer finite, naming the checkpoint that is still good: every
        save checks that the weights are finite and that no loss before it was not."""
        kept = f"; the last good checkpoint is in {self.out / LAST}" if self.out and (self.out / LAST).exists() else ""
        return TrainError(f"{what}; training stopped{kept} (try a lower --lr)")

    def _sample(self) -> Sample:
        prompt = self.tokenizer.encode(self.settings.sample_prompt) or [self.tokenizer.eot_id]
        return Sample(self.step, *self.sampler(self.weights, prompt, self.settings.sample_tokens, self.settings.seed))

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def adapter(self) -> LoraAdapter:
        """The adapter being trained (LoRA runs): its current values, as PEFT's files hold them."""
        return LoraAdapter(self.lora, dict(self.params), self.base_name, self.base_fingerprint)

    def _save_model(self, directory: Path) -> None:
        if self.lora is None:
            save_checkpoint(directory, self.config, self.weights, self.bpe_source)
        else:
            save_adapter(directory, self.adapter())

    def trajectory(self) -> dict:
        """What must be equal for a resumed run to continue this one: the settings that shape it, the data, the base."""
        s = asdict(self.settings)
        for reporting in ("sample_every", "sample_prompt", "sample_tokens", "save_every", "recompute"):
            s.pop(reporting)
        return {"settings": s, "train_tokens": fingerprint(self.train), "val_tokens": fingerprint(self.val),
                "config": asdict(self.config), "base": self.base,
                "lora": None if self.lora is None else {**asdict(self.lora), "targets": list(self.lora.targets)}}

    def _state(self) -> dict:
        return {"version": STATE_VERSION, "step": self.step, "tokens": self.tokens, "elapsed": self.elapsed,
                "best": list(self.best) if self.best else None, "evals_since_best": self.evals_since_best,
                "generator": self.generator.get_state().tolist(), "total_steps": self.total,
                "trajectory": self.trajectory()}

    def _save_last(self) -> Saved:
        from safetensors.torch import save_file

        out = self.out
        if not all(bool(torch.isfinite(p).all()) for p in self.params.values()):  # an update overflowed
            raise self._diverged(f"the weights became non-finite at step {self.step}")
        new, last, old = out / (LAST + ".new"), out / LAST, out / (LAST + ".old")
        shutil.rmtree(new, ignore_errors=True)
        self._save_model(new)
        save_file({n: t.contiguous() for n, t in self.optimizer.state().items()}, str(new / OPTIMIZER),
                  metadata={"step": str(self.step)})
        (new / STATE).write_text(json.dumps(self._state()) + "\n", encoding="utf-8")
        _fsync_dir(new)
        if last.exists():
            last.rename(old)
        new.rename(last)
        _fsync_dir(out)
        shutil.rmtree(old, ignore_errors=True)
        if self.best is None:  # no validation data: the top of `out` is the latest model
            self._save_model(out)
        return Saved(self.step, str(last))

    def _prepare_out(self, resume: bool, overwrite: bool) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise TrainError(f"{out}: exists and is not a directory")
        out.mkdir(parents=True, exist_ok=True)
        recover_last(out)
        holds = [p.name for p in out.iterdir() if p.name in (SAFETENSORS, LAST, "config.json", ADAPTER_CONFIG,
                                                             ADAPTER_WEIGHTS)]
        if resume:
            check_resumable(out)
            self._load_last()
        elif holds and not overwrite:
            raise TrainError(f"{out}: already holds a model ({', '.join(sorted(holds))}); pass --resume to continue "
                             "its run or --overwrite to replace it")
        elif holds:
            shutil.rmtree(out / LAST, ignore_errors=True)

    def _load_last(self) -> None:
        from ..formats.hf import load_weights

        last = self.out / LAST
        state = read_state(last / STATE, self.trajectory(), self.total, self.generator.get_state().numel())
        try:
            loaded = named_tensors(load_weights(last, self.config)) if self.lora is None else \
                load_adapter(last, self.config).tensors
        except (WeightsError, LoraError, OSError) as e:
            raise TrainError(f"--resume: {e}") from None
        if set(loaded) != set(self.params):
            raise TrainError(f"--resume: the tensors in {last} do not match this run's parameters")
        moments = read_moments(last / OPTIMIZER, self.optimizer.state())
        for name, p in loaded.items():
            self.params[name].copy_(p)
        self.optimizer.load_state(moments, state["step"])
        self.step, self.tokens, self.elapsed = state["step"], state["tokens"], state["elapsed"]
        self.best = tuple(state["best"]) if state["best"] else None
        self.evals_since_best = state["evals_since_best"]
        self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))


# --- the resume state: trainer_state.json and optimizer.safetensors, checked before anything is restored ------------

def _json(value: object) -> str:
    """A value of trainer_state.json as the file spells it, cut short where long (a generator state is 5,056 bytes)."""
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:40]}... ({type(value).__name__} of {len(value):,})"


def _integer(value: object, low: int, high: int | None = None) -> bool:
    return type(value) is int and low <= value and (high is None or value <= high)  # bool is not a count


def _number(value: object) -> bool:
    return type(value) in (int, float) and 0 <= value <= 1e15  # NaN and inf fail; an int past float's range too


def read_state(path: Path, trajectory: dict, total: int, generator_bytes: int) -> dict:
    """last/trainer_state.json checked against this run before any of it is used: readable, of this version, the
    same trajectory (settings, data, base), and each field of the type and range _state() writes, so that a corrupt
    or hand-edited file is one line naming its field."""
    try:
        state = read_json(path, "a training state")
    except InputError as e:
        raise TrainError(str(e)) from None
    except (OSError, ValueError) as e:
        raise TrainError(f"{path}: not a readable training state ({e})") from None
    if not isinstance(state, dict):
        raise TrainError(f"{path}: expected a JSON object (the training state gpt2 finetune writes), found "
                         f"{_json(state)}")
    if state.get("version") != STATE_VERSION:
        raise TrainError(f"{path}: training-state version {state.get('version')!r}, expected {STATE_VERSION}")
    _check_trajectory(path, state.get("trajectory"), trajectory)
    _check_fields(path, state, total, generator_bytes)
    return state


def _check_trajectory(path: Path, saved: object, trajectory: dict) -> None:
    """That the saved run is this one: the same model shape, base, data and settings."""
    last = path.parent
    if not isinstance(saved, dict) or not isinstance(saved.get("settings"), dict):
        field_, value = ("trajectory", saved) if not isinstance(saved, dict) else \
            ("trajectory.settings", saved.get("settings"))
        raise TrainError(f"{path}: {field_} is {_json(value)}, expected a JSON object (the run's settings, data and "
                         "base, as gpt2 finetune writes them)")
    for key in ("config", "base", "lora", "train_tokens", "val_tokens"):
        if saved.get(key) != trajectory[key]:
            what = {"config": "model shape", "base": "base weights", "train_tokens": "training data",
                    "val_tokens": "validation data", "lora": "LoRA settings (--lora, --lora-*)"}[key]
            raise TrainError(f"--resume: the {what} differ from the run saved in {last} (resume with the same "
                             "data, --weights/--init and settings, or start a new run)")
    for key, value in trajectory["settings"].items():
        if saved["settings"].get(key) != value:
            raise TrainError(f"--resume: {key} is {value!r} but the run in {last} used "
                             f"{saved['settings'].get(key)!r}")


def _check_fields(path: Path, state: dict, total: int, generator_bytes: int) -> None:
    """Each field of the state of the type and range _state() writes."""
    step, best, generator = state.get("step"), state.get("best"), state.get("generator")
    checks = (  # (field, whether its value is what _state() writes, what that is), in this order: best reads step
        ("total_steps", lambda: state.get("total_steps") == total,
         f"{total} (this run's updates, from the same settings and data)"),
        ("step", lambda: _integer(step, 1, total), f"an integer in [1, {total}] (the updates done, of this run's {total})"),
        ("tokens", lambda: _integer(state.get("tokens"), 0), "an integer >= 0"),
        ("elapsed", lambda: _number(state.get("elapsed")), "a finite number of seconds >= 0"),
        ("best", lambda: best is None or (isinstance(best, list) and len(best) == 2 and _number(best[0])
                                          and _integer(best[1], 0, step)),
         f"null or [validation loss, step]: a finite loss >= 0 and a step in [0, {step}]"),
        ("evals_since_best", lambda: _integer(state.get("evals_since_best"), 0), "an integer >= 0"),
        ("generator", lambda: isinstance(generator, list) and len(generator) == generator_bytes
         and all(_integer(b, 0, 255) for b in generator),
         f"a list of {generator_bytes:,} bytes (integers in [0, 255]): torch's CPU generator state"),
    )
    for name, good, expected in checks:
        if not good():
            raise TrainError(f"{path}: {name} is {_json(state.get(name))}, expected {expected}")


def check_moments_file(path: Path) -> None:
    """TrainError where something other than a regular file is at the optimizer state's `path` (a FIFO would block
    the read for ever, deaf to SIGTERM); nothing there is the reader's to name."""
    try:
        kind = what_is(path)
    except OSError as e:
        raise TrainError(f"{path}: cannot be looked at ({one_line(e, 200)})") from None
    if kind is not None and kind != "a regular file":
        raise TrainError(f"{path}: {kind}, not a regular file (the optimizer state --resume continues from)")


def read_moments(path: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """last/optimizer.safetensors: AdamW's moments under the names, shapes and dtypes of `expected` (the optimizer's
    own), each finite (and the second moments, means of squares, >= 0): a NaN moment would poison every update after
    the resume, and the run would blame its learning rate."""
    from safetensors.torch import load_file

    check_moments_file(path)
    try:
        moments = load_file(str(path))
    except FileNotFoundError:
        raise TrainError(f"{path}: missing (the optimizer state --resume continues from)") from None
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise TrainError(f"{path}: not a readable safetensors file ({one_line(e, 300)})") from None
    if missing := [n for n in expected if n not in moments]:
        raise TrainError(f"{path}: no tensor {missing[0]}; expected AdamW's moments m.NAME and v.NAME of each of "
                         f"this run's {len(expected) // 2} trained tensors")
    if extra := [n for n in moments if n not in expected]:
        raise TrainError(f"{path}: unexpected tensor {extra[0]}; expected AdamW's moments m.NAME and v.NAME of each "
                         f"of this run's {len(expected) // 2} trained tensors")
    for name, want in expected.items():
        t = moments[name]
        if t.shape != want.shape or t.dtype != want.dtype:
            raise TrainError(f"{path}: {name} is {str(t.dtype).removeprefix('torch.')} of shape {list(t.shape)}, "
                             f"expected {str(want.dtype).removeprefix('torch.')} of shape {list(want.shape)}")
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise TrainError(f"{path}: {name} holds {bad:,} NaN/Inf values, expected a finite optimizer state")
        if name.startswith("v.") and bool((t < 0).any()):
            raise TrainError(f"{path}: {name} holds negative values, expected a second moment (a mean of squares) "
                             ">= 0")
    return moments


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

