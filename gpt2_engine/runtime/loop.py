"""The engine loop: it owns a Scheduler (which plans), a ModelRunner (which executes) and, when it speculates, a
Drafter (runtime/drafters.py), and an inbox through which other threads hand it requests and cancellations. Control
flows one way: the loop asks the scheduler for a plan, has the drafter and the runner execute it, and hands the
results back to the scheduler; none of them calls another, nor the loop.

`step()` is a generator over one step. It yields the Events of each piece of work (a non-empty list of plan.Output:
(SeqRef, Event)) as soon as they exist, and an empty list before each block of the step's last pass. Before each of
those blocks the loop takes its inbox, and the scheduler's `join` may hand the open pass new short prompts, which catch up the earlier
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
from .plan import Output, Plan, Prefill, Segment
from .runner import ModelRunner
from .scheduler import Scheduler, describe

log = logging.getLogger(__name__)


class EngineLoop:
    """One thread's engine. `submit` and `cancel` may be called from any thread; `step` and `wait` from the owner's."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, drafter: Drafter | None = None) -> None:
        self.scheduler, self.runner, self.drafter = scheduler, runner, drafter
        self.inbox: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self.tagged: dict[Any, set[int]] = {}  # the ids of each tag's sequences still running (owner's thread only)

    # --- any thread ---------------------------------------------------------------------------------------------

    def submit(self, requests: list, tag: Any) -> None:
        """Hand the loop a caller's requests (plan.Request); their Outputs carry `tag` and their index in
        `requests`. Raises GenerationError (in the caller's thread) for a request that does not fit."""
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
        """One step: the scheduler's Plan, executed piece by piece; each piece's Events as they come (see the module
        docstring)."""
        self.intake()
        plan = self.scheduler.schedule()
        if plan.finished:
            yield self._forget(plan.finished)
        for prefill in plan.prefills:
            yield self._forget(self._prefill(prefill))
        if plan.asks and (failed := self._draft(plan)):
            yield self._forget(failed)
        for p, segments in enumerate(plan.passes):
            if segments:  # only the last pass takes newcomers: earlier ones' events go out first
                yield from self._pass(segments, last=p == len(plan.passes) - 1)

    # --- internals ------------------------------------------------------------------------------------------------

    def _prefill(self, prefill: Prefill) -> list[Output]:
        """A prompt alone into its slot, and its first token."""
        try:
            done = self.runner.prefill(prefill.slot, prefill.prompt, scored=prefill.scored, top=prefill.top,
                                       adapter=prefill.adapter, steering=prefill.steering)
        except Exception as e:  # noqa: BLE001 - contained: this prefill's sequence fails, the loop goes on
            return self._failed([prefill.seq], e)
        return [self.scheduler.after_prefill(prefill.seq, done)]

    def _draft(self, plan: Plan) -> list[Output]:
        """Every draft of the step in one call (the draft model's passes are shared too), into the plan's passes;
        where drafting fails, the sequences it drafted for fail and leave the passes."""
        try:
            self.scheduler.drafted(plan, self.drafter.propose(list(plan.asks.values())))
            return []
        except Exception as e:  # noqa: BLE001 - contained: the sequences it drafted for fail, the loop goes on
            failed = set(plan.asks)
            plan.passes = [{i: s for i, s in segments.items() if i not in failed} for segments in plan.passes]
            return self._failed(list(failed), e)

    def _pass(self, segments: dict[int, Segment], last: bool) -> Iterator[list[Output]]:
        """One pass over the weights for these segments, block by block; before each block of the step's last pass,
        an empty yield (the owner's moment), the inbox taken, and waiting prompts joining (Scheduler.join)."""
        try:
            run = self.runner.open(list(segments.values()))
            while not run.done:
                if last:
                    yield []
                    self.intake()
                    if joined := self.scheduler.join(run.layer, run.rows):
                        run.add(list(joined.values()))
                        segments = segments | joined
                run.run_block()
            out = run.outputs()  # each row's greedy pick and logsumexp, the logits wanted
        except Exception as e:  # noqa: BLE001 - contained: this pass's sequences fail, the loop goes on
            yield self._forget(self._failed(list(segments), e))
            return
        yield self._forget(self.scheduler.update(segments, out))

    def _take(self, command: tuple[str, Any, Any]) -> None:
        kind, what, detail = command
        if kind == "add":
            self.tagged[detail] = {self.scheduler.add(r, detail, i).id for i, r in enumerate(what)}
        elif kind == "cancel":
            for seq in self.tagged.get(what, ()):
                self.scheduler.cancel(seq, detail)

    def _failed(self, seq_ids: list[int], error: Exception) -> list[Output]:
        log.error("a step of the engine failed; its %d sequence(s) end with an error", len(seq_ids), exc_info=error)
        return self.scheduler.fail(seq_ids, describe(error))

    def _forget(self, outputs: list[Output]) -> list[Output]:
        """Drop finished sequences, and tags with none left, from the cancellation table; returns the outputs."""
        for ref, event in outputs:
            if event.finish_reason is not None and (ids := self.tagged.get(ref.tag)) is not None:
                ids.discard(ref.id)
                if not ids:
                    del self.tagged[ref.tag]
        return outputs

# Next: runtime/scheduler.py, which makes each step's Plan (who runs, with how many rows) and chooses the tokens
# from a pass's outputs.
