"""What crosses the pipe between the front end and a replica process (pickled by ``Connection``).

Requests carry their constraint as a ``GrammarSpec`` (the replica compiles it with its own
cached compiler; compiled grammars do not pickle). Outputs travel in batches, one message
per turn of the replica's event loop rather than one per token.
"""

from __future__ import annotations

import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

import attrs

from trillm.engine.outputs import EngineStats, RequestOutput
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.structured.spec import GrammarSpec


# -- front end -> replica -------------------------------------------------------------
@attrs.frozen
class Submit:
    """One ``submit_many`` call: its requests, under the front end's ids."""

    ids: tuple[str, ...]
    requests: tuple[tuple[list[int], SamplingParams, GrammarSpec | None], ...]


@attrs.frozen
class Abort:
    request_id: str


@attrs.frozen
class Flush:
    pass


@attrs.frozen
class Stop:
    pass


# -- replica -> front end -------------------------------------------------------------
@attrs.frozen
class Ready:
    """The replica has loaded its model and runs."""

    max_model_len: int
    projection_bytes: int
    footprint_bytes: int  # its weights and KV pool (``Engine.footprint_bytes``)
    classifier: Any = None  # a sequence classifier's head ([labels, hidden], float32, CPU): rerank reads it


@attrs.frozen
class Outputs:
    """Outputs of any requests, in order; ``done``: ``Submit`` calls (by first id) all of whose
    requests have finished."""

    outputs: tuple[tuple[str, RequestOutput], ...]
    done: tuple[str, ...] = ()


@attrs.frozen
class Refused:
    """A ``Submit`` the replica's engine refused (a race the front end's checks missed)."""

    first_id: str
    reason: str


@attrs.frozen
class Stats:
    stats: EngineStats


class PipeWriter:
    """Sends on a pipe from a thread of its own, so that neither event loop ever blocks on a full
    pipe: with both sides sending on their loops, a large ``Submit`` one way and a burst of
    ``Outputs`` the other could each wait for the other's loop to read. ``send`` never blocks
    nor raises; a pipe that broke is noticed by its reader (the other side has gone)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(conn,), name=name, daemon=True)
        self._thread.start()

    def send(self, message: object) -> None:
        self._queue.put(message)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread."""
        self._queue.put(_END)
        self._thread.join(timeout)

    def _run(self, conn: Connection) -> None:
        while (message := self._queue.get()) is not _END:
            try:
                conn.send(message)
            except OSError:  # the other side has gone: drop the rest, the reader will say so
                return


_END = object()
