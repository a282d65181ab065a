"""The model runner: it executes what the scheduler planned, on the weights and the slot-based KV cache, and knows
nothing of requests, sampling or threads.

Two kinds of work: `prefill` runs one prompt alone through the whole-sequence forward into its cache slot,
reusing the prefix cache's blocks where it has them (core/prefix.py); a `Pass` runs many sequences' rows together
(running sequences' next tokens, new short prompts), block by block, and whoever drives it may hand it more rows
between blocks (`Pass.add`). With at most projection.DECODE_ROWS rows, every matmul
runs on the row-invariant kernels and attention stays within each row's cache slot, so a sequence's logits are the
same bits whatever else shares the pass, and whichever block it joined the pass at.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .config import GPT2Config
from .model import KVCache, RowLayout, block, embed, logits, self_attention_segments
from .prefix import Prefilled, PrefixCache, prefill
from .weights import GPT2Weights


class Segment(NamedTuple):
    """A sequence's rows in a pass: `ids` are fed at positions [start, start + len(ids)) of cache slot `slot`, with
    LoRA adapter `adapter` of the weights (-1: the base; None: adapter 0, a model with one). The pass returns the
    logits after its last `outputs` rows (a speculative verify pass needs every row's: core/speculate.py)."""

    slot: int
    start: int
    ids: list[int]
    adapter: int | None = None
    outputs: int = 1


def embed_rows(w: GPT2Weights, segments: list[Segment]) -> tuple[torch.Tensor, RowLayout]:
    """Segments' tokens -> their residual stream [1, R, C] at their own positions, and the layout of their rows."""
    ids = torch.tensor([t for s in segments for t in s.ids])  # [R]
    layout = RowLayout.of([(s.slot, s.start, len(s.ids)) for s in segments])
    return (embed(w, ids) + w.wpe[layout.positions])[None], layout  # [1, R, C]


def adapter_rows(segments: list[Segment]) -> torch.Tensor | None:
    """[R]: each row's adapter (model.linear's `adapters`), or None where no segment names one."""
    if all(s.adapter is None for s in segments):
        return None
    return torch.tensor([0 if s.adapter is None else s.adapter for s in segments for _ in s.ids], dtype=torch.long)


def rows_block(w: GPT2Weights, config: GPT2Config, i: int, x: torch.Tensor, layout: RowLayout,
               cache: KVCache, adapters: torch.Tensor | None = None) -> torch.Tensor:
    """[1, R, C] -> [1, R, C] through block i, each segment attending within its cache slot."""
    blk = w.blocks[i]
    return block(x, blk, config, lambda h: self_attention_segments(h, blk, config.n_head, cache.k[i], cache.v[i], layout,
                                                                   adapters), adapters=adapters)


class Pass:
    """One pass over the weights for many sequences' rows, run one block at a time.

    `add(segments)` before block `layer` runs the new segments through blocks 0..layer-1 on their own, then puts their
    rows after the others' for the remaining blocks. Rows never mix (row-invariant projections, per-slot attention),
    so they get the bits they would get from the start, and a prompt that arrives mid-pass need not wait for the
    pass to end. `logits()` has `outputs` rows per segment (its last ones), in the order the segments were given
    and added.
    """

    @torch.inference_mode()
    def __init__(self, w: GPT2Weights, config: GPT2Config, cache: KVCache, segments: list[Segment]) -> None:
        self.w, self.config, self.cache = w, config, cache
        self.segments = list(segments)
        self.x, self.layout = embed_rows(w, self.segments)  # [1, R, C]
        self.adapters = adapter_rows(self.segments)  # [R] or None
        self.layer = 0  # the next block to run

    @property
    def rows(self) -> int:
        return self.x.shape[1]

    @property
    def done(self) -> bool:
        return self.layer == self.config.n_layer

    @torch.inference_mode()
    def add(self, segments: list[Segment]) -> None:
        """More segments, caught up to this pass's next block (see the class docstring)."""
        if not segments:
            return
        y, layout = embed_rows(self.w, segments)  # [1, R', C]
        adapters = adapter_rows(segments)
        for j in range(self.layer):
            y = rows_block(self.w, self.config, j, y, layout, self.cache, adapters)
        self.segments += segments
        self.x = torch.cat([self.x, y], dim=1)  # [1, R + R', C]
        self.layout = RowLayout.of(self.layout.spans + layout.spans)
        self.adapters = adapter_rows(self.segments)

    @torch.inference_mode()
    def run_block(self) -> None:
        """Run the next block over every row."""
        self.x = rows_block(self.w, self.config, self.layer, self.x, self.layout, self.cache, self.adapters)
        self.layer += 1

    @torch.inference_mode()
    def logits(self) -> torch.Tensor:
        """[n, V]: the logits after each segment's last `outputs` rows, segment by segment (every block must have
        run). The head is row-invariant too (projection.head_logits), so a row's logits do not depend on n."""
        assert self.done, "the pass has blocks left to run"
        ends = torch.tensor([len(s.ids) for s in self.segments]).cumsum(0).tolist()
        rows = [r for s, end in zip(self.segments, ends) for r in range(end - s.outputs, end)]  # [n]
        return logits(self.w, self.config, self.x[0, rows])  # [n, V]


def forward_segments(w: GPT2Weights, config: GPT2Config, segments: list[Segment], cache: KVCache) -> torch.Tensor:
    """One whole pass: segments -> the logits after each one's last `outputs` tokens [n, V]."""
    p = Pass(w, config, cache, segments)
    while not p.done:
        p.run_block()
    return p.logits()


class ModelRunner:
    """The weights, a KV cache of `slots` sequences of up to `max_len` positions and, optionally, a prefix cache
    (core/prefix.py) that prefills reuse and extend: executes prefills and passes."""

    def __init__(self, weights: GPT2Weights, config: GPT2Config, slots: int, max_len: int | None = None,
                 prefix: PrefixCache | None = None) -> None:
        self.weights, self.config, self.prefix = weights, config, prefix
        self.cache = KVCache.allocate(config, slots, max_len or config.n_positions)  # [n_layer, slots, nh, L, hs]

    def prefill(self, slot: int, prompt: list[int], *, scored: bool = False, top: int = 0,
                adapter: int | None = None) -> Prefilled:
        """Run a prompt alone into cache slot `slot`: the next token's logits [V], the prompt tokens' stats when
        `scored` (one row per prompt token after the first, with `top` alternatives), and how many of its tokens
        the prefix cache held. `adapter`: Segment's."""
        view = KVCache(self.cache.k[:, slot : slot + 1], self.cache.v[:, slot : slot + 1])
        return prefill(self.weights, self.config, view, prompt, scored=scored, top=top, adapter=adapter,
                       prefix=self.prefix)

    def open(self, segments: list[Segment]) -> Pass:
        """A pass over these segments, before its first block."""
        return Pass(self.weights, self.config, self.cache, segments)
