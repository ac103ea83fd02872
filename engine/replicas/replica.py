"""The body of a replica process: a whole engine, serving the front end over a pipe.

The front end sends ``Submit``, ``Abort``, ``Flush`` and ``Stop``; the replica answers
with batched ``Outputs``, ``Refused`` and periodic ``Stats``. Each submitted call's
outputs are read from its engine mailbox by one task and queued for the sender task,
which writes whatever has gathered as one message. When the pipe closes (the front
end died) the replica stops: it never outlives its server.
"""

from __future__ import annotations

import logging
import os
from multiprocessing.connection import Connection
from typing import Any

import attrs
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine
from trillm.engine.mailbox import OutputMailbox
from trillm.engine.outputs import RequestOutput
from trillm.engine.processes import ignore_stop_signals
from trillm.engine.replicas.protocol import Abort, Flush, Outputs, PipeWriter, Ready, Refused, Stats, Stop, Submit

log = logging.getLogger("trillm.engine")
STATS_PERIOD = 0.1  # seconds between stats reports while they change


def replica_main(
    config: EngineConfig, index: int, conn: Connection, visible_devices: str | None, kv_sharers: int = 1
) -> None:
    """Process entry (``multiprocessing`` spawn): replica ``index`` on its own device(s);
    ``kv_sharers``: replicas whose KV pools come out of the same memory (on one CPU, all)."""
    ignore_stop_signals()  # the front end drains, then sends Stop; without it, the pipe's end stops us
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices  # before torch first touches CUDA
    logging.basicConfig(level=logging.INFO, format=f"[replica {index}] %(name)s: %(message)s")
    trio.run(Replica(config, conn, kv_sharers).serve)


class Replica:
    def __init__(self, config: EngineConfig, conn: Connection, kv_sharers: int = 1) -> None:
        self.config = config
        self.kv_sharers = kv_sharers
        self.conn = conn  # read by the command task's thread
        self.writer = PipeWriter(conn, "trillm-replica-writer")  # never blocks the loop
        self.engine: Engine | None = None
        self._outbox: list[tuple[str, RequestOutput]] = []
        self._done: list[str] = []
        self._ready = trio.Event()  # something to send
        self._engine_ids: dict[str, str] = {}  # front end id -> engine id, while open
        self._compiling: set[str] = set()  # ids whose call waits for its grammars
        self._aborted_early: set[str] = set()  # of those, aborted meanwhile

    async def serve(self) -> None:
        self.engine = engine = await trio.to_thread.run_sync(Engine.load, self.config, self.kv_sharers)
        log.info("serving as process %d", os.getpid())
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            self.writer.send(
                Ready(
                    engine.max_model_len, engine.model.projection_bytes, engine.footprint_bytes, engine.model.classifier
                )
            )
            nursery.start_soon(self._sender)
            nursery.start_soon(self._stats)
            await self._commands(nursery)
            nursery.cancel_scope.cancel()
        self.writer.close()

    async def _commands(self, nursery: trio.Nursery) -> None:
        """Until ``Stop`` or the pipe's end: each command handled in order."""
        while True:
            try:
                message = await trio.to_thread.run_sync(self.conn.recv, abandon_on_cancel=True)
            except (EOFError, OSError):
                log.warning("the front end has gone: this replica stops")
                return
            if isinstance(message, Stop):
                return
            if isinstance(message, Submit):
                nursery.start_soon(self._serve_call, message)
            elif isinstance(message, Abort):
                engine_id = self._engine_ids.get(message.request_id)
                if engine_id is not None and self.engine is not None:
                    self.engine.abort(engine_id)
                elif message.request_id in self._compiling:
                    self._aborted_early.add(message.request_id)
            elif isinstance(message, Flush) and self.engine is not None:
                self.engine.flush_cache()

    async def _serve_call(self, call: Submit) -> None:
        """One ``submit_many``: grammars compiled here, outputs forwarded until every request ends."""
        assert self.engine is not None
        self._compiling.update(call.ids)
        try:
            requests = []
            for prompt_ids, params, spec in call.requests:
                if spec is not None:
                    params = attrs.evolve(params, grammar=await self.engine.compile_grammar(spec))
                requests.append((prompt_ids, params))
            engine_ids, mailbox = self.engine.submit_many(requests)
        except Exception as exc:  # the engine refused what the front end let through
            self._aborted_early.difference_update(call.ids)
            self.writer.send(Refused(call.ids[0], f"{type(exc).__name__}: {exc}"))
            return
        finally:
            self._compiling.difference_update(call.ids)
        self._engine_ids.update(zip(call.ids, engine_ids))
        for front_id, engine_id in zip(call.ids, engine_ids):
            if front_id in self._aborted_early:
                self._aborted_early.discard(front_id)
                self.engine.abort(engine_id)
        try:
            with mailbox:
                await self._forward(call, mailbox)
        finally:
            for front_id, engine_id in zip(call.ids, engine_ids):
                self._engine_ids.pop(front_id, None)
                self.engine.abort(engine_id)
        self._done.append(call.ids[0])
        self._ready.set()

    async def _forward(self, call: Submit, mailbox: OutputMailbox) -> None:
        async for out in mailbox:
            self._outbox.append((call.ids[out.index], out))
            self._ready.set()

    async def _sender(self) -> None:
        """Whatever outputs have gathered, as one message (a pipe write is short: on the loop)."""
        while True:
            await self._ready.wait()
            self._ready = trio.Event()
            outputs, self._outbox = self._outbox, []
            done, self._done = self._done, []
            self.writer.send(Outputs(tuple(outputs), tuple(done)))
            await trio.sleep(0)  # let more gather while the engine steps

    async def _stats(self) -> None:
        last: Any = None
        while True:
            assert self.engine is not None
            stats = self.engine.stats()
            if stats != last:
                self.writer.send(Stats(stats))
                last = stats
            await trio.sleep(STATS_PERIOD)
