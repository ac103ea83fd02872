"""Process helpers shared by every process the engine starts: tensor-parallel ranks
(``execution/launch.py``) and data-parallel replicas (``replicas/``).

Both kinds are ``multiprocessing`` spawn children that their parent stops (never a signal
of their own), and both are joined the same way when the server stops.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any


def ignore_stop_signals() -> None:
    """For processes that their parent stops (ranks, replicas): the signals are the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def children_allowed() -> Iterator[None]:
    """Let this process start children even when it is itself a daemonic ``multiprocessing`` child,
    as Hypercorn's workers are (``hypercorn -k trio 'trillm.api.app:create_app()'``). Python forbids
    it so that children are not orphaned when a daemon is killed; ours stop on their own then (a
    rank at ``--dist-timeout`` without heartbeats, a replica when its pipe ends)."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    was = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = was


def join_or_kill(processes: list[Any], timeout: float) -> None:
    """Wait for ``processes`` to exit, all within one ``timeout``; kill those still running then
    (ranks and replicas ignore SIGTERM, so there is no gentler signal to try)."""
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
