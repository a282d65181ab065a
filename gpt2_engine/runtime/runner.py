"""The model runner: it executes what the scheduler planned, on the weights and the slot-based KV cache, and knows
nothing of requests, sampling or threads.

Two kinds of work: `prefill` runs one prompt alone through the whole-sequence forward into its cache slot,
reusing the prefix cache's blocks where it has them (runtime/prefix.py); a `Pass` runs many sequences' rows together
(running sequences' next tokens, new short prompts), block by block, and whoever drives it may hand it more rows
between blocks (`Pass.add`). With at most config.DECODE_ROWS rows, each block and the head are one native call
(kernels/block.cpp: NativeRows), every matmul runs on the row-invariant kernels and attention stays within each
row's cache slot, so a sequence's logits are the same bits whatever else shares the pass, and whichever block it
joined the pass at.

Steering (interp/steering.py) rides on the segments: each sequence's edits apply to its own rows, at positions the
rows carry, so a steered row gets what a whole-sequence recompute gives it and its neighbours are untouched. An edit
between blocks (hook_resid_pre / hook_resid_post, the embeddings) is applied between the native calls; a block with
an edit inside it runs in torch for the rows of the sequences it steers only (the same arithmetic alone or batched:
the projections are the row-invariant kernels there too), the other rows natively as ever.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core.config import DECODE_ROWS, GPT2Config
from ..core.model import KVCache, BlockCall, ScopedTap, block, hooked, logits
from ..core.ops import embed
from ..core.projection import reduce_rows
from .rows import RowLayout, embeds_natively, native_block, native_embed, native_head, self_attention_segments
from ..interp.steering import SteeredRows, SteeringTap
from ..interp.spec import Steering, between_blocks
from ..core.weights import GPT2Weights
from .plan import Outputs, Picks, Prefilled, Segment
from .prefix import PrefixCache, prefill


def embed_rows(w: GPT2Weights, segments: list[Segment], tap: SteeringTap | None = None,
               native: bool = False) -> tuple[torch.Tensor, RowLayout]:
    """Segments' tokens -> their residual stream [1, R, C] at their own positions, and the layout of their rows;
    `tap`: their steering (hook_embed, hook_pos_embed). `native` (rows.embeds_natively(w)) and unsteered: one native
    call, rows.native_embed (this runs first in a decode step, on the caches the last step's head has flushed, where
    the four small torch ops below cost ~0.2 ms)."""
    ids = [t for s in segments for t in s.ids]  # [R]
    layout = RowLayout.of([(s.slot, s.start, len(s.ids)) for s in segments])
    if native and tap is None and (x := native_embed(w, ids, layout.positions)) is not None:
        return x, layout  # [1, R, C]
    with torch.inference_mode():
        tokens = hooked(tap, "hook_embed", embed(w, torch.tensor(ids, dtype=torch.long))[None])  # [1, R, C]
        pos = hooked(tap, "hook_pos_embed", w.wpe[torch.tensor(layout.positions, dtype=torch.long)][None])  # [1, R, C]
        return tokens + pos, layout  # [1, R, C]


def steering_tap(w: GPT2Weights, config: GPT2Config, segments: list[Segment]) -> SteeringTap | None:
    """The steering of the segments' rows, row by row (see the module docstring); None where no segment steers."""
    groups, row = [], 0
    for s in segments:
        if s.steering:
            groups.append(SteeredRows(s.steering, torch.arange(row, row + len(s.ids)),
                               torch.arange(s.start, s.start + len(s.ids)), s.prompt_len))
        row += len(s.ids)
    return SteeringTap(w, config, groups) if groups else None


def inside_block(tap: SteeringTap, layer: int) -> torch.Tensor | None:
    """The rows whose edits fall inside block `layer` (they run it in torch), or None where none do."""
    prefix = f"blocks.{layer}."
    rows = [g.rows for g in tap.groups if any(s.hook.startswith(prefix) and not between_blocks(s.hook)
                                              for s in g.steering)]
    return torch.cat(rows) if rows else None


def adapter_rows(segments: list[Segment]) -> torch.Tensor | None:
    """[R]: each row's adapter (model.linear's `adapters`), or None where no segment names one."""
    if all(s.adapter is None for s in segments):
        return None
    return torch.tensor([0 if s.adapter is None else s.adapter for s in segments for _ in s.ids], dtype=torch.long)


NO_ADAPTERS = torch.empty(0, dtype=torch.long)  # RowBlock's `adapters` where no row names one


class NativeRows(NamedTuple):
    """The weights' blocks and head as one native call each (rows.native_block, rows.native_head): how a pass of
    up to DECODE_ROWS rows runs. Every such pass runs there, so a row's bits never depend on which path its
    neighbours took. `embeds`: whether its rows' embedding is one native call too (rows.embeds_natively; the
    same bits as torch's, so that is only a matter of speed)."""

    blocks: list[Any]
    head: Any
    embeds: bool


def native_rows(w: GPT2Weights, config: GPT2Config) -> NativeRows | None:
    """NativeRows of these weights, or None where a block or the head has no native call."""
    blocks = [native_block(b, config, i) for i, b in enumerate(w.blocks)]
    head = native_head(w, config)
    return None if None in blocks or head is None else NativeRows(blocks, head, embeds_natively(w))


def rows_block(w: GPT2Weights, config: GPT2Config, i: int, x: torch.Tensor, layout: RowLayout,
               cache: KVCache, adapters: torch.Tensor | None = None, tap: SteeringTap | None = None) -> torch.Tensor:
    """[1, R, C] -> [1, R, C] through block i in torch, each segment attending within its cache slot; `tap`: the
    rows' steering, every hook point of the block."""
    blk = w.blocks[i]
    scoped = None if tap is None else ScopedTap(tap, f"blocks.{i}.")
    attend = lambda h: self_attention_segments(h, blk, config.n_head, cache.k[i], cache.v[i], layout, adapters,  # noqa: E731
                                               scoped)
    return block(x, blk, config, attend, BlockCall(tap=scoped, adapters=adapters))


def sub_layout(layout: RowLayout, rows: torch.Tensor) -> RowLayout:
    """The layout of a subset of the rows (whole spans, in row order)."""
    keep = set(rows.tolist())
    return RowLayout.of([span for span, first in zip(layout.spans, layout.first_rows) if first in keep])


class Pass:
    """One pass over the weights for many sequences' rows, run one block at a time.

    `add(segments)` before block `layer` runs the new segments through blocks 0..layer-1 on their own, then puts their
    rows after the others' for the remaining blocks. SteeredRows never mix (row-invariant projections, per-slot attention),
    so they get the bits they would get from the start, and a prompt that arrives mid-pass need not wait for the
    pass to end. `logits()` has `outputs` rows per segment (its last ones), in the order the segments were given
    and added. Up to DECODE_ROWS rows, each block and the head are one native call (NativeRows); otherwise torch's
    ops, in inference mode.
    """

    def __init__(self, w: GPT2Weights, config: GPT2Config, cache: KVCache, segments: list[Segment],
                 native: NativeRows | None = None) -> None:
        """`native`: the weights' native_rows, built once by the runner (the default builds them for this pass). No
        inference-mode switch here (it costs ~80 us on a decode step's cold caches): embed_rows's torch ops take
        one where they run."""
        self.w, self.config, self.cache = w, config, cache
        native = native if native is not None else native_rows(w, config)
        self.native = native if cache.k.is_contiguous() and cache.v.is_contiguous() else None
        self.segments = list(segments)
        self.steer = steering_tap(w, config, self.segments)
        self.x, self.layout = embed_rows(w, self.segments, self.steer, self.native is not None and self.native.embeds)
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
        steer = steering_tap(self.w, self.config, segments)
        y, layout = embed_rows(self.w, segments, steer, self.native is not None and self.native.embeds)  # [1, R', C]
        adapters = adapter_rows(segments)
        for j in range(self.layer):
            y = self._block(j, y, layout, adapters, steer)
        self.segments += segments
        self.x = torch.cat([self.x, y], dim=1)  # [1, R + R', C]
        self.layout = RowLayout.of(self.layout.spans + layout.spans)
        self.adapters = adapter_rows(self.segments)
        self.steer = steering_tap(self.w, self.config, self.segments)

    def run_block(self) -> None:
        """Run the next block over every row."""
        self.x = self._block(self.layer, self.x, self.layout, self.adapters, self.steer)
        self.layer += 1

    def logits(self) -> torch.Tensor:
        """[n, V]: the logits after each segment's last `outputs` rows, segment by segment (every block must have
        run). The head is row-invariant too (NativeRows.head, or projection.head_logits past DECODE_ROWS), so a row's
        logits do not depend on n."""
        return self._head(*self._last_rows())

    def _head(self, x: torch.Tensor, tap: SteeringTap | None, steered: torch.Tensor | None) -> torch.Tensor:
        """logits() of the rows _last_rows() gave [n, V]."""
        if self.native is None or x.shape[0] > DECODE_ROWS:
            with torch.inference_mode():
                return logits(self.w, self.config, x, tap)  # [n, V]
        if steered is None:
            return self.native.head(x)  # [n, V]
        # rows steered at the final layer norm take the head in torch; the others the native call, as ever
        out = torch.empty(x.shape[0], self.config.vocab_size)  # [n, V]
        plain = torch.ones(x.shape[0], dtype=torch.bool)
        plain[steered] = False
        if bool(plain.any()):
            out[plain] = self.native.head(x[plain].contiguous())
        with torch.inference_mode():
            out[steered] = logits(self.w, self.config, x[steered], tap.select(steered))
        return out

    def outputs(self) -> Outputs:
        """What the scheduler reads to choose and score tokens: every output row's Picks, and the logits of the rows
        of segments that are not `greedy`. Where the native head runs every row, greedy rows' logits are never
        written (RowHead.select); elsewhere the logits are made whole and reduced the same way (the same bits)."""
        banned = [s.banned for s in self.segments for _ in range(s.outputs)]
        wanted = [not s.greedy for s in self.segments for _ in range(s.outputs)]
        x, tap, steered = self._last_rows()
        if self.native is not None and x.shape[0] <= DECODE_ROWS and steered is None:
            # each kept row's place in the logits, -1 for the others, in plain Python: this runs right after the
            # blocks' weights have streamed through the caches, where each small torch op costs tens of microseconds
            keep, places = [], 0
            for want in wanted:
                keep.append(places if want else -1)
                places += want
            tokens, best, lse, kept = self.native.head.select(x, banned, keep, places)
            return Outputs(kept, Picks(tokens, best, lse))
        lg = self._head(x, tap, steered)  # [n, V]
        return Outputs(lg if all(wanted) else lg[torch.tensor(wanted)], Picks(*reduce_rows(lg, banned)))

    def _last_rows(self) -> tuple[torch.Tensor, SteeringTap | None, torch.Tensor | None]:
        """The final hidden rows the head reads [n, C] (each segment's last `outputs`), their steering tap, and which
        of them are steered at the final layer norm (None: none)."""
        assert self.done, "the pass has blocks left to run"
        x = self.x[0]  # [R, C]
        every = all(s.outputs == len(s.ids) for s in self.segments)
        rows = None
        if not every or self.steer is not None:  # each segment's last `outputs` rows [n]
            ends = torch.tensor([len(s.ids) for s in self.segments]).cumsum(0).tolist()
            rows = torch.tensor([r for s, end in zip(self.segments, ends) for r in range(end - s.outputs, end)])
        if not every:
            x = x[rows]  # [n, C]
        tap = None if self.steer is None else self.steer.select(rows)
        steered = None if tap is None or not tap.wants("ln_final.hook_normalized") else torch.cat(
            [g.rows for g in tap.groups if any(s.hook.startswith("ln_final.") for s in g.steering)])
        return x, tap, steered

    def _block(self, i: int, x: torch.Tensor, layout: RowLayout, adapters: torch.Tensor | None,
               steer: SteeringTap | None) -> torch.Tensor:
        """[1, R, C] -> [1, R, C] through block i: natively up to DECODE_ROWS rows (no autograd state there, so no
        inference-mode switch either), else in torch; rows steered inside the block in torch, the rest natively."""
        native = self.native is not None and x.shape[1] <= DECODE_ROWS
        inside = None if steer is None or not native else inside_block(steer, i)
        if inside is None:
            return self._run(i, x, layout, adapters, steer, native)
        plain = torch.ones(x.shape[1], dtype=torch.bool)
        plain[inside] = False
        rest = plain.nonzero()[:, 0]
        out = torch.empty_like(x)  # [1, R, C]
        for rows, on_native in ((rest, True), (inside, False)):
            if len(rows):
                out[:, rows] = self._run(i, x[:, rows], sub_layout(layout, rows),
                                         None if adapters is None else adapters[rows], steer.select(rows), on_native)
        return out

    def _run(self, i: int, x: torch.Tensor, layout: RowLayout, adapters: torch.Tensor | None,
             steer: SteeringTap | None, native: bool) -> torch.Tensor:
        """Block i over rows that all take one path: the native call (edits between blocks applied around it) or
        torch's (every edit through the tap)."""
        if native:  # (the native block makes x contiguous itself)
            rows = NO_ADAPTERS if adapters is None else adapters
            if steer is None:
                return self.native.blocks[i](x, self.cache.k, self.cache.v, layout.slots, layout.positions, rows)
            name = f"blocks.{i}."
            x = hooked(steer, name + "hook_resid_pre", x)
            x = self.native.blocks[i](x, self.cache.k, self.cache.v, layout.slots, layout.positions, rows)
            return hooked(steer, name + "hook_resid_post", x)
        with torch.inference_mode():
            return rows_block(self.w, self.config, i, x, layout, self.cache, adapters, steer)


class ModelRunner:
    """The weights, a KV cache of `slots` sequences of up to `max_len` positions and, optionally, a prefix cache
    (runtime/prefix.py) that prefills reuse and extend: executes prefills and passes."""

    def __init__(self, weights: GPT2Weights, config: GPT2Config, slots: int, max_len: int | None = None,
                 prefix: PrefixCache | None = None) -> None:
        self.weights, self.config, self.prefix = weights, config, prefix
        self.cache = KVCache.allocate(config, slots, max_len or config.n_positions)  # [n_layer, slots, nh, L, hs]
        self.native = native_rows(weights, config)

    def prefill(self, slot: int, prompt: list[int], *, scored: bool = False, top: int = 0,
                adapter: int | None = None, steering: tuple[Steering, ...] = (),
                prompt_len: int | None = None) -> Prefilled:
        """Run a prompt alone into cache slot `slot`: the next token's logits [V], the prompt tokens' stats when
        `scored` (one row per prompt token after the first, with `top` alternatives), and how many of its tokens
        the prefix cache held. `adapter`, `steering`, `prompt_len`: Segment's (None: all of it is prompt)."""
        view = KVCache(self.cache.k[:, slot : slot + 1], self.cache.v[:, slot : slot + 1])
        return prefill(self.weights, self.config, view, prompt, scored=scored, top=top, adapter=adapter,
                       prefix=self.prefix, steering=steering, prompt_len=prompt_len)

    def open(self, segments: list[Segment]) -> Pass:
        """A pass over these segments, before its first block."""
        return Pass(self.weights, self.config, self.cache, segments, self.native)

    def run(self, segments: list[Segment]) -> torch.Tensor:
        """One whole pass: segments -> the logits after each one's last `outputs` tokens [n, V]."""
        p = self.open(segments)
        while not p.done:
            p.run_block()
        return p.logits()

# Next: core/kernels/block.cpp, where a decode-sized pass runs each block as one native call (RowBlock), the
# head too (RowHead): model.block()'s math on the row-invariant kernels.
