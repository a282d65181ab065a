"""The engine loop: it owns a Scheduler (which plans), a ModelRunner (which executes) and, when it speculates, a
Drafter (runtime/drafters.py), and an inbox through which other threads hand it requests and cancellations. Control
flows one way: the loop asks the scheduler for a plan, has the drafter and the runner execute it, and hands the
results back to the scheduler; none of them calls another, nor the loop.

`step()` is a generator over one step. It yields the Events of each piece of work (a non-empty list of (SequenceState,
Event)) as soon as they exist, and an empty list before each block of the step's last pass. Before each of those blocks the
loop takes its inbox, and the scheduler's `join` may hand the open pass new short prompts, which catch up the earlier
blocks alone and ride along for the rest: a request that arrives mid-pass gets its first token from that pass. Its
owner (`gpt2 generate`'s Generation, or the server's engine thread) runs between the yields, in its own thread.

Faults are contained: an exception while the runner executes a prefill or a pass (or the drafter drafts) ends the
sequences of that work with finish reason 'error' (the exception named in one line, its traceback logged once) and
the loop goes on; the KV-cache rows they wrote are never read again (a slot's next sequence writes every position it
reads).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator
from typing import Any

from .drafters import Drafter
from .requests import Request
from .runner import ModelRunner
from .scheduler import Output, Scheduler, SequenceState, describe

log = logging.getLogger(__name__)


class EngineLoop:
    """One thread's engine. `submit` and `cancel` may be called from any thread; `step` and `wait` from the owner's."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, drafter: Drafter | None = None) -> None:
        self.scheduler, self.runner, self.drafter = scheduler, runner, drafter
        self.inbox: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self.tagged: dict[Any, list[SequenceState]] = {}  # the sequences of each tag still running (owner's thread only)

    # --- any thread ---------------------------------------------------------------------------------------------

    def submit(self, requests: list[Request], tag: Any) -> None:
        """Hand the loop a caller's requests; their Outputs carry `tag` and their index in `requests`. Raises
        GenerationError (in the caller's thread) for a request that does not fit."""
        for request in requests:
            self.scheduler.check(request)
        self.inbox.put(("add", requests, tag))

    def cancel(self, tag: Any, reason: str = "cancelled") -> None:
        """End every sequence of `tag` at the next step (a client went away, or the server stops)."""
        self.inbox.put(("cancel", tag, reason))

    def wake(self) -> None:
        """Make a `wait` return now."""
        self.inbox.put(("wake", None, None))

    # --- the owner's thread -------------------------------------------------------------------------------------

    def wait(self, timeout: float) -> None:
        """Block until the inbox holds something (or `timeout` seconds pass), then take it all."""
        try:
            self._take(self.inbox.get(timeout=timeout))
        except queue.Empty:
            return
        self.intake()

    def intake(self) -> None:
        """Take every command in the inbox."""
        while not self.inbox.empty():  # checked first: a get that raises Empty costs more, and this runs every block
            try:
                self._take(self.inbox.get_nowait())
            except queue.Empty:
                return

    def step(self) -> Iterator[list[Output]]:
        """One step: its finished sequences' Events as they come (see the module docstring)."""
        self.intake()
        sched, runner = self.scheduler, self.runner
        plan = sched.schedule()
        if plan.finished:
            yield self._forget(plan.finished)
        for seq in plan.prefill:
            try:
                r = seq.request
                done = runner.prefill(seq.slot, r.prompt, scored=r.prompt_logprobs, top=r.top_logprobs,
                                      adapter=r.adapter, steering=r.steering)
            except Exception as e:  # noqa: BLE001 - contained: this prefill's sequence fails, the loop goes on
                yield self._forget(self._failed([seq], e))
                continue
            yield self._forget([sched.after_prefill(seq, done)])
        if plan.asks:  # every draft of the step in one call: the draft model's passes are shared too
            try:
                sched.drafted(plan.asks, self.drafter.propose([ask for _, ask in plan.asks]))
            except Exception as e:  # noqa: BLE001 - contained: the sequences it drafted for fail, the loop goes on
                failed = [seq for seq, _ in plan.asks]
                yield self._forget(self._failed(failed, e))
                plan.passes = [[s for s in seqs if not s.finished] for seqs in plan.passes]
        for p, seqs in enumerate(plan.passes):
            if not seqs:
                continue
            last = p == len(plan.passes) - 1  # only the last pass takes newcomers: earlier ones' events go out first
            try:
                run = runner.open([s.segment() for s in seqs])
                while not run.done:
                    if last:
                        yield []  # the owner's moment between blocks
                        self.intake()
                        if joined := sched.join(run.layer, run.rows):
                            run.add([s.segment() for s in joined])
                            seqs = seqs + joined
                    run.run_block()
                out = run.outputs()  # each row's greedy pick and logsumexp, the logits wanted
            except Exception as e:  # noqa: BLE001 - contained: this pass's sequences fail, the loop goes on
                yield self._forget(self._failed(seqs, e))
                continue
            yield self._forget(sched.update(seqs, out))

    # --- internals ------------------------------------------------------------------------------------------------

    def _take(self, command: tuple[str, Any, Any]) -> None:
        kind, what, detail = command
        if kind == "add":
            self.tagged[detail] = [self.scheduler.add(r, detail, i) for i, r in enumerate(what)]
        elif kind == "cancel":
            for seq in self.tagged.get(what, ()):
                self.scheduler.cancel(seq, detail)

    def _failed(self, seqs: list[SequenceState], error: Exception) -> list[Output]:
        log.error("a step of the engine failed; its %d sequence(s) end with an error", len(seqs), exc_info=error)
        return self.scheduler.fail(seqs, describe(error))

    def _forget(self, outputs: list[Output]) -> list[Output]:
        """Drop finished tags from the cancellation table; returns the outputs."""
        for seq, event in outputs:
            if event.finish_reason is not None and all(s.finished for s in self.tagged.get(seq.tag, ())):
                self.tagged.pop(seq.tag, None)
        return outputs
