"""How a request can end, and what each way means for its consumer and the metrics.

The kinds are decided where the news arrives (a token routed, a step failed, an abort,
the engine stopping) and applied in one place, ``endings.Endings.end``; this table is
what that function reads, so the counts ``/metrics`` shows follow from it alone.
"""

from __future__ import annotations

import enum


class End(enum.Enum):
    FINISHED = "finished"  # EOS, a stop token or the length limit: the scheduler freed its pages as it settled
    STOPPED = "stopped"  # a stop string found in its text: finished by the output path, its pages freed now
    ABORTED = "aborted"  # its caller called ``abort`` (the handler left)
    GONE = "gone"  # its consumer closed the mailbox
    STALLED = "stalled"  # its consumer took nothing for ``stall_timeout``
    ERROR = "error"  # its step failed, or its grammar allowed no token
    SHUTDOWN = "shutdown"  # the engine stopped while it was open

    @property
    def ran_to_end(self) -> bool:
        """Its last output (with its finish reason) is already sent; the observer hears it finished."""
        return self in (End.FINISHED, End.STOPPED)

    @property
    def last_reason(self) -> str | None:
        """The finish reason of the closing output the ending sends; None sends none (the consumer
        has left, or asked to stop, or already has its last output)."""
        return _LAST_REASON[self]

    @property
    def counts_as_aborted(self) -> bool:
        """Counted in ``EngineStats.num_aborted``: cancelled by its client (leaving, aborting,
        or not reading). Ending with the engine is not counted."""
        return self in (End.ABORTED, End.GONE, End.STALLED)


_LAST_REASON: dict[End, str | None] = {
    End.FINISHED: None,
    End.STOPPED: None,
    End.ABORTED: None,
    End.GONE: None,
    End.STALLED: "abort",
    End.ERROR: "error",
    End.SHUTDOWN: "abort",
}
