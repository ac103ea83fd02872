"""Who goes first: the order of the waiting queue and the choice of whom to preempt.

Pure (no Trio, no clock). Under ``fcfs`` requests go by arrival and the newest
running one is preempted, as before. Under ``priority`` (vLLM's semantics: lower
is sooner) they go by ``(priority, arrival)``, and a waiting request may displace
a running one it outranks.

Aging bounds starvation: a request's effective priority improves by one per
``aging_seconds`` since it arrived, ``priority - (now - arrival) / aging``.
Comparing two requests at any moment, the ``now`` cancels out, so the order is
that of ``arrival + priority * aging`` and never changes as time passes: the
waiting queue stays sorted without a clock, and a sequence preempted for another
never outranks it later (no ping-pong). A request is overtaken only by requests
arriving less than ``(its priority - theirs) * aging`` seconds after it.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

import attrs

from trillm.engine.scheduling.sequence import Sequence

FCFS = "fcfs"
PRIORITY = "priority"


@attrs.frozen
class SchedulingPolicy:
    """``name`` is ``fcfs`` or ``priority``; ``aging_seconds`` 0 turns aging off."""

    name: str = FCFS
    aging_seconds: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.name not in (FCFS, PRIORITY):
            raise ValueError(f"scheduling policy must be {FCFS} or {PRIORITY}, not {self.name!r}")
        if self.aging_seconds < 0:
            raise ValueError("priority aging must be >= 0 seconds")

    @property
    def by_priority(self) -> bool:
        return self.name == PRIORITY

    def rank(self, seq: Sequence) -> tuple[float, float]:
        """Sorts first who goes first; equal ranks go by arrival."""
        if not self.by_priority:
            return (0.0, seq.arrival_time)
        priority = seq.params.priority
        if self.aging_seconds > 0:
            return (seq.arrival_time + priority * self.aging_seconds, seq.arrival_time)
        return (float(priority), seq.arrival_time)

    def enqueue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        """A new request joins the queue: at the back, or after every request that outranks it."""
        if self.by_priority:
            bisect.insort_right(waiting, seq, key=self.rank)
        else:
            waiting.append(seq)

    def requeue(self, waiting: deque[Sequence], seq: Sequence) -> None:
        """A preempted sequence goes back: to the front (fcfs), or to its rank's place, before
        its equals (as under fcfs: so an ``n > 1`` leader goes back before its followers)."""
        if self.by_priority:
            bisect.insort_left(waiting, seq, key=self.rank)
        else:
            waiting.appendleft(seq)

    def victim(self, candidates: Iterable[Sequence]) -> Sequence:
        """Whom to preempt: the newest (fcfs), or the lowest-ranked, the latest among equals."""
        return max(candidates, key=self.rank)

    def outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Whether waiting ``seq`` may displace running ``other`` (never under fcfs)."""
        return self.by_priority and self.rank(seq) < self.rank(other)
