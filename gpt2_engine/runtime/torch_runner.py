"""The torch runner: the scheduler's prefills and passes (runner.py's interface: `prefill`, and `open` -> a pass with
`run_block`, `add`, `outputs`) on torch's own kernels, on any device: a GPU (GPT2.from_pretrained(device="cuda")), or
the CPU (runner="torch"), where the suite holds it to the native runner. It runs model.py's math (block(), the layer
norms, linear(), every hook point); what it adds is where a pass's rows attend and how a step is launched.

- The weights go to the device once (weights.on_device): the projections in float32, bfloat16 or float16, the rest in
  float32. The residual stream, the layer norms, the softmax's accumulation and the head stay float32, as on the CPU;
  the KV cache is in the projections' dtype (half the bytes a decode step reads with bfloat16, as transformers, vLLM
  and gpt-fast keep it), and the queries meet it in that dtype inside SDPA, which accumulates in float32.
- One KV cache on the device, [n_layer, slots + 1, nh, n_positions, hs], preallocated (DeviceCache): its last slot is
  scratch, where a step's padding rows write. A model's runs borrow slots of one such cache (TorchRunners), so that
  every generation replays the steps captured on it rather than capturing its own.
- A pass's rows attend as the native kernel's do (kernels/attention.cpp): every row's key and value is written into
  its slot first, then each row attends to its own slot's positions up to its own (slot_attention: SDPA over the keys
  gathered by row, [R, nh, S, hs], with a per-row mask). Decode rows, the rows of a short prompt that rides along and
  speculative verify rows are one path, and no row reads another slot.
- A pass without steering or LoRA adapters runs as one static step (Step, step_logits): rows padded to a power of
  two, key positions to a multiple of KEY_BLOCK, the head and each output row's picks (argmax skipping its banned
  token, that logit, the logsumexp) computed on the device. On CUDA each shape is captured once in a CUDA graph and
  replayed, as gpt-fast decodes; on the CPU the same function runs eagerly. One copy comes back per pass: the picks,
  and the logits of rows that sample (the scheduler samples on the host, each sequence with its own seeded
  generator, so a seed draws the same tokens from the same logits on either device).
- A pass with steering or adapters runs block by block (model.block with the steering tap), eagerly, and rows that
  join it between blocks catch up alone, as runner.Pass's do.
- A prefill is runtime/prefix.py's, into its slot's view of the device cache (model.py's forward: SDPA's causal
  kernel, the explicit form where a hook reads the pattern).
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..core.config import GPT2Config
from ..core.model import KVCache, BlockCall, ScopedTap, Tap, block, hooked, linear, logits
from ..core.ops import embed
from ..core.weights import Block, GPT2Weights, on_device, split_qkv
from ..interp.spec import Steering
from ..interp.steering import SteeringTap
from .plan import Outputs, Picks, Prefilled, Segment
from .prefix import PrefixCache, prefill
from .runner import adapter_rows, steering_tap

KEY_BLOCK = 128  # a step attends to key positions padded to a multiple of this: a graph per 128 positions of context
MAX_STEP_ROWS = 256  # passes of more rows (none the scheduler plans today) run eagerly rather than as a static step
WARMUP = 2  # eager runs of a step before it is captured: cuBLAS and SDPA choose their kernels and workspaces there


def slot_attention(x: torch.Tensor, blk: Block, n_head: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                   adapters: torch.Tensor | None = None, tap: Tap | None = None) -> torch.Tensor:
    """[1, R, C] -> [1, R, C]: row r's query attends to the keys of cache slot slots[r] at positions 0..positions[r],
    the S positions `mask` [R, 1, 1, S] covers (k_cache, v_cache [slots, nh, L, hs]: one layer's). Every row's key
    and value is written first, so that the rows of one prompt see each other; rows of other slots are never read.
    `tap` (scoped to the block): the hook points attn.hook_q|hook_k|hook_v|hook_z [1, R, nh, hs]."""
    R, C = x.shape[1], x.shape[2]
    hs = C // n_head
    q, k, v = split_qkv(linear(x, blk.c_attn, adapters))  # 3 x [1, R, C]
    q, k, v = (hooked(tap, f"attn.hook_{n}", t.view(1, R, n_head, hs))[0]  # 3 x [R, nh, hs]
               for n, t in zip("qkv", (q, k, v)))
    k_cache[slots, :, positions] = k.to(k_cache.dtype)  # row r's at (slots[r], :, positions[r])
    v_cache[slots, :, positions] = v.to(v_cache.dtype)
    S = mask.shape[-1]
    keys, values = k_cache[slots, :, :S], v_cache[slots, :, :S]  # [R, nh, S, hs] each: each row's own slot
    y = F.scaled_dot_product_attention(q[:, :, None].to(keys.dtype), keys, values, attn_mask=mask)  # [R, nh, 1, hs]
    y = hooked(tap, "attn.hook_z", y.to(x.dtype).reshape(1, R, n_head, hs))
    return linear(y.reshape(1, R, C), blk.attn_c_proj, adapters)  # [1, R, C]


def key_mask(positions: torch.Tensor, keys: int) -> torch.Tensor:
    """[R] positions -> [R, 1, 1, keys] bool: row r sees key positions 0..positions[r]."""
    return (torch.arange(keys, device=positions.device) <= positions[:, None])[:, None, None, :]


def key_span(top: int, max_len: int) -> int:
    """Key positions a pass whose furthest row sits at `top` attends over: up to a multiple of KEY_BLOCK (SDPA's
    efficient kernels want the mask's rows aligned, and a step's graph covers a block of positions)."""
    return min(-(-(top + 1) // KEY_BLOCK) * KEY_BLOCK, max_len)


def picks(lg: torch.Tensor, banned: torch.Tensor) -> torch.Tensor:
    """Logits [n, V] -> [3, n] float64: each row's argmax skipping token banned[n] (-1: none), that logit, and the
    logsumexp of the whole row; the argmax is -1 where the row has no value above -inf or holds a NaN (and that logit
    NaN, or -inf): projection.reduce_rows' Picks, on the device. argmax takes the first of equal maxima."""
    lse = torch.logsumexp(lg, dim=-1)  # [n]
    vocab = torch.arange(lg.shape[-1], device=lg.device)
    allowed = lg.masked_fill(vocab[None, :] == banned[:, None], -torch.inf)  # [n, V]
    token = allowed.argmax(dim=-1)  # [n]
    best = allowed.gather(-1, token[:, None])[:, 0]  # [n]
    ok = ~torch.isnan(lse) & (best > -torch.inf)
    token = torch.where(ok, token, -1)
    best = torch.where(ok, best, torch.where(torch.isnan(lse), torch.nan, -torch.inf))
    return torch.stack([token.double(), best.double(), lse.double()])


def step_logits(w: GPT2Weights, config: GPT2Config, cache: KVCache, inputs: torch.Tensor,
                keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole pass as one static function: inputs [5, R] (each row's token id, cache slot, position; the rows the
    head reads; each of those's banned token) -> the logits of those rows [R, V] and their picks [3, R]. Every shape
    is fixed by (R, keys), which is what a CUDA graph needs."""
    ids, slots, positions, out_rows, banned = inputs
    x = (embed(w, ids) + w.wpe[positions])[None]  # [1, R, C]
    mask = key_mask(positions, keys)  # [R, 1, 1, keys]
    for i, blk in enumerate(w.blocks):
        attend = functools.partial(slot_attention, blk=blk, n_head=config.n_head, k_cache=cache.k[i],
                                   v_cache=cache.v[i], slots=slots, positions=positions, mask=mask)
        x = block(x, blk, config, attend, BlockCall())
    lg = logits(w, config, x[0, out_rows])  # [R, V]
    return lg, picks(lg, banned)


class Step:
    """step_logits for one shape (rows, keys) on one cache, with its own static inputs [5, rows]: on CUDA captured
    once in a CUDA graph (in the cache's memory pool) and replayed; elsewhere called eagerly. Its outputs are its own
    buffers until the next call: DeviceCache's lock keeps one call at a time."""

    def __init__(self, w: GPT2Weights, config: GPT2Config, cache: KVCache, rows: int, keys: int, scratch: int,
                 pool: tuple | None) -> None:
        device = cache.k.device
        self.inputs = torch.zeros(5, rows, dtype=torch.long, device=device)  # padding rows: id 0 at position 0 ...
        self.inputs[1], self.inputs[4] = scratch, -1  # ... of the scratch slot, nothing banned
        self.run: Callable[[], tuple[torch.Tensor, torch.Tensor]] = functools.partial(step_logits, w, config, cache,
                                                                                      self.inputs, keys)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.device = device
        if pool is not None:
            with torch.cuda.device(device):  # its streams and graph on the cache's GPU, whichever is current
                self.graph, self.out = capture(self.run, pool)

    def __call__(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs [5, rows] (on the host) -> (logits [rows, V], picks [3, rows]) on the device."""
        self.inputs.copy_(inputs)
        if self.graph is None:
            return self.run()
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.out


def capture(run: Callable[[], tuple[torch.Tensor, torch.Tensor]], pool: tuple
            ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
    """A CUDA graph of `run` (after WARMUP eager runs on a side stream, as torch's documentation prescribes) and its
    output tensors, which each replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA work (a caller of model(ids) beside a server's engine thread) is no error
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()
    return graph, out


class DeviceCache:
    """A KV cache on the device, [n_layer, slots + 1, nh, max_len, hs] in `dtype`, and the steps captured on it (they
    read its tensors, so they live with it). Its last slot is scratch; the others are lent to runners (`borrow`,
    `give_back`). `lock` keeps one step at a time: a step's inputs and outputs are buffers of its own."""

    def __init__(self, config: GPT2Config, slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 graphs: bool | None = None) -> None:
        self.cache = KVCache.allocate(config, slots + 1, max_len, dtype, device)
        self.slots = slots
        self.free = list(range(slots))  # under `lending`
        # slots given back, by a runner's finalizer, which may run inside any allocation (the cycle collector), even
        # one of this thread's while it holds a lock: SimpleQueue.put takes none that a caller could hold
        self.returned: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.lending = threading.Lock()
        self.steps: dict[tuple[int, int], Step] = {}  # by (rows, keys), made on a shape's first pass
        self.lock = threading.Lock()
        graphs = device.type == "cuda" if graphs is None else graphs
        self.pool = torch.cuda.graph_pool_handle() if graphs else None  # every step's graph draws on one pool

    def free_slots(self) -> list[int]:
        """The slots no runner holds, in order."""
        with self.lending:
            return list(self._collect())

    def borrow(self, n: int) -> list[int] | None:
        """n free slots, now taken; None where fewer are free."""
        with self.lending:
            free = self._collect()
            if len(free) < n:
                return None
            taken, self.free = free[:n], free[n:]
            return taken

    def _collect(self) -> list[int]:
        """`free` with the slots given back since (hold `lending`)."""
        while not self.returned.empty():
            self.free.append(self.returned.get())
        self.free.sort()
        return self.free

    def give_back(self, slots: list[int]) -> None:
        for slot in slots:
            self.returned.put(slot)

    def step(self, w: GPT2Weights, config: GPT2Config, rows: int, keys: int) -> Step:
        """The step of this shape (call it holding `lock`), captured on its first use: a graph per shape used."""
        if (rows, keys) not in self.steps:
            self.steps[rows, keys] = Step(w, config, self.cache, rows, keys, self.slots, self.pool)
        return self.steps[rows, keys]


def cache_dtype(w: GPT2Weights) -> torch.dtype:
    """The KV cache's dtype: the projections' (see the module docstring)."""
    return w.blocks[0].c_attn.weight.dtype


class TorchRunners:
    """A model's runner factory on the torch runner (GPT2.runner), called as runner.ModelRunner is constructed. Every
    runner over the model's own weights borrows its slots from one DeviceCache of n_positions positions a slot, so
    that the model's steps are captured once rather than for every generation; when that cache has too few free slots
    a new one twice as large (or as large as asked) takes its place, and the old one lives as long as runners use it.
    Runners over other weights (adapters attached) get a cache of their own."""

    def __init__(self, weights: GPT2Weights, config: GPT2Config) -> None:
        self.weights, self.config = weights, config
        self.current: DeviceCache | None = None
        self.lock = threading.Lock()

    def __call__(self, weights: GPT2Weights, config: GPT2Config, slots: int, max_len: int | None = None,
                 prefix: PrefixCache | None = None) -> TorchRunner:
        lent = self.lend(slots) if weights is self.weights else None
        return TorchRunner(weights, config, slots, max_len, prefix, lent=lent)

    def lend(self, n: int) -> tuple[DeviceCache, list[int]]:
        """n slots of the shared cache (a larger one made where it has not so many free)."""
        with self.lock:
            taken = None if self.current is None else self.current.borrow(n)
            if taken is None:
                size = max(n, 2 * self.current.slots if self.current is not None else n)
                w = self.weights
                self.current = DeviceCache(self.config, size, self.config.n_positions, cache_dtype(w), w.wpe.device)
                taken = self.current.borrow(n)
            return self.current, taken


class TorchRunner:
    """runner.ModelRunner's interface on torch's kernels (see the module docstring): weights and a KV cache of `slots`
    sequences on the weights' device. `lent`: a DeviceCache and which of its slots are this runner's (TorchRunners),
    given back when the runner is collected; None: a cache of its own, of `max_len` positions a slot. `graphs`: capture
    the steps of its own cache in CUDA graphs (None: on CUDA)."""

    def __init__(self, weights: GPT2Weights, config: GPT2Config, slots: int, max_len: int | None = None,
                 prefix: PrefixCache | None = None, *, lent: tuple[DeviceCache, list[int]] | None = None,
                 graphs: bool | None = None) -> None:
        device = weights.wpe.device
        self.weights = on_device(weights, device)  # adapters attached after the model moved (gpt2 serve's --lora)
        self.config, self.prefix = config, prefix
        if lent is None:
            self.device_cache = DeviceCache(config, slots, max_len or config.n_positions, cache_dtype(weights), device,
                                            graphs)
            self.slot_of = list(range(slots))  # the scheduler's slot -> the cache's
        else:
            self.device_cache, self.slot_of = lent
            weakref.finalize(self, self.device_cache.give_back, list(self.slot_of))
        self.cache = self.device_cache.cache  # [n_layer, slots + 1, nh, L, hs]

    def prefill(self, slot: int, prompt: list[int], *, scored: bool = False, top: int = 0,
                adapter: int | None = None, steering: tuple[Steering, ...] = (),
                prompt_len: int | None = None) -> Prefilled:
        """runner.ModelRunner.prefill on the device; the next token's logits come back to the host, for the sampler."""
        s = self.slot_of[slot]
        view = KVCache(self.cache.k[:, s : s + 1], self.cache.v[:, s : s + 1])
        done = prefill(self.weights, self.config, view, prompt, scored=scored, top=top, adapter=adapter,
                       prefix=self.prefix, steering=steering, prompt_len=prompt_len)
        return done._replace(logits=done.logits.cpu())

    def open(self, segments: list[Segment]) -> TorchPass:
        """A pass over these segments, before its first block."""
        return TorchPass(self, [s._replace(slot=self.slot_of[s.slot]) for s in segments])

    def run(self, segments: list[Segment]) -> torch.Tensor:
        """One whole pass: segments -> the logits after each one's last `outputs` tokens [n, V], on the host."""
        p = self.open(segments)
        while not p.done:
            p.run_block()
        return p.logits()


class RowPlan(NamedTuple):
    """A pass's rows, segment after segment: each row's token id, cache slot and position; the rows the head reads
    (each segment's last `outputs`) with each one's banned token and whether its logits are wanted (not greedy)."""

    ids: list[int]
    slots: list[int]
    positions: list[int]
    out_rows: list[int]
    banned: list[int]
    wanted: list[bool]

    @classmethod
    def of(cls, segments: list[Segment]) -> RowPlan:
        plan, row = cls([], [], [], [], [], []), 0
        for s in segments:
            n = len(s.ids)
            plan.ids.extend(s.ids)
            plan.slots.extend([s.slot] * n)
            plan.positions.extend(range(s.start, s.start + n))
            plan.out_rows.extend(range(row + n - s.outputs, row + n))
            plan.banned.extend([s.banned] * s.outputs)
            plan.wanted.extend([not s.greedy] * s.outputs)
            row += n
        return plan


class TorchPass:
    """One pass of a TorchRunner (runner.Pass's interface). Without steering or adapters it is a static step, run
    whole when its last block is due (run_block before that only counts blocks, and `add` only adds rows, which is
    what catching them up would come to: rows never mix); with them, block by block (see the module docstring)."""

    def __init__(self, runner: TorchRunner, segments: list[Segment]) -> None:
        self.runner, self.w, self.config = runner, runner.weights, runner.config
        self.segments = list(segments)
        self.layer = 0  # the next block to run
        self.eager = False
        self.x: torch.Tensor | None = None  # [1, R, C], block by block only
        if needs_eager(self.segments):
            self.start_eager()

    @property
    def rows(self) -> int:
        return sum(len(s.ids) for s in self.segments)

    @property
    def done(self) -> bool:
        return self.layer == self.config.n_layer

    @torch.inference_mode()
    def add(self, segments: list[Segment]) -> None:
        """More segments, caught up to this pass's next block (runner.Pass.add)."""
        if not segments:
            return
        segments = [s._replace(slot=self.runner.slot_of[s.slot]) for s in segments]
        if not self.eager:
            self.segments += segments
            if needs_eager(segments):
                self.start_eager()
            return
        y, state = self.embed(segments)
        for j in range(self.layer):
            y = self.block(j, y, *state)
        self.segments += segments
        self.x = torch.cat([self.x, y], dim=1)  # [1, R + R', C]
        self.state = self.rows_state(self.segments)

    @torch.inference_mode()
    def run_block(self) -> None:
        """Run the next block over every row (a static step: at its last block, the whole step)."""
        if self.eager:
            self.x = self.block(self.layer, self.x, *self.state)
        self.layer += 1

    def outputs(self) -> Outputs:
        """runner.Pass.outputs: every output row's Picks and the logits of the rows that sample, on the host."""
        wanted = RowPlan.of(self.segments).wanted
        lg, picked = self.head([i for i, want in enumerate(wanted) if want])
        tokens, best, lse = picked
        return Outputs(lg, Picks([int(t) for t in tokens], best, lse))

    def logits(self) -> torch.Tensor:
        """[n, V]: the logits after each segment's last `outputs` rows, on the host."""
        return self.head(list(range(len(RowPlan.of(self.segments).out_rows))))[0]

    # --- internals ------------------------------------------------------------------------------------------------

    def start_eager(self) -> None:
        """From here on block by block: the rows so far embedded and caught up to this pass's next block."""
        self.eager = True
        with torch.inference_mode():
            self.x, self.state = self.embed(self.segments)
            for j in range(self.layer):
                self.x = self.block(j, self.x, *self.state)

    def rows_state(self, segments: list[Segment]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, SteeringTap | None]:
        """What each block of an eager pass reads of these segments' rows: slots and positions [R], the key mask,
        each row's adapter (or None) and the rows' steering tap (or None)."""
        plan, device = RowPlan.of(segments), self.w.wpe.device
        slots = torch.tensor(plan.slots, device=device)
        positions = torch.tensor(plan.positions, device=device)
        mask = key_mask(positions, key_span(max(plan.positions), self.runner.cache.max_len))
        adapters = adapter_rows(segments)
        return (slots, positions, mask, None if adapters is None else adapters.to(device),
                steering_tap(self.w, self.config, segments))

    def embed(self, segments: list[Segment]) -> tuple[torch.Tensor, tuple]:
        """Segments' rows -> their residual stream [1, R, C] at their own positions, and rows_state()."""
        state = self.rows_state(segments)
        ids = torch.tensor([t for s in segments for t in s.ids], device=self.w.wpe.device)  # [R]
        steer = state[4]
        tokens = hooked(steer, "hook_embed", embed(self.w, ids)[None])  # [1, R, C]
        pos = hooked(steer, "hook_pos_embed", self.w.wpe[state[1]][None])  # [1, R, C]
        return tokens + pos, state

    def block(self, i: int, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
              adapters: torch.Tensor | None, steer: SteeringTap | None) -> torch.Tensor:
        """[1, R, C] -> [1, R, C] through block i, every hook point through the rows' steering tap."""
        blk, cache = self.w.blocks[i], self.runner.cache
        scoped = None if steer is None else ScopedTap(steer, f"blocks.{i}.")
        attend = functools.partial(slot_attention, blk=blk, n_head=self.config.n_head, k_cache=cache.k[i],
                                   v_cache=cache.v[i], slots=slots, positions=positions, mask=mask,
                                   adapters=adapters, tap=scoped)
        return block(x, blk, self.config, attend, BlockCall(tap=scoped, adapters=adapters))

    @torch.inference_mode()
    def head(self, keep: list[int]) -> tuple[torch.Tensor, list[list[float]]]:
        """(the logits of output rows `keep` [k, V] on the host, every output row's picks as lists [3][n])."""
        assert self.done, "the pass has blocks left to run"
        plan = RowPlan.of(self.segments)
        n, device = len(plan.out_rows), self.w.wpe.device
        if self.eager:
            out = torch.tensor(plan.out_rows)
            steer = self.state[4]
            lg = logits(self.w, self.config, self.x[0, out.to(device)], None if steer is None else steer.select(out))
            picked = picks(lg, torch.tensor(plan.banned, device=device))
            return lg[torch.tensor(keep, dtype=torch.long, device=device)].cpu(), picked.tolist()
        R = len(plan.ids)
        if R > MAX_STEP_ROWS:  # no static step for so many rows: every block now, one at a time
            self.start_eager()
            return self.head(keep)
        rows = 1 << (R - 1).bit_length()  # R padded to a power of two
        keys = key_span(max(plan.positions), self.runner.cache.max_len)
        dc = self.runner.device_cache
        inputs = torch.zeros(5, rows, dtype=torch.long)
        inputs[1], inputs[4] = dc.slots, -1  # padding rows (Step's): the scratch slot, nothing banned
        for i, column in enumerate((plan.ids, plan.slots, plan.positions)):
            inputs[i, :R] = torch.tensor(column)
        inputs[3, :n], inputs[4, :n] = torch.tensor(plan.out_rows), torch.tensor(plan.banned)
        with dc.lock:
            lg, picked = dc.step(self.w, self.config, rows, keys)(inputs)
            kept = lg[torch.tensor(keep, device=device)].cpu() if keep else torch.empty(0, lg.shape[1])
            return kept, picked[:, :n].tolist()


def needs_eager(segments: list[Segment]) -> bool:
    """Whether a pass over these segments runs block by block: steering or adapters (their edits and terms are the
    eager path's)."""
    return any(s.steering or s.adapter is not None for s in segments)
