"""The engine's Trio event loop on a background thread, for as long as its ``LLM`` lives.

A thread rather than ``trio.run`` per call: the engine's actors, its KV pool and prefix
cache, its tensor-parallel ranks, replicas and grammar workers stay up between calls,
so the second ``generate`` starts at once and reuses the first one's cached prefixes.
The calling thread keeps Python's signals: a Ctrl-C interrupts its wait, and it asks
the loop to cancel its work there (``call``), which frees the pages as an HTTP
client's disconnect does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine
from typing import Any, Protocol, TypeVar

import trio

from trillm.engine.errors import EngineNotRunning

T = TypeVar("T")


def unwrap(exc: BaseException) -> BaseException:
    """The first real error inside the nurseries' exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


class Runnable(Protocol):
    """What the loop runs: ``Engine`` or, with ``dp > 1``, ``ReplicaSet``."""

    async def run(self, *, task_status: trio.TaskStatus[None] = ...) -> None: ...


class EngineLoop:
    """Runs ``engine.run`` in a Trio loop on its own thread; ``call`` and ``spawn`` reach into it."""

    def __init__(self, engine: Runnable, name: str = "trillm-engine") -> None:
        self.engine = engine
        self.failure: BaseException | None = None  # why the engine stopped by itself, if it did
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._ready = threading.Event()
        self._stopping = False
        # A daemon: a script that never closes its LLM still exits (``LLM`` closes it at exit).
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._nursery is None:  # the engine failed to start
            self._thread.join()
            cause = unwrap(self.failure) if self.failure is not None else None
            raise EngineNotRunning(f"the engine failed to start: {cause!r}") from cause

    @property
    def running(self) -> bool:
        """The loop's thread is up (the engine has not stopped by itself)."""
        return self._thread.is_alive()

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # the engine stopped by itself (a rank died): later calls say so
            self.failure = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            await nursery.start(self._run_engine)
            self._nursery = nursery
            self._ready.set()
            await trio.sleep_forever()  # until ``stop`` cancels the nursery

    async def _run_engine(self, task_status: trio.TaskStatus[None]) -> None:
        await self.engine.run(task_status=task_status)
        raise EngineNotRunning("the engine stopped")  # ``run`` returns only when cancelled

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the loop's thread, between its steps; from any other thread."""
        if self._stopping or self._token is None:
            raise EngineNotRunning("this LLM has been closed")
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            cause = unwrap(self.failure) if self.failure is not None else None
            raise EngineNotRunning(f"the engine has stopped: {cause!r}") from cause

    def spawn(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start ``fn()`` as a task beside the engine; it is cancelled when the loop stops."""

        def start() -> None:
            assert self._nursery is not None
            self._nursery.start_soon(fn)

        self.call(start)

    def stop(self) -> None:
        """Cancel the engine (its ``run`` ends every request, frees every page and stops its ranks and
        replicas) and wait for the thread. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        nursery = self._nursery
        if nursery is not None and self._token is not None:
            try:
                trio.from_thread.run_sync(nursery.cancel_scope.cancel, trio_token=self._token)
            except trio.RunFinishedError:
                pass  # it stopped by itself already
        self._thread.join()
