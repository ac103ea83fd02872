"""The one place a request's end is applied and counted.

Whatever ended it (``end_kinds.End``), ``Endings.end`` does the same few things in the same
order: count it, tell the observer if it ran to its end, close its output (with a last
output saying why, when the kind calls for one) and give its pages back to the scheduler —
``release_finished`` for a request the output path finished, ``abort`` for one cut short.
``EngineStats.num_aborted``/``num_stalled`` are read from these counts.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from trillm.engine.scheduling.end_kinds import End
from trillm.engine.scheduling.output_router import OutputRouter
from trillm.engine.scheduling.scheduler import Scheduler

log = logging.getLogger("trillm.engine")


class Endings:
    """Ends open requests of one engine; ``counts`` holds how many ended each way."""

    def __init__(self, router: OutputRouter, scheduler: Scheduler) -> None:
        self.router = router
        self.scheduler = scheduler
        self.counts: Counter[End] = Counter()

    @property
    def num_aborted(self) -> int:
        return sum(n for kind, n in self.counts.items() if kind.counts_as_aborted)

    @property
    def num_stalled(self) -> int:
        return self.counts[End.STALLED]

    def end(self, request_id: str, kind: End, error: str | None = None) -> bool:
        """End an open request ``kind``'s way (``error``: what went wrong, for ``End.ERROR``).

        Returns whether it was open; ending a request twice does nothing the second time."""
        live = self.router.live.get(request_id)
        if live is None:
            return False
        self.counts[kind] += 1
        if kind is End.STALLED:
            log.info("request %s aborted: its client read nothing for %ss", request_id, self.router.stall_timeout)
        if kind.ran_to_end:
            live.timer.on_finished(self.router.observer, live.seq.finish_reason or "stop", time.monotonic())
        self.router.close(request_id, kind.last_reason, error)
        if kind.ran_to_end:
            self.scheduler.release_finished(request_id)  # a stop string's finish; else already freed
        else:
            self.scheduler.abort(request_id)
        return True
