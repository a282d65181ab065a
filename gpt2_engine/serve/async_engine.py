"""The engine thread: it alone drives the EngineLoop (runtime/loop.py); HTTP handlers hand it work and read per-request
queues.

Handlers never run the model. `submit` hands a request's sequences to the loop's inbox and returns a Handle whose
asyncio queue receives (sequence index, Event) pairs, delivered into the event loop with call_soon_threadsafe.
Admission: the server holds at most `slots + max_queue` sequences (running or waiting), so a burst of that many is
all accepted by an idle server and the next is refused (QueueFull: 429); a sequence that waits longer than
queue_timeout seconds ends with finish reason 'queue_timeout'. The loop takes its inbox between steps and between
the blocks of a pass, so a cancelled sequence leaves its slot within one step.

Faults: an exception inside a step's work ends that work's sequences with an 'error' event and the thread goes on
(runtime/loop.py). Anything else that escapes the loop is fatal: every waiting client gets an error event, `failure`
says why (/health answers 503 with it) and `gpt2 serve` exits non-zero, so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import GenerationError
from ..core.kernels import decode_kernels
from ..core.lora import attach
from ..formats.peft import load_adapter
from ..runtime.loop import EngineLoop
from ..runtime.plan import Event
from ..runtime.prefix import DEFAULT_CAPACITY_MB, PrefixCache
from ..runtime.requests import Request
from ..runtime.plan import Output
from ..runtime.scheduler import Scheduler, describe
from ..runtime.speculation import SERVE_MAX_RUNNING, SERVE_SETTLE_TOKENS
from .metrics import Metrics

IDLE_WAIT = 0.05  # seconds the thread blocks on an empty inbox when there is nothing to run
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """The engine's share of `gpt2 serve`'s options."""

    parallel: int = 8  # KV-cache slots
    max_queue: int = 64  # sequences that may wait for a slot
    queue_timeout: float = 60.0  # seconds a sequence may wait
    speculate: str | None = None  # a drafter (runtime/speculation.py), used while at most SERVE_MAX_RUNNING sequences run
    draft_tokens: int | None = None  # its K (None: adaptive)
    prefix_cache_mb: float | None = DEFAULT_CAPACITY_MB  # the prefix cache's bound (None: no prefix cache)

    @classmethod
    def from_args(cls, args: Any) -> EngineSettings:
        mb = None if args.no_prefix_cache else args.prefix_cache_mb or DEFAULT_CAPACITY_MB
        return cls(args.parallel, args.max_queue, args.queue_timeout, args.speculate, args.draft_tokens, mb)


def start_engine(model: Any, settings: EngineSettings, adapters: Sequence[Path] = ()) -> AsyncEngine:
    """A running engine thread over a loaded GPT2: one server's, or one Ray replica's. `adapters`: LoRA adapter
    directories served next to the base, stacked on its weights as adapters 0, 1, ... (requests name theirs; the
    base's rows use none), so that one pass runs requests for any of them."""
    if model.runner_kind == "native":
        decode_kernels()  # built (once per machine) before the first request, not during it
    slots = settings.parallel
    spec = drafter = None
    if settings.speculate is not None:  # drafts from the base's weights, whatever adapter a request names
        spec = model.speculation(settings.speculate, settings.draft_tokens, max_running=SERVE_MAX_RUNNING,
                                 settle=SERVE_SETTLE_TOKENS)
        drafter = spec.drafter(slots, model.config.n_positions)
    prefix = None if settings.prefix_cache_mb is None else PrefixCache(model.config, settings.prefix_cache_mb)
    weights = attach(model.weights, [load_adapter(path, model.config) for path in adapters])
    loop = EngineLoop(Scheduler(model.config, model.tokenizer, slots=slots, queue_timeout=settings.queue_timeout,
                                speculation=None if spec is None else spec.policy),
                      model.runner(weights, model.config, slots=slots, prefix=prefix), drafter)
    engine = AsyncEngine(loop, max_queue=settings.max_queue)
    engine.start()
    return engine


class QueueFull(Exception):
    """The server holds as many sequences as it may; retry later."""


class EngineDown(Exception):
    """The engine thread has stopped after a fatal failure."""


@dataclass(eq=False)
class Handle:
    """One HTTP request's sequences and the queue their events arrive on."""

    requests: list[Request]
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)
    last_token_at: dict[int, float] = field(default_factory=dict)  # engine thread only
    finished: set[int] = field(default_factory=set)  # indices of finished sequences (engine thread only)


class AsyncEngine:
    def __init__(self, loop: EngineLoop, *, max_queue: int) -> None:
        self.loop = loop
        self.max_queue = max_queue
        self.lock = threading.Lock()
        self.held = 0  # sequences submitted and not finished (running or waiting)
        self.queued = 0  # sequences submitted and not yet run (waiting for a slot)
        self.live: set[Handle] = set()  # handles with a sequence not finished
        self.metrics = Metrics(running=lambda: loop.scheduler.running, waiting=lambda: self.queued,
                               slots=len(loop.scheduler.slots), prefix=loop.runner.prefix)
        self.thread = threading.Thread(target=self._run, name="gpt2-engine", daemon=True)
        self.stopping = threading.Event()
        self.failure: str | None = None  # why the engine thread stopped, after a fatal failure

    @property
    def capacity(self) -> int:
        """Sequences the server holds at most: its slots and its waiting queue."""
        return len(self.loop.scheduler.slots) + self.max_queue

    def start(self) -> None:
        self.thread.start()

    def alive(self) -> bool:
        """Whether the engine thread runs and takes work (a replica's health check)."""
        return self.thread.is_alive() and not self.stopping.is_set() and self.failure is None

    # --- called from the event loop -----------------------------------------------------------------------------

    def submit(self, requests: list[Request]) -> Handle:
        """Hand the sequences of one HTTP request to the engine. Raises QueueFull when the server holds too many,
        EngineDown after a fatal failure, GenerationError for a request that does not fit."""
        handle = Handle(requests, asyncio.Queue(), asyncio.get_running_loop())
        with self.lock:
            if self.failure is not None:
                raise EngineDown(self.failure)
            if self.stopping.is_set():
                raise QueueFull("the server is shutting down")
            if len(requests) > self.capacity:  # would wait for room that never comes: not a matter of retrying
                raise GenerationError(f"the request asks for {len(requests):,} sequences (prompts x n); this server "
                                      f"holds at most {self.capacity:,} at once (--parallel plus --max-queue)",
                                      param="prompt")
            if self.held + len(requests) > self.capacity:
                self.metrics.requests_rejected.labels("queue_full").inc()
                raise QueueFull(f"the server holds its {len(self.loop.scheduler.slots)} running and {self.max_queue} "
                                f"waiting sequences")
            self.loop.submit(requests, tag=handle)
            self.held += len(requests)
            self.queued += len(requests)
            self.live.add(handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        """Free the handle's slots within one step (a client went away)."""
        self.loop.cancel(handle)

    def stop(self) -> None:
        """End every in-flight request with finish reason 'shutdown' and stop the thread."""
        self.stopping.set()
        self.loop.wake()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=30)

    # --- the engine thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.loop.scheduler.idle:
                    self.loop.wait(IDLE_WAIT)
                    continue
                for outputs in self.loop.step():
                    self._deliver(outputs)
            self._shutdown()
        except BaseException as e:  # noqa: BLE001 - fatal: every client is told, then the process exits non-zero
            self.failure = f"the engine stopped: {describe(e)}"
            log.critical("the engine thread failed; the server stops", exc_info=e)
            self._fail_everyone(self.failure)

    def _shutdown(self) -> None:
        self.loop.intake()
        with self.lock:
            live = list(self.live)
        for handle in live:
            self.loop.cancel(handle, "shutdown")
        for outputs in self.loop.step():  # nothing runs: every sequence was cancelled
            self._deliver(outputs)

    def _fail_everyone(self, message: str) -> None:
        with self.lock:
            live, self.live = list(self.live), set()
            self.held = self.queued = 0
        for handle in live:
            for i in set(range(len(handle.requests))) - handle.finished:
                post(handle, i, Event(None, "", finish_reason="error", error=message))

    def _deliver(self, outputs: list[Output]) -> None:
        """Metrics, then each event into its handler's queue."""
        m = self.metrics
        for ref, event in outputs:
            handle, i, now = ref.tag, ref.index, time.perf_counter()
            if i not in handle.last_token_at:  # the sequence's first event: it left the waiting queue
                with self.lock:
                    self.queued -= 1
                if event.finish_reason == "queue_timeout":
                    m.requests_rejected.labels("queue_timeout").inc()
                elif event.finish_reason != "error":
                    m.prompt_tokens.inc(len(handle.requests[i].prompt))
                if event.token is not None:
                    m.time_to_first_token.observe(now - handle.arrived)
            elif event.token is not None:
                m.time_per_output_token.observe(now - handle.last_token_at[i])
            handle.last_token_at[i] = now
            if event.token is not None:
                m.generation_tokens.inc()
            if event.finish_reason is not None:
                m.requests_finished.labels(event.finish_reason).inc()
                if (done := event.done) is not None and done.verified:
                    m.draft_tokens.inc(done.drafted)
                    m.accepted_tokens.inc(done.accepted)
                    m.verify_passes.inc(done.verified)
                handle.finished.add(i)
                with self.lock:
                    self.held -= 1
                    if len(handle.finished) == len(handle.requests):
                        self.live.discard(handle)
            post(handle, i, event)


def post(handle: Handle, i: int, event: Event) -> None:
    """Put (i, event) on the handle's queue, in its event loop's thread (gone at shutdown: nobody reads it then)."""
    try:
        handle.loop.call_soon_threadsafe(handle.events.put_nowait, (i, event))
    except RuntimeError:  # the event loop has closed
        pass
