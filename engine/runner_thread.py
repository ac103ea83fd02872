"""Which threads may run OpenMP teams: the runner's one thread, and no other.

torch's OpenMP runtime (libgomp, which our C kernels load too) keeps a pool of worker threads for
every thread that has opened a parallel region, and once it manages more threads than the machine
has cores it stops spinning at barriers for every team: each barrier then sleeps in the kernel and
is woken, dozens of times a step. On a 2-core machine one torch op that went parallel on the event
loop (a prefill chunk's mask after a prefix-cache hit) made every later decode step of the process
2.5x slower (6.5 -> 16.5 ms, SmolLM2 Q4_1, measured). ``trio.to_thread.run_sync`` with a limiter of
one runs the runner's jobs one at a time but may hand them to different threads, each of which then
keeps a pool of its own. So the runner's work runs on ``RunnerThread`` (one OS thread while an
engine runs, and one for all the CPU engines of a process: two engines' runner threads are two
pools, which throttled both, as several models behind one server or an offline comparison of two
engines have), and the event loop's thread is kept to teams of one (``single_threaded``).
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
    """Jobs run in order on one OS thread, started on first use and ended by ``stop`` (or when
    the last ``hold`` ends). Jobs may come from several Trio runs (each engine of an offline
    ``LLM`` has its own)."""

    def __init__(self, name: str = "trillm-runner") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._busy = 0  # jobs submitted whose result has not been taken yet
        self._holders = 0
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # the running thread's
        self._thread: threading.Thread | None = None

    @classmethod
    def for_device(cls, device: torch.device) -> RunnerThread:
        """The CPU engines of a process share one thread; a GPU engine has one of its own (its
        steps mostly wait on the device, and two models' may overlap there)."""
        if device.type != "cpu":
            return cls(f"trillm-runner-{device}")
        return _CPU

    @property
    def busy(self) -> int:
        return self._busy

    @property
    def holders(self) -> int:
        return self._holders

    @contextmanager
    def hold(self) -> Iterator[None]:
        """While an engine runs: the thread stops when the last holder is done with it."""
        with self._lock:
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                last = self._holders == 0
            if last:
                self.stop()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the thread. Once started it is waited for even if the caller is cancelled
        (as ``trio.to_thread.run_sync`` does by default): a step in flight is never abandoned."""
        await trio.lowlevel.checkpoint_if_cancelled()
        with self._lock:
            if not self.alive:
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._main, args=(self._jobs,), name=self.name, daemon=True)
                self._thread.start()
            self._busy += 1
            jobs = self._jobs
        token = trio.lowlevel.current_trio_token()
        task = trio.lowlevel.current_task()

        def deliver(result: outcome.Outcome[Any]) -> None:
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        try:
            jobs.put((fn, deliver))
            result: T = await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
            return result
        finally:
            with self._lock:
                self._busy -= 1

    def stop(self) -> None:
        """End the thread once the jobs before this call are done (and with it its OpenMP pool)."""
        with self._lock:
            thread, self._thread, jobs = self._thread, None, self._jobs
        if thread is not None:
            jobs.put(None)
            thread.join()

    @staticmethod
    def _main(jobs: queue.SimpleQueue[_Job | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, deliver = job
            del job
            result = outcome.capture(fn)
            del fn  # nothing of a finished job stays referenced here (a step holds its grammars' state)
            deliver(result)
            del deliver, result


_CPU = RunnerThread()
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
