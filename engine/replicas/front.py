"""``--dp M``: the HTTP layer's engine, made of M replica processes.

``ReplicaSet`` offers what the API asks of an ``Engine`` (``api/gateway.py``), so the
handlers do not know there are replicas. It checks a call with the engine's own admission
(``engine.admission``: prompt, parameters, capacity; a grammar is compiled once here to
answer a bad one with a 400), routes
it (``router.PrefixRouter``), and gives the handler a local ``OutputMailbox`` that a
reader task fills from the replica's pipe. Cancellation goes the same way back: a
closed mailbox or ``abort`` sends ``Abort`` to the replica that holds the request,
which frees its pages there.

A replica whose process dies is taken out of rotation: its open requests end with
``finish_reason: "error"`` and the others keep serving; when none is left, ``run``
raises (``trillm serve`` then exits non-zero).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import attrs
import trio

from trillm.engine import admission
from trillm.engine.config import EngineConfig
from trillm.engine.execution.loading import load_tokenizer
from trillm.engine.mailbox import OutputMailbox
from trillm.engine.outputs import EngineStats, RequestOutput, SpeculationCounts
from trillm.engine.processes import children_allowed, join_or_kill
from trillm.engine.replicas.protocol import (
    Abort,
    Flush,
    Outputs,
    PipeWriter,
    Ready,
    Refused,
    Stats,
    Stop,
    Submit,
)
from trillm.engine.replicas.replica import replica_main
from trillm.engine.replicas.router import PrefixRouter
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.end_kinds import End
from trillm.engine.scheduling.telemetry import EngineObserver, NullObserver
from trillm.engine.structured import CompiledGrammar, GrammarCompiler, GrammarSpec

log = logging.getLogger("trillm.engine")
_ids = itertools.count()


class ReplicaDied(RuntimeError):
    """Every replica has died: nothing can serve."""


@attrs.frozen
class _Shape:
    vocab_size: int
    max_position_embeddings: int
    hidden_size: int  # of the embeddings ``/v1/embeddings`` returns


@attrs.frozen
class ModelInfo:
    """The little of the model the API reads (``/metrics``, token-id checks)."""

    shape: _Shape
    projection_bytes: int
    classifier: Any = None  # a sequence classifier's head, as the first replica sends it (rerank applies it)


@attrs.define
class _Open:
    """A request routed to a replica, until its last output."""

    replica: int
    mailbox: OutputMailbox
    index: int
    arrival: float
    priority: int
    last: float | None = None


class _Replica:
    def __init__(self, index: int, process: Any, conn: Connection) -> None:
        self.index = index
        self.process = process
        self.conn = conn  # read by the reader task's thread
        self.writer = PipeWriter(conn, f"trillm-replica-{index}-writer")  # never blocks the loop
        self.alive = False  # ready and not dead
        self.stats: EngineStats | None = None
        self.ready: Ready | None = None  # what it said when it had loaded its model
        self.open: set[str] = set()
        self.calls: dict[str, tuple[str, ...]] = {}  # first id -> the ids of one submit_many


class ReplicaSet:
    """M engines in M processes behind one interface (see the module's docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.dp < 2:
            raise ValueError("a replica set has at least two replicas (--dp)")
        self.config = config
        self.tokenizer, self.eos_ids, model_config = load_tokenizer(config)
        vocab = model_config["vocab_size"]
        self.grammars = GrammarCompiler(
            self.tokenizer,
            vocab,
            self.eos_ids,
            cache_size=config.grammar_cache_size,
            cache_bytes=config.grammar_cache_bytes,
            timeout=config.grammar_compile_timeout,
            workers=config.grammar_compile_workers,
        )
        shape = _Shape(vocab, model_config.get("max_position_embeddings", 2048), model_config.get("hidden_size", 0))
        self.model = ModelInfo(shape, 0)
        self.router = PrefixRouter(config.dp, config.page_size)
        self.replicas: list[_Replica] = []
        self._open: dict[str, _Open] = {}
        self._running = False
        self._observer: EngineObserver = NullObserver()
        self._all_lost = trio.Event()
        self.max_model_len = config.max_model_len or self.model.shape.max_position_embeddings

    # -- the interface handlers use (as ``Engine``'s) ----------------------------------

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def footprint_bytes(self) -> int:
        """Every live replica's weights and KV pool (``Engine.footprint_bytes``)."""
        return sum(r.ready.footprint_bytes for r in self.replicas if r.alive and r.ready is not None)

    def replica_stats(self) -> list[EngineStats | None]:
        """Each replica's last reported numbers (None: not yet, or dead)."""
        return [r.stats if r.alive else None for r in self.replicas]

    def stats(self) -> EngineStats:
        """The replicas' numbers added up; ``num_open_requests`` counts what this front end holds."""
        live = [s for s in self.replica_stats() if s is not None]
        fields = [f.name for f in attrs.fields(EngineStats) if f.name != "speculation"]
        total: dict[str, Any] = {name: sum(getattr(s, name) for s in live) for name in fields}
        total["num_open_requests"] = len(self._open)
        total["speculation"] = SpeculationCounts.added([c for s in live for c in s.speculation])
        return EngineStats(**total)

    def flush_cache(self) -> int:
        """Every live replica drops its cached pages; returns the pages they last reported evictable."""
        flushed = 0
        for r in self.replicas:
            if r.alive:
                flushed += r.stats.evictable_pages if r.stats else 0
                r.writer.send(Flush())
                self.router.forget(r.index)
        return flushed

    @property
    def vocab_size(self) -> int:
        return self.model.shape.vocab_size

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise ``RequestRejected`` for a prompt that can never run here."""
        admission.check_prompt(self, prompt_ids)

    def check_params(self, params: SamplingParams) -> None:
        """Raise ``RequestRejected`` for sampling parameters this model cannot honour."""
        admission.check_params(self, params)

    def check_capacity(self, count: int) -> None:
        """Raise ``EngineOverloaded`` if ``count`` more requests would overfill the replicas' queues."""
        admission.check_capacity(self, count)

    def num_queued(self) -> int:
        """Requests open here that no replica last reported running."""
        return len(self._open) - sum(s.num_running for s in self.replica_stats() if s is not None)

    def max_queued(self) -> int:
        """Each live replica's own ``max_waiting``."""
        return self.config.max_waiting * sum(r.alive for r in self.replicas)

    async def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compiled here to refuse a bad one at once; the replica compiles its own from the spec."""
        return await self.grammars.compile(spec)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, OutputMailbox]:
        ids, mailbox = self.submit_many([(prompt_ids, params)])
        return ids[0], mailbox

    def submit_many(self, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list[str], OutputMailbox]:
        """Checked here, sent whole to one replica (choices of one call share its prefix cache)."""
        admission.admit(self, requests)
        loads = [len(r.open) for r in self.replicas]
        alive = [r.alive for r in self.replicas]
        replica = self.replicas[self.router.choose(requests[0][0], loads, alive, requests[0][1].prompt_cache_key)]
        ids = tuple(f"dp{replica.index}-{next(_ids)}" for _ in requests)
        mailbox = OutputMailbox()
        now = time.monotonic()
        for index, (request_id, (_, params)) in enumerate(zip(ids, requests)):
            mailbox.add_sender()
            self._open[request_id] = _Open(replica.index, mailbox, index, now, params.priority)
            replica.open.add(request_id)
        replica.calls[ids[0]] = ids
        sent = tuple(
            (list(p), attrs.evolve(params, grammar=None), params.grammar.spec if params.grammar else None)
            for p, params in requests
        )
        replica.writer.send(Submit(ids, sent))
        return list(ids), mailbox

    def abort(self, request_id: str) -> None:
        """Forwarded to the replica that holds the request; idempotent, never blocks."""
        request = self._open.get(request_id)
        if request is not None and self.replicas[request.replica].alive:
            self.replicas[request.replica].writer.send(Abort(request_id))

    # -- the actors ----------------------------------------------------------------

    async def run(
        self, *, observer: EngineObserver | None = None, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the replicas, serve until cancelled (or until every replica has died), then stop
        them: open requests end with "abort", the processes exit."""
        if observer is not None:
            self._observer = observer
        self._start_processes()
        try:
            async with trio.open_nursery() as nursery:
                ready = [trio.Event() for _ in self.replicas]
                for replica, event in zip(self.replicas, ready):
                    nursery.start_soon(self._reader, replica, event)
                for event in ready:
                    await event.wait()
                if not any(r.alive for r in self.replicas):
                    raise ReplicaDied("no replica started")
                nursery.start_soon(self._fail_when_all_are_lost)
                said = [r.ready for r in self.replicas if r.alive and r.ready is not None]
                self.max_model_len = min(r.max_model_len for r in said)
                self.model = attrs.evolve(
                    self.model, projection_bytes=said[0].projection_bytes, classifier=said[0].classifier
                )
                self._running = True
                task_status.started()
        finally:
            self._running = False
            self.grammars.close()  # no compile process outlives the front
            for request_id in list(self._open):
                self._finish(request_id, End.SHUTDOWN)
            for replica in self.replicas:
                replica.writer.send(Stop())
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._join)

    async def _fail_when_all_are_lost(self) -> None:
        await self._all_lost.wait()
        raise ReplicaDied("every replica has died")

    def _start_processes(self) -> None:
        context = multiprocessing.get_context("spawn")
        # Each replica's ranks meet on a port of their own (0: a free one), not on one --master-port.
        # Replicas map the file and keep its pages: the page cache holds one copy for all of them.
        config = attrs.evolve(
            self.config, dp=1, num_threads=self.config.forward_threads, master_port=0, huge_pages=False
        )
        gpus = self.config.tp // self.config.nnodes
        visible = _visible_devices(config)
        for index in range(self.config.dp):
            front, back = context.Pipe()
            devices = ",".join(visible[index * gpus : (index + 1) * gpus]) if visible else None
            # Not a daemon: a replica with --tp starts processes of its own.
            process = context.Process(
                target=replica_main,
                args=(config, index, back, devices, 1 if devices else self.config.dp),
                name=f"trillm-replica-{index}",
            )
            with children_allowed():
                process.start()
            back.close()
            self.replicas.append(_Replica(index, process, front))

    def _join(self) -> None:
        """Every replica stops within one 30 s deadline (they stop together), or is killed."""
        for replica in self.replicas:
            replica.writer.close()
        join_or_kill([r.process for r in self.replicas], 30.0)
        for replica in self.replicas:
            replica.conn.close()

    async def _reader(self, replica: _Replica, ready: trio.Event) -> None:
        """Everything one replica says, until its pipe ends (it died, or it was stopped)."""
        ended = False  # the pipe ended: the process has gone (not this task cancelled)
        try:
            while True:
                try:
                    message = await trio.to_thread.run_sync(replica.conn.recv, abandon_on_cancel=True)
                except (EOFError, OSError):
                    ended = True
                    break
                if isinstance(message, Ready):
                    replica.alive = True
                    replica.ready = message
                    ready.set()
                elif isinstance(message, Outputs):
                    self._deliver(replica, message)
                elif isinstance(message, Stats):
                    replica.stats = message.stats
                elif isinstance(message, Refused):
                    log.warning("replica %d refused a request: %s", replica.index, message.reason)
                    for request_id in replica.calls.pop(message.first_id, ()):
                        self._finish(request_id, End.ERROR)
        finally:
            ready.set()
        if ended and replica.alive:  # died once ready (before all were ready, too)
            self._lost(replica)

    def _deliver(self, replica: _Replica, message: Outputs) -> None:
        now = time.monotonic()
        for request_id, out in message.outputs:
            request = self._open.get(request_id)
            if request is None:
                continue
            self._observe(request, out, now)
            if not request.mailbox.put(attrs.evolve(out, request_id=request_id, index=request.index)):
                replica.writer.send(Abort(request_id))  # its consumer has gone
        for first_id in message.done:
            for request_id in replica.calls.pop(first_id, ()):
                self._close(request_id)

    def _observe(self, request: _Open, out: RequestOutput, now: float) -> None:
        if request.last is None and out.token_ids:
            self._observer.first_token(now - request.arrival, request.priority)
        elif request.last is not None:
            self._observer.inter_token((now - request.last) / max(1, len(out.token_ids)))
        request.last = now
        if out.finish_reason is not None:
            self._observer.finished(out.finish_reason, now - request.arrival)

    def _close(self, request_id: str) -> None:
        request = self._open.pop(request_id, None)
        if request is not None:
            self.replicas[request.replica].open.discard(request_id)
            request.mailbox.end()

    def _finish(self, request_id: str, kind: End) -> None:
        """End a request here (``End.ERROR``: its replica refused it or died; ``End.SHUTDOWN``:
        this front stops), with a last output that says why, since its replica cannot. The
        replicas count their own ends; nothing is counted here."""
        request = self._open.get(request_id)
        if request is None:
            return
        request.mailbox.put(RequestOutput(request_id, request.index, "", (), kind.last_reason, 0, 0))
        self._close(request_id)

    def _lost(self, replica: _Replica) -> None:
        replica.alive = False
        code = replica.process.exitcode
        log.error(
            "replica %d died (exit code %s): out of rotation; its requests end with an error", replica.index, code
        )
        self.router.forget(replica.index)
        for request_id in list(replica.open):
            self._finish(request_id, End.ERROR)
        replica.calls.clear()
        if not any(r.alive for r in self.replicas):
            self._all_lost.set()  # ``run`` fails (here we may be in a handler's call)


def _visible_devices(config: EngineConfig) -> list[str]:
    """The GPUs replicas split among themselves (``CUDA_VISIBLE_DEVICES`` if set); none on CPUs."""
    import torch

    if config.device == "cpu" or not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]
