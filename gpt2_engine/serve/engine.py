"""The engine thread: it alone owns the model and the Scheduler; HTTP handlers hand it work and read per-request queues.

Handlers never run the model. `submit` puts a job in the thread's inbox and returns a Handle whose asyncio queue
receives (sequence index, Event) pairs, delivered into the event loop with call_soon_threadsafe. Back-pressure:
`submit` refuses (QueueFull) when the sequences waiting for a slot would exceed max_queue, and a sequence that waits
longer than queue_timeout seconds ends with finish reason 'queue_timeout'. Between steps, and before each block of a
pass (in the first half of the blocks a new short prompt joins the pass), the thread takes new jobs and
cancellations, so a cancelled sequence leaves its slot within one step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from ..core.scheduler import Event, Request, Scheduler, Sequence
from .metrics import Metrics

IDLE_WAIT = 0.05  # seconds the thread blocks on an empty inbox when there is nothing to run


class QueueFull(Exception):
    """The waiting queue has no room for the request."""


@dataclass(eq=False)
class Handle:
    """One HTTP request's sequences and the queue their events arrive on."""

    requests: list[Request]
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)
    seqs: list[Sequence] = field(default_factory=list)  # set by the engine thread
    last_token_at: dict[int, float] = field(default_factory=dict)


class AsyncEngine:
    def __init__(self, scheduler: Scheduler, *, max_queue: int, queue_timeout: float) -> None:
        self.scheduler = scheduler
        self.max_queue, self.queue_timeout = max_queue, queue_timeout
        self.metrics = Metrics()
        self.inbox: queue.SimpleQueue[tuple[str, Handle | None]] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.queued = 0  # sequences submitted and not yet in a slot (or finished)
        self.live: set[Handle] = set()  # touched by the engine thread only
        self.thread = threading.Thread(target=self._loop, name="gpt2-engine", daemon=True)
        self.stopped = threading.Event()
        self.stopping = False  # set by the engine thread when it takes the stop command

    def start(self) -> None:
        self.thread.start()

    def alive(self) -> bool:
        """Whether the engine thread runs (a replica's health check)."""
        return self.thread.is_alive() and not self.stopped.is_set()

    # --- called from the event loop -----------------------------------------------------------------------------

    def submit(self, requests: list[Request]) -> Handle:
        """Queue the sequences of one HTTP request; raises QueueFull when the waiting queue cannot take them."""
        with self.lock:
            if self.stopped.is_set():
                raise QueueFull("the server is shutting down")
            if self.queued + len(requests) > self.max_queue:
                self.metrics.count(self.metrics.requests_rejected, "queue_full")
                raise QueueFull(f"the waiting queue is full ({self.max_queue} sequences)")
            self.queued += len(requests)
        handle = Handle(requests, asyncio.Queue(), asyncio.get_running_loop())
        self.inbox.put(("add", handle))
        return handle

    def cancel(self, handle: Handle) -> None:
        """Free the handle's slots within one step (a client went away)."""
        self.inbox.put(("cancel", handle))

    def stop(self) -> None:
        """End every in-flight request with finish reason 'shutdown' and stop the thread."""
        self.stopped.set()
        self.inbox.put(("stop", None))
        self.thread.join(timeout=30)

    def gauges(self) -> dict[str, tuple[float, str]]:
        sched = self.scheduler
        return {
            "requests_running": (sched.running, "Sequences in a slot."),
            "requests_waiting": (self.queued, "Sequences waiting for a slot."),
            "slots_busy": (sched.running, "KV-cache slots in use."),
            "slots_total": (len(sched.slots), "KV-cache slots (--parallel)."),
        }

    # --- the engine thread --------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.stopping:
            self._intake(wait=not self.scheduler.waiting and self.scheduler.running == 0)
            if self.stopping:
                break
            self._expire()
            if self.scheduler.waiting or self.scheduler.running:
                self.scheduler.step(self._intake)  # also between blocks: new prompts may join the running pass
        self._shutdown()

    def _intake(self, wait: bool = False) -> None:
        """Take every command in the inbox (add, cancel, stop); with `wait`, block up to IDLE_WAIT for the first."""
        try:
            command, handle = self.inbox.get(timeout=IDLE_WAIT) if wait else self.inbox.get_nowait()
            while True:
                if command == "stop":
                    self.stopping = True
                elif command == "add":
                    self._add(handle)
                elif command == "cancel":
                    for seq in handle.seqs:
                        self.scheduler.cancel(seq)
                command, handle = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _add(self, handle: Handle) -> None:
        self.live.add(handle)
        for i, request in enumerate(handle.requests):
            handle.seqs.append(self.scheduler.add(request, lambda e, h=handle, i=i: self._deliver(h, i, e)))

    def _expire(self) -> None:
        now = time.perf_counter()
        for seq in self.scheduler.waiting:
            if now - seq.queued_at > self.queue_timeout:
                self.scheduler.cancel(seq, "queue_timeout")

    def _deliver(self, handle: Handle, i: int, event: Event) -> None:
        """Runs on the engine thread for every event: metrics, then into the handler's queue."""
        now, m = time.perf_counter(), self.metrics
        if i not in handle.last_token_at:  # the sequence's first event: it left the waiting queue
            with self.lock:
                self.queued -= 1
            if event.finish_reason == "queue_timeout":
                m.count(m.requests_rejected, "queue_timeout")
            else:
                m.prompt_tokens += len(handle.requests[i].prompt)
            if event.token is not None:
                m.time_to_first_token.observe(now - handle.arrived)
        elif event.token is not None:
            m.time_per_output_token.observe(now - handle.last_token_at[i])
        handle.last_token_at[i] = now
        if event.token is not None:
            m.generation_tokens += 1
        if event.finish_reason is not None:
            m.count(m.requests_finished, event.finish_reason)
            if all(s.finished for s in handle.seqs):
                self.live.discard(handle)
        handle.loop.call_soon_threadsafe(handle.events.put_nowait, (i, event))

    def _shutdown(self) -> None:
        for handle in list(self.live):
            for seq in handle.seqs:
                if not seq.finished:
                    self.scheduler.cancel(seq, "shutdown")
        self.scheduler.step()  # delivers the 'shutdown' events; nothing new is admitted after a cancel-only step
