"""The model runner: it executes what the scheduler planned, on the weights and the slot-based KV cache, and knows
nothing of requests, sampling or threads.

Two kinds of work: `prefill` runs one prompt alone through the whole-sequence forward into its cache slot,
reusing the prefix cache's blocks where it has them (runtime/prefix.py); a `Pass` runs many sequences' rows together
(running sequences' next tokens, new short prompts), block by block, and whoever drives it may hand it more rows
between blocks (`Pass.add`). With at most config.DECODE_ROWS rows, each block and the head are one native call
(kernels/block.cpp: NativeRows), every matmul runs on the row-invariant kernels and attention stays within each
row's cache slot, so a sequence's logits are the same bits whatever else shares the pass, and whichever block it
joined the pass at.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core.config import DECODE_ROWS, GPT2Config
from ..core.model import KVCache, Layer, block, embed, logits
from ..core.projection import logsumexp_rows
from ..core.rows import RowLayout, native_block, native_head, self_attention_segments
from ..core.weights import GPT2Weights
from .plan import Outputs, Prefilled, Segment
from .prefix import PrefixCache, prefill


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


NO_ADAPTERS = torch.empty(0, dtype=torch.long)  # RowBlock's `adapters` where no row names one


class NativeRows(NamedTuple):
    """The weights' blocks and head as one native call each (rows.native_block, rows.native_head): how a pass of
    up to DECODE_ROWS rows runs. Every such pass runs there, so a row's bits never depend on which path its
    neighbours took."""

    blocks: list[Any]
    head: Any


def native_rows(w: GPT2Weights, config: GPT2Config) -> NativeRows | None:
    """NativeRows of these weights, or None where a block or the head has no native call."""
    blocks = [native_block(b, config, i) for i, b in enumerate(w.blocks)]
    head = native_head(w, config)
    return None if None in blocks or head is None else NativeRows(blocks, head)


def rows_block(w: GPT2Weights, config: GPT2Config, i: int, x: torch.Tensor, layout: RowLayout,
               cache: KVCache, adapters: torch.Tensor | None = None) -> torch.Tensor:
    """[1, R, C] -> [1, R, C] through block i in torch, each segment attending within its cache slot."""
    blk = w.blocks[i]
    attend = lambda h: self_attention_segments(h, blk, config.n_head, cache.k[i], cache.v[i], layout, adapters)  # noqa: E731
    return block(x, blk, config, attend, Layer(adapters=adapters))


class Pass:
    """One pass over the weights for many sequences' rows, run one block at a time.

    `add(segments)` before block `layer` runs the new segments through blocks 0..layer-1 on their own, then puts their
    rows after the others' for the remaining blocks. Rows never mix (row-invariant projections, per-slot attention),
    so they get the bits they would get from the start, and a prompt that arrives mid-pass need not wait for the
    pass to end. `logits()` has `outputs` rows per segment (its last ones), in the order the segments were given
    and added. Up to DECODE_ROWS rows, each block and the head are one native call (NativeRows); otherwise torch's
    ops, in inference mode.
    """

    @torch.inference_mode()
    def __init__(self, w: GPT2Weights, config: GPT2Config, cache: KVCache, segments: list[Segment],
                 native: NativeRows | None = None) -> None:
        """`native`: the weights' native_rows, built once by the runner (the default builds them for this pass)."""
        self.w, self.config, self.cache = w, config, cache
        native = native if native is not None else native_rows(w, config)
        self.native = native if cache.k.is_contiguous() and cache.v.is_contiguous() else None
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
            y = self._block(j, y, layout, adapters)
        self.segments += segments
        self.x = torch.cat([self.x, y], dim=1)  # [1, R + R', C]
        self.layout = RowLayout.of(self.layout.spans + layout.spans)
        self.adapters = adapter_rows(self.segments)

    def run_block(self) -> None:
        """Run the next block over every row."""
        self.x = self._block(self.layer, self.x, self.layout, self.adapters)
        self.layer += 1

    def logits(self) -> torch.Tensor:
        """[n, V]: the logits after each segment's last `outputs` rows, segment by segment (every block must have
        run). The head is row-invariant too (NativeRows.head, or projection.head_logits past DECODE_ROWS), so a row's
        logits do not depend on n."""
        assert self.done, "the pass has blocks left to run"
        x = self.x[0]  # [R, C]
        if any(s.outputs != len(s.ids) for s in self.segments):  # not every row: each segment's last `outputs`
            ends = torch.tensor([len(s.ids) for s in self.segments]).cumsum(0).tolist()
            x = x[[r for s, end in zip(self.segments, ends) for r in range(end - s.outputs, end)]]  # [n, C]
        if self.native is not None and x.shape[0] <= DECODE_ROWS:
            return self.native.head(x)  # [n, V]
        with torch.inference_mode():
            return logits(self.w, self.config, x)  # [n, V]

    def outputs(self) -> Outputs:
        """logits() and each row's logsumexp (what the scheduler reads to choose and score tokens)."""
        lg = self.logits()  # [n, V]
        return Outputs(lg, logsumexp_rows(lg))

    def _block(self, i: int, x: torch.Tensor, layout: RowLayout, adapters: torch.Tensor | None) -> torch.Tensor:
        """[1, R, C] -> [1, R, C] through block i: natively up to DECODE_ROWS rows (no autograd state there, so no
        inference-mode switch either), else in torch."""
        if self.native is not None and x.shape[1] <= DECODE_ROWS:
            rows = NO_ADAPTERS if adapters is None else adapters
            return self.native.blocks[i](x, self.cache.k, self.cache.v, layout.slots, layout.positions, rows)
        with torch.inference_mode():
            return rows_block(self.w, self.config, i, x, layout, self.cache, adapters)


class ModelRunner:
    """The weights, a KV cache of `slots` sequences of up to `max_len` positions and, optionally, a prefix cache
    (runtime/prefix.py) that prefills reuse and extend: executes prefills and passes."""

    def __init__(self, weights: GPT2Weights, config: GPT2Config, slots: int, max_len: int | None = None,
                 prefix: PrefixCache | None = None) -> None:
        self.weights, self.config, self.prefix = weights, config, prefix
        self.cache = KVCache.allocate(config, slots, max_len or config.n_positions)  # [n_layer, slots, nh, L, hs]
        self.native = native_rows(weights, config)

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
        return Pass(self.weights, self.config, self.cache, segments, self.native)

    def run(self, segments: list[Segment]) -> torch.Tensor:
        """One whole pass: segments -> the logits after each one's last `outputs` tokens [n, V]."""
        p = self.open(segments)
        while not p.done:
            p.run_block()
        return p.logits()
