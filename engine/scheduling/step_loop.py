"""The engine's loop, schedule → prepare → launch → resolve, as plain calls with no Trio.

The scheduler actor drives it with a worker thread in between; tests and
offline callers drive it with ``run_once`` and any synchronous ``execute``. With
``depth`` 2 the next step is scheduled, prepared and launched before the one
in flight returns (its tokens are ``PENDING`` until then); with 1, one step at a time. Speculation
needs every token known when a step is built, so while the scheduler wants to speculate the loop
waits for the step in flight before building the next (``schedule``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.engine.step import Batch, Sampled, Step

Inputs = TypeVar("Inputs")


class StepLoop(Generic[Inputs]):
    """At most ``depth`` steps in flight, resolved in the order they were launched."""

    def __init__(
        self,
        scheduler: Scheduler,
        prepare: Callable[[Batch[Sequence]], Inputs],
        depth: int,
        on_scheduled: Callable[[Batch[Sequence]], None] = lambda batch: None,
    ) -> None:
        if depth not in (1, 2):
            raise ValueError("depth must be 1 (one step at a time) or 2 (one step ahead)")
        self.scheduler = scheduler
        self.prepare = prepare
        self.depth = depth
        self.on_scheduled = on_scheduled
        self.in_flight: deque[Step[Inputs]] = deque()

    @property
    def has_work(self) -> bool:
        return bool(self.in_flight) or self.scheduler.has_work

    def schedule(self) -> Step[Inputs] | None:
        """Schedule the next batch, prepare its inputs, and launch it; None if nothing fits, or if
        the scheduler wants to speculate and must first learn the tokens of the step in flight."""
        if self.in_flight and self.scheduler.wants_to_speculate():
            return None  # wait for the step in flight: the next one can then carry proposals
        batch = self.scheduler.schedule(speculate=not self.in_flight)
        if not batch.chunks:
            return None
        self.on_scheduled(batch)
        step = Step(batch, self.prepare(batch))
        self.scheduler.launch(batch)
        self.in_flight.append(step)
        return step

    def due(self, scheduled: bool) -> bool:
        """Whether the oldest step's result must be taken now: the pipe is full, or nothing new
        was scheduled (so waiting is all there is to do)."""
        return bool(self.in_flight) and (len(self.in_flight) >= self.depth or not scheduled)

    def resolve(
        self, sampled: list[int], accepted: list[tuple[int, ...]] | None = None
    ) -> tuple[Batch[Sequence], list[tuple[Sequence, int]]]:
        """The oldest step returned ``sampled`` (one token per sampling chunk, after the proposals
        it ``accepted``): settle it.

        Returns its batch and each sequence that got a token, with the token's index."""
        step = self.in_flight.popleft()
        return step.batch, self.scheduler.resolve(step.batch, sampled, accepted)

    def fail(self) -> Batch[Sequence]:
        """The oldest step failed: drop it; the caller ends its requests."""
        return self.in_flight.popleft().batch

    def run_once(
        self, execute: Callable[[Step[Inputs]], Sampled | list[int]]
    ) -> tuple[Batch[Sequence], list[tuple[Sequence, int]]] | None:
        """One turn of the loop with a synchronous worker: schedule (and launch) a step, then,
        when one is due, execute the oldest and resolve it. Returns what was resolved, if anything."""
        scheduled = self.schedule() is not None
        if not self.due(scheduled):
            return None
        result = execute(self.in_flight[0])
        if isinstance(result, Sampled):
            return self.resolve(result.tokens, result.accepted)
        return self.resolve(result)
