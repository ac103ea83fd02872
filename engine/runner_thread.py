"""Which threads may run OpenMP teams: the runner's one thread, and no other.

torch's OpenMP runtime (libgomp, which our C kernels load too) keeps a pool of worker threads for
every thread that has opened a parallel region, and once it manages more threads than the machine
has cores it stops spinning at barriers for every team: each barrier then sleeps in the kernel and
is woken, dozens of times a step. On a 2-core machine one torch op that went parallel on the event
loop (a prefill chunk's mask after a prefix-cache hit) made every later decode step of the process
2.5x slower (6.5 -> 16.5 ms, SmolLM2 Q4_1, measured). ``trio.to_thread.run_sync`` with a limiter of
one runs the runner's jobs one at a time but may hand them to different threads, each of which then
keeps a pool of its own. So the runner's work runs on ``RunnerThread`` (one OS thread for the
engine's life), and the event loop's thread is kept to teams of one (``single_threaded``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import outcome
import torch
import trio

T = TypeVar("T")

_Job = tuple[Callable[[], Any], Callable[[outcome.Outcome[Any]], None]]


class RunnerThread:
    """Jobs run in order on one OS thread, started on first use and ended by ``stop``."""

    def __init__(self, name: str = "trillm-runner") -> None:
        self.name = name
        self.busy = 0  # jobs submitted whose result has not been taken yet
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the thread. Once started it is waited for even if the caller is cancelled
        (as ``trio.to_thread.run_sync`` does by default): a step in flight is never abandoned."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self.alive:
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self._thread.start()
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()

        def deliver(result: outcome.Outcome[Any]) -> None:
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        self.busy += 1
        try:
            self._jobs.put((fn, deliver))
            result: T = await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
            return result
        finally:
            self.busy -= 1

    def stop(self) -> None:
        """End the thread once the jobs before this call are done (and with it its OpenMP pool)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    def _main(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, deliver = job
            deliver(outcome.capture(fn))


_depth = threading.local()


@contextmanager
def single_threaded() -> Iterator[None]:
    """Torch ops on this thread run in teams of one while inside (nested uses count: several
    engines may share an event loop); the thread's own setting comes back on the way out."""
    depth = getattr(_depth, "n", 0)
    if depth == 0:
        # Read first: torch sets a thread's OpenMP width lazily, at its first parallel op, from
        # the width last set on any thread, which would undo the setting below.
        _depth.outer = torch.get_num_threads()
        torch.set_num_threads(1)
    _depth.n = depth + 1
    try:
        yield
    finally:
        _depth.n = depth
        if depth == 0:
            torch.set_num_threads(_depth.outer)
