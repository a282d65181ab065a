"""Drafters: what proposes a sequence's next tokens for speculative decoding (speculation.py holds the policy that
accepts them). Prompt lookup needs no model; a draft model (the target quantized, or a smaller GPT-2) runs on a
ModelRunner of its own, slot for slot the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..core.config import GPT2Config
from ..core.errors import GenerationError, WeightsError
from ..core.quantize import FORMATS, quantize_weights
from ..core.tokenizer import Tokenizer, load_tokenizer
from ..formats.files import what_is
from ..formats.hf import CONFIG, load_weights
from ..core.weights import GPT2Weights, QuantizedMatrix
from .plan import Draft, DraftAsk, Segment
from .runner import ModelRunner
from .sampling import argmax, probabilities
from .speculation import SpeculationPolicy, check_draft_tokens

NGRAM_MAX, NGRAM_MIN = 4, 1  # prompt lookup matches the last 4 tokens, else 3, 2, 1


class Drafter(Protocol):
    def propose(self, asks: list[DraftAsk]) -> list[Draft]:
        """One Draft per ask, in order."""
        ...


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last n tokens (n from
    NGRAM_MAX down to NGRAM_MIN), in the prompt and the text so far. No model; strong where the output quotes its
    input (extraction, edits, summaries)."""

    def propose(self, asks: list[DraftAsk]) -> list[Draft]:
        drafts = []
        for ask in asks:
            tokens = lookup(ask.context, ask.k)
            cut = [i for i, t in enumerate(tokens) if t in ask.excluded]  # a token the target would refuse: stop there
            drafts.append(Draft(tokens[: cut[0]] if cut else tokens))
        return drafts


def lookup(context: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching tail of `context`. Where
    that continuation runs into the end of the context (a repeating stretch), it goes on by the same rule over the
    context and the tokens drafted so far."""
    ids = np.asarray(context, dtype=np.int64)
    draft: list[int] = []
    while len(draft) < k:
        more = match(ids, k - len(draft))
        if not more:
            break
        draft += more
        ids = np.concatenate([ids, np.asarray(more, dtype=np.int64)])
    return draft


def match(ids: np.ndarray, k: int) -> list[int]:
    """lookup()'s one step: the tokens after the latest earlier occurrence of the longest matching tail of ids."""
    for n in range(min(NGRAM_MAX, len(ids) - 1), NGRAM_MIN - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # [L - n, n]: every earlier n-gram
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if hits.size:
            after = int(hits[-1]) + n
            return ids[after : after + k].tolist()
    return []


class ModelDrafter:
    """A draft model (the target quantized, or a smaller GPT-2) with a KV cache of its own, slot for slot the
    target's. Each slot remembers the tokens it has fed, so a call feeds only what is new (after a rejection, from the
    first token that differs), then draws k tokens one pass at a time, all asks' rows sharing each pass."""

    def __init__(self, weights: GPT2Weights, config: GPT2Config, slots: int, max_len: int,
                 steers: bool = False) -> None:
        """`steers`: apply each sequence's steering (a draft model of the target's shape: the target quantized);
        otherwise it drafts unsteered, which only lowers acceptance, since the target verifies every token."""
        self.runner = ModelRunner(weights, config, slots, max_len)
        self.steers = steers
        self.fed: list[list[int]] = [[] for _ in range(slots)]
        self.steered: list[tuple] = [() for _ in range(slots)]  # the steering each slot's keys and values were fed under

    def propose(self, asks: list[DraftAsk]) -> list[Draft]:
        tokens: list[list[int]] = [[] for _ in asks]
        qs: list[list[torch.Tensor]] = [[] for _ in asks]
        try:
            self._catch_up(asks, tokens, qs)
            while live := [i for i, ask in enumerate(asks) if len(tokens[i]) < ask.k]:
                segments = [Segment(asks[i].slot, len(self.fed[asks[i].slot]), [tokens[i][-1]],
                                    steering=self.steered[asks[i].slot], prompt_len=asks[i].prompt_len) for i in live]
                for i in live:
                    self.fed[asks[i].slot].append(tokens[i][-1])
                for i, row in zip(live, self.runner.run(segments)):
                    self._draw(asks[i], row, tokens[i], qs[i])
        except BaseException:
            for ask in asks:  # what these slots hold is unknown now: feed them from the start next time
                self.fed[ask.slot] = []
            raise
        return [Draft(t, torch.stack(q) if q else None) for t, q in zip(tokens, qs)]

    def _catch_up(self, asks: list[DraftAsk], tokens: list[list[int]], qs: list[list[torch.Tensor]]) -> None:
        """The first pass: each slot fed what it has not fed of its context (after a rejection, from the first token
        that differs; a new sequence's prompt as a prefill of its own), and each ask's first draft token drawn."""
        segments, rows = [], []
        for i, ask in enumerate(asks):
            steering = ask.steering if self.steers else ()
            fed = self.fed[ask.slot] if self.steered[ask.slot] == steering else []
            start = min(common_prefix(fed, ask.context), len(ask.context) - 1)  # at least the last token, for its logits
            self.fed[ask.slot], self.steered[ask.slot] = list(ask.context), steering
            if start == 0 and len(ask.context) > 1:
                logits = self.runner.prefill(ask.slot, ask.context, steering=steering, prompt_len=ask.prompt_len).logits
                self._draw(ask, logits, tokens[i], qs[i])
            else:
                segments.append(Segment(ask.slot, start, ask.context[start:], steering=steering,
                                        prompt_len=ask.prompt_len))
                rows.append(i)
        if segments:
            for i, row in zip(rows, self.runner.run(segments)):
                self._draw(asks[i], row, tokens[i], qs[i])

    @staticmethod
    def _draw(ask: DraftAsk, logits: torch.Tensor, tokens: list[int], qs: list[torch.Tensor]) -> None:
        """The next draft token from the draft model's raw logits [V]: its argmax for a greedy sequence, else a draw
        from its temperature / top-k / top-p distribution q (kept for the acceptance test)."""
        if ask.excluded:
            logits = logits.clone()
            logits[list(ask.excluded)] = -torch.inf
        if ask.sampling.greedy:
            tokens.append(argmax(logits))
            return
        q = probabilities(logits, ask.sampling)
        tokens.append(int(torch.multinomial(q, 1, generator=ask.generator)))
        qs.append(q)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    return int(np.flatnonzero(x != y)[0])


@dataclass(frozen=True)
class Speculation:
    """What drafts and how: `source` as the user named it ('int4', 'int8', 'ngram' or a checkpoint directory), the
    draft model's weights and config (None for ngram), and the policy the scheduler follows."""

    source: str
    weights: GPT2Weights | None
    config: GPT2Config | None
    policy: SpeculationPolicy = field(default_factory=SpeculationPolicy)

    def drafter(self, slots: int, max_len: int) -> Drafter:
        """A drafter for a cache of `slots` sequences of up to `max_len` positions."""
        if self.weights is None:
            return NgramDrafter()
        return ModelDrafter(self.weights, self.config, slots, max_len, steers=self.source in FORMATS)


def load_speculation(source: str | Path, weights: GPT2Weights, config: GPT2Config, tokenizer: Tokenizer, *,
                     draft_tokens: int | None = None, max_running: int | None = None) -> Speculation:
    """The Speculation `source` names for a target model: 'int8' / 'int4' (the target's own float32 weights,
    quantized: self-speculation), 'ngram' (prompt lookup), or a GPT-2 checkpoint directory with the target's
    tokenizer and vocabulary (e.g. gpt2 drafting for gpt2-medium)."""
    check_draft_tokens(draft_tokens)
    policy = SpeculationPolicy(draft_tokens, max_running)
    source = str(source)
    if source == "ngram":
        return Speculation(source, None, None, policy)
    if source in FORMATS:
        if any(isinstance(t, QuantizedMatrix) or t.dtype != torch.float32 for t in (weights.wte, weights.blocks[0].c_fc.weight)):
            raise GenerationError(f"speculate={source!r} quantizes the target's float32 weights; this model is already "
                                  "quantized or bfloat16 (use 'ngram' or a draft checkpoint)", param="speculate")
        return Speculation(source, quantize_weights(weights, source), config, policy)
    directory = Path(source)
    draft_config = check_draft_checkpoint(directory, config, tokenizer)
    return Speculation(source, load_weights(directory, draft_config), draft_config, policy)


def check_draft_checkpoint(directory: Path, config: GPT2Config, tokenizer: Tokenizer) -> GPT2Config:
    """The config of a draft checkpoint, after checking that it can draft for this target (its weights unread)."""
    if not (directory / CONFIG).is_file():
        try:
            kind = what_is(directory / CONFIG) if directory.is_dir() else None  # a FIFO is there, not missing
        except OSError:  # a symlink loop
            kind = "a symlink loop"
        there = f"its {CONFIG} is {kind}, not a regular file" if kind else f"no {CONFIG} there"
        raise GenerationError(f"speculate: expected 'int4', 'int8', 'ngram' or a GPT-2 checkpoint directory, got "
                              f"{str(directory)!r} ({there})", param="speculate")
    draft_config = GPT2Config.from_json(directory / CONFIG)
    if draft_config.vocab_size != config.vocab_size:
        raise WeightsError(f"{directory}: the draft model's vocabulary has {draft_config.vocab_size} tokens, the "
                           f"target's {config.vocab_size}; a drafter needs the same vocabulary")
    draft_tokenizer = load_tokenizer(directory)
    if not same_tokenizer(draft_tokenizer, tokenizer):
        raise WeightsError(f"{directory}: the draft model's tokenizer (vocab.json / merges.txt) differs from the "
                           "target's; a drafter needs the same tokenizer")
    if draft_config.n_positions < config.n_positions:
        raise WeightsError(f"{directory}: the draft model's context ({draft_config.n_positions}) is shorter than the "
                           f"target's ({config.n_positions})")
    return draft_config


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers map the same ids to the same bytes (and so split text alike: the BPE merges are
    ranked by id)."""
    if a.n_vocab != b.n_vocab or a.eot_id != b.eot_id:
        return False
    try:
        return all(a.token_bytes(i) == b.token_bytes(i) for i in range(a.n_vocab) if i != a.eot_id)
    except KeyError:  # an id one of them does not have
        return False
