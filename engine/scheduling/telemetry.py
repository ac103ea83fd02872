"""Per-request timings, reported to whoever watches the engine (e.g. Prometheus in ``api``).

The engine stays free of any metrics library: it calls an ``EngineObserver``,
and the default one does nothing.
"""

from __future__ import annotations

from typing import Protocol

import attrs


class EngineObserver(Protocol):
    """``priority`` is the request's own (``SamplingParams.priority``), whatever the policy."""

    def queue_time(self, seconds: float, priority: int = 0) -> None: ...
    def first_token(self, seconds: float, priority: int = 0) -> None: ...
    def inter_token(self, seconds: float) -> None: ...
    def finished(self, reason: str, seconds: float) -> None: ...


class NullObserver:
    def queue_time(self, seconds: float, priority: int = 0) -> None:
        pass

    def first_token(self, seconds: float, priority: int = 0) -> None:
        pass

    def inter_token(self, seconds: float) -> None:
        pass

    def finished(self, reason: str, seconds: float) -> None:
        pass


@attrs.define
class RequestTimer:
    """When a request arrived (its sequence's ``arrival_time``), was first scheduled,
    and produced its last token; ``priority`` labels its queue time and first token."""

    arrival: float
    priority: int = 0
    scheduled: float | None = None
    last_token: float | None = None

    def on_scheduled(self, observer: EngineObserver, now: float) -> None:
        if self.scheduled is None:
            self.scheduled = now
            observer.queue_time(now - self.arrival, self.priority)

    def on_token(self, observer: EngineObserver, now: float) -> None:
        if self.last_token is None:
            observer.first_token(now - self.arrival, self.priority)
        else:
            observer.inter_token(now - self.last_token)
        self.last_token = now

    def on_finished(self, observer: EngineObserver, reason: str, now: float) -> None:
        observer.finished(reason, now - self.arrival)
