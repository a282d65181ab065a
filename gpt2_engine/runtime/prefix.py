"""Prefix caching: the keys and values of prompt blocks already computed, reused by the next prompt that starts with
them (vLLM's automatic prefix caching, on the engine's slot-based KV cache).

A prompt is cut into blocks of BLOCK_TOKENS tokens; a block is known by its tokens and its parent block (so by the
whole prefix up to its end), by the LoRA adapter and by the steering of prompt rows (interp/steering.py's prompt_key)
the keys and values were computed under: a prompt steered otherwise never reuses them. A block holds, for its
positions: the keys and values of every layer, and the log-probabilities of its own tokens (the stats memo) where the
prompt that computed them was scored. Blocks live in one preallocated pool of `capacity` blocks; when it is full the
least recently used block that no other block extends is evicted (a parent is touched after its children, so the
LRU order reaches leaves first).

A prompt runs as: match its longest cached chain of whole blocks (c tokens), copy their keys and values into the
sequence's own cache slot for positions [0, s), s = min(c, T) - 1, and run positions [s, T) through the model. The
one recomputed position gives the logits that predict the first uncached token (or the next token when the whole
prompt is cached); the cached tokens' own log-probabilities come from the memo. Copying, not sharing pages, keeps
the attention kernels and the slot layout as they are: a block costs one copy of 74 KB a token (GPT-2 small),
against a forward of about 170 MFLOP a token.

Where bits can differ: the copied keys and values are the bits an earlier run computed, but that run may have fed
more (or fewer) rows at once, and float32 matmuls over different row counts, and attention over a cached prefix
instead of one causal pass, round differently. So a prompt's logits with the cache equal those without to ~1e-6
relative (the tests hold 1e-5), not bit for bit; greedy text is the same unless two tokens tie to that precision.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..core.config import GPT2Config, memory_left
from ..core.errors import GPT2EngineError
from ..core.model import KVCache, logits, residual_stream
from ..core.pages import available_memory
from ..core.projection import reduce_rows
from ..interp.spec import Steering, prompt_key
from ..interp.steering import sequence_tap
from ..core.weights import GPT2Weights
from .plan import Prefilled, TokenStats
from .stats import prompt_stats

BLOCK_TOKENS = 16  # tokens a block: vLLM's default; smaller blocks match more of a prompt but cost more lookups
DEFAULT_CAPACITY_MB = 512  # `gpt2 serve`'s default bound: about 6,900 tokens of GPT-2 small


def block_mb(config: GPT2Config, block_tokens: int = BLOCK_TOKENS) -> float:
    """MB a block takes: float32 keys and values of every layer."""
    return 2 * config.n_layer * config.n_embd * block_tokens * 4 / 2**20


@dataclass(eq=False)
class CachedBlock:
    """One block of a cached prefix: its row in the pool, its parent and children, and its tokens' stats memo."""

    key: tuple
    row: int
    parent: CachedBlock | None
    children: int = 0
    stats: TokenStats | None = None  # for this block's tokens as targets (the first block: all but token 0)


@dataclass
class PrefixCounters:
    """Prompt tokens looked up and tokens found (served from the cache), since the cache was made."""

    queried: int = 0
    hit: int = 0


def check_capacity(capacity_mb: float, flag: str = "a prefix cache of") -> None:
    """GPT2EngineError unless `capacity_mb` is a positive size that fits in the memory this process has (the pool is
    allocated whole; 1e300 overflowed torch.empty's size, NaN and inf pass every other comparison)."""
    room = min(available_memory(), memory_left())
    if not 0 < capacity_mb * 2**20 <= room:
        raise GPT2EngineError(f"{flag} {capacity_mb:g} MB: expected a positive size within the {room / 2**20:,.0f} MB "
                              "of memory this process has available")


class PrefixCache:
    """A bounded pool of prompt blocks' keys and values (see the module docstring)."""

    def __init__(self, config: GPT2Config, capacity_mb: float, block_tokens: int = BLOCK_TOKENS) -> None:
        self.config, self.block = config, block_tokens
        check_capacity(capacity_mb)
        per_block = int(block_mb(config, block_tokens) * 2**20)  # bytes
        self.capacity = int(capacity_mb * 2**20) // per_block
        if self.capacity < 1:
            raise GPT2EngineError(f"a prefix cache of {capacity_mb} MB holds no block: a block of {block_tokens} "
                                  f"tokens takes {per_block / 2**20:.2f} MB")
        shape = (config.n_layer, config.n_head, self.capacity, block_tokens, config.head_size)
        self.k, self.v = torch.empty(shape), torch.empty(shape)  # [n_layer, nh, blocks, B, hs]: pages touched on use
        self.blocks: OrderedDict[tuple, CachedBlock] = OrderedDict()  # LRU first
        self.free = list(range(self.capacity - 1, -1, -1))
        self.counters = PrefixCounters()

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, ids: list[int], adapter: int | None, steered: str | None = None) -> list[CachedBlock]:
        """The longest chain of cached whole blocks that `ids` starts with under this adapter and prompt steering
        (`steered`: prompt_key's), touched as used."""
        chain: list[CachedBlock] = []
        parent_key: tuple = ("adapter", adapter, steered)
        for b in range(len(ids) // self.block):
            blk = self.blocks.get((parent_key, tuple(ids[b * self.block : (b + 1) * self.block])))
            if blk is None:
                break
            chain.append(blk)
            parent_key = blk.key
        self._touch(chain)
        return chain

    def restore(self, chain: list[CachedBlock], view: KVCache, upto: int) -> None:
        """Copy the chain's keys and values of positions [0, upto) into a one-slot cache view [n_layer, 1, nh, L, hs]."""
        if upto <= 0:
            return
        rows = torch.tensor([blk.row for blk in chain])
        L, nh, hs = self.config.n_layer, self.config.n_head, self.config.head_size
        for pool, cache in ((self.k, view.k), (self.v, view.v)):
            cache[:, 0, :, :upto] = pool[:, :, rows].reshape(L, nh, len(chain) * self.block, hs)[:, :, :upto]

    def cached_stats(self, chain: list[CachedBlock], n: int, top: int, details: bool) -> TokenStats | None:
        """The memo's stats of targets 1..n (n <= the chain's tokens), or None where a block has none that covers
        `top` alternatives and `details`."""
        parts = [blk.stats for blk in chain[: -(-(n + 1) // self.block)]]
        if not parts or not all(covers(p, top, details) for p in parts):
            return None
        joined = TokenStats.cat(parts)
        return TokenStats(joined.logprob[:n],
                          joined.rank[:n] if top or details else None,
                          joined.entropy[:n] if details else None,
                          joined.top_ids[:n, :top] if top else None,
                          joined.top_logprobs[:n, :top] if top else None)

    def store(self, ids: list[int], adapter: int | None, chain: list[CachedBlock], view: KVCache,
              stats: TokenStats | None, first_target: int, steered: str | None = None) -> None:
        """Add the whole blocks of `ids` past `chain` from the slot view that holds their keys and values; `stats`:
        the targets first_target.. of this run (None when it was not scored), memoised per block. Stops when every
        block left is an ancestor of this prompt's (nothing can be evicted)."""
        parent = chain[-1] if chain else None
        added: list[CachedBlock] = []
        for b in range(len(chain), len(ids) // self.block):
            lo, hi = b * self.block, (b + 1) * self.block
            key = (parent.key if parent else ("adapter", adapter, steered), tuple(ids[lo:hi]))
            blk = self.blocks.get(key)
            if blk is None:
                row = self._row(keep=chain + added)
                if row is None:
                    break
                blk = CachedBlock(key, row, parent)
                if parent is not None:
                    parent.children += 1
                self.blocks[key] = blk
                self.k[:, :, row] = view.k[:, 0, :, lo:hi]
                self.v[:, :, row] = view.v[:, 0, :, lo:hi]
            if stats is not None and (blk.stats is None or wider(stats, blk.stats)):
                first = max(lo, 1)  # the first block has no stats for token 0
                if first >= first_target:
                    # cat copies: a view would keep the whole run's stats alive as long as the block
                    blk.stats = TokenStats.cat([stats.rows(first - first_target, hi - first_target)])
            added.append(blk)
            parent = blk
        self._touch(chain + added)

    # --- internals ------------------------------------------------------------------------------------------------

    def _touch(self, chain: list[CachedBlock]) -> None:
        for blk in reversed(chain):  # deepest first: a parent ends up more recent than its children
            self.blocks.move_to_end(blk.key)

    def _row(self, keep: list[CachedBlock]) -> int | None:
        """A free pool row, evicting the least recently used leaf block not in `keep` if needed."""
        if self.free:
            return self.free.pop()
        kept = {id(b) for b in keep}
        for key, blk in self.blocks.items():
            if blk.children == 0 and id(blk) not in kept:
                del self.blocks[key]
                if blk.parent is not None:
                    blk.parent.children -= 1
                return blk.row
        return None


def covers(stats: TokenStats | None, top: int, details: bool) -> bool:
    """Whether memoised stats hold what a run asking for `top` alternatives (and `details`) returns."""
    if stats is None or (details and stats.entropy is None) or ((top or details) and stats.rank is None):
        return False
    return not top or (stats.top_ids is not None and stats.top_ids.shape[1] >= top)


def wider(new: TokenStats, old: TokenStats) -> bool:
    """Whether `new` stats hold more than `old` (more alternatives, or entropy where old had none)."""
    width = lambda s: 0 if s.top_ids is None else s.top_ids.shape[1]  # noqa: E731
    return width(new) > width(old) or (new.entropy is not None and old.entropy is None) or (
        new.rank is not None and old.rank is None)


def prefill(w: GPT2Weights, config: GPT2Config, view: KVCache, prompt: list[int], *, scored: bool = False,
            top: int = 0, details: bool = False, adapter: int | None = None,
            prefix: PrefixCache | None = None, steering: tuple[Steering, ...] = (),
            prompt_len: int | None = None) -> Prefilled:
    """Run a prompt into a one-slot cache view, reusing and then extending `prefix` (see the module docstring).
    `steering`: edits on its rows, all of them prompt rows unless `prompt_len` says fewer are (a draft model's
    context)."""
    T = len(prompt)
    if prompt_len is not None and prompt_len < T:
        prefix = None  # rows past the prompt (a draft model's context): not a prompt's keys and values
    steered = prompt_key(steering)
    chain = prefix.match(prompt, adapter, steered) if prefix is not None else []
    memo = None
    if chain and scored:
        memo = prefix.cached_stats(chain, min(len(chain) * prefix.block, T) - 1, top, details)
        if memo is None:  # the memo lacks what this run asks for: recompute every position
            chain = []
    s = max(min(len(chain) * prefix.block, T) - 1, 0) if chain else 0
    if prefix is not None:
        prefix.restore(chain, view, s)
        prefix.counters.queried += T
        prefix.counters.hit += s
    ids = torch.tensor([prompt[s:]])  # [1, T - s]
    adapters = None if adapter is None else torch.tensor([adapter])  # [1]
    tap = sequence_tap(w, config, steering, s, T - s, T if prompt_len is None else prompt_len)
    with torch.inference_mode():
        x = residual_stream(w, config, ids, cache=view, start=s, adapters=adapters, tap=tap)[0]  # [T - s, C]
        stats = None
        if scored:  # targets s+1 .. T-1, and the next token's logits, in one pass of the head
            stats, next_logits = prompt_stats(w, config, x, ids[0, 1:], top=top, details=details, tap=tap)
        else:
            last = None if tap is None else tap.select(torch.tensor([T - s - 1]))
            next_logits = logits(w, config, x[-1:], last)[0]  # [V]
        if prefix is not None:
            prefix.store(prompt, adapter, chain, view, stats, s + 1, steered)
    if memo is not None:
        stats = TokenStats.cat([memo, stats])
    return Prefilled(next_logits, reduce_rows(next_logits[None])[2][0], stats, s)
