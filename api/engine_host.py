"""The engine's lifetime inside the app: started in the app's nursery, stopped before the server."""

from __future__ import annotations

import logging

import trio

from trillm.engine import Engine, EngineObserver, ReplicaSet


class EngineHost:
    """Runs the engine in its own cancel scope so it can be stopped before the server."""

    def __init__(self, engine: Engine | ReplicaSet, observer: EngineObserver) -> None:
        self.engine = engine
        self.observer = observer
        self._scope: trio.CancelScope | None = None
        self._stopped = trio.Event()
        self.failed = trio.Event()  # the engine stopped by itself (a tensor-parallel rank died)
        self.failure: Exception | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine; if it fails, record why and set ``failed`` (``trillm serve`` then exits
        non-zero; under another ASGI server, requests get 503 from here on)."""
        try:
            with trio.CancelScope() as self._scope:
                await self.engine.run(observer=self.observer, task_status=task_status)
        except Exception as exc:
            while isinstance(exc, ExceptionGroup) and exc.exceptions:  # the engine's nursery wraps it
                exc = exc.exceptions[0]
            self.failure = exc
            logging.getLogger("trillm.engine").critical("the engine stopped: %s", exc)
            self.failed.set()
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """End every open stream (finish_reason "abort"), free all pages, wait for the actors."""
        if self._scope is not None:
            self._scope.cancel()
            await self._stopped.wait()
