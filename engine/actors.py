"""The engine's two actors, and what the scheduler actor does with each step's result.

The scheduler actor takes new requests and aborts from the inbox, drives the step loop
(``scheduling.step_loop``) and routes every returned step (``scheduling.output_router``);
the runner actor runs each step's forward and sampling in the worker thread, strictly in
order. Every way a request ends goes through ``scheduling.endings.Endings.end``. ``Engine``
(``engine.py``) builds this and sends to the inbox; nothing here is called by handlers.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import attrs
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.execution import native_memory
from trillm.engine.execution.launch import Ranks
from trillm.engine.execution.model_runner import ModelRunner
from trillm.engine.execution.parallel.topology import WorkerDied
from trillm.engine.outputs import TokenLogprobs
from trillm.engine.runner_thread import RunnerThread, single_threaded
from trillm.engine.scheduling.end_kinds import End
from trillm.engine.scheduling.endings import Endings
from trillm.engine.scheduling.output_router import LiveRequest, OutputRouter
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.engine.scheduling.step_loop import StepLoop
from trillm.engine.step import Batch, Sampled, Step, StepInputs, StepResult

log = logging.getLogger("trillm.engine")
# Under load, the runner thread hands malloc's kept free memory back at most this often
# (``native_memory.trim``: a few ms each time); an engine that goes idle does it at once.
TRIM_INTERVAL = 5.0


@attrs.frozen
class Arrival:
    """A submitted request, for the scheduler actor to queue (unless it ended meanwhile)."""

    live: LiveRequest


@attrs.frozen
class Cancel:
    """``Engine.abort``: end the request and free its pages."""

    request_id: str


Message = Arrival | Cancel


def _runs(updated: list[tuple[Sequence, int]]) -> list[tuple[Sequence, list[int]]]:
    """A step's settled tokens, each sequence's together (a verification settles several)."""
    runs: list[tuple[Sequence, list[int]]] = []
    for seq, index in updated:
        if runs and runs[-1][0] is seq:
            runs[-1][1].append(index)
        else:
            runs.append((seq, [index]))
    return runs


class Actors:
    """The scheduler and runner actors of one engine, and the counters only they move."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        scheduler: Scheduler,
        router: OutputRouter,
        endings: Endings,
        inbox: trio.MemoryReceiveChannel[Message],
        thread: RunnerThread,
    ) -> None:
        self.config = config
        self.runner = runner
        self.scheduler = scheduler
        self.router = router
        self.loop: StepLoop[StepInputs] = StepLoop(
            scheduler, runner.prepare, 2 if config.overlap_schedule else 1, self._on_scheduled
        )
        self.endings = endings
        self.inbox = inbox
        self.thread = thread  # the one worker thread: steps, heartbeats, trims and the runner's close
        self.running = False
        self.group_broken = False  # a tensor-parallel rank died or hung: no collective can run again
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self._malloc_tuning = config.malloc_tuning
        self._last_trim = time.monotonic()
        self._steps_at_trim = 0  # ``num_steps`` at the last trim: an idle engine trims once

    async def run(self, workers: Ranks | None, task_status: trio.TaskStatus[None]) -> None:
        """Serve until cancelled; on the way out every open request ends ("abort"), every page
        is freed and the other tensor-parallel ranks (``workers``) stop with us, then the
        runner's thread (``runner_thread``) if no other engine holds it."""
        with self.thread.hold(), single_threaded():  # OpenMP teams on the runner's thread only
            await self._serve(workers, task_status)

    async def _serve(self, workers: Ranks | None, task_status: trio.TaskStatus[None]) -> None:
        # One batch may wait while another runs, and one result while the next
        # batch runs: the worker goes from step to step without waiting for us.
        batch_tx, batch_rx = trio.open_memory_channel[tuple[Step[StepInputs], trio.Event]](1)
        result_tx, result_rx = trio.open_memory_channel[Sampled | Exception](1)
        try:
            async with trio.open_nursery() as nursery:
                if workers is not None:
                    nursery.start_soon(self._watch_workers, workers)
                nursery.start_soon(self._runner_actor, batch_rx, result_tx)
                self.running = True
                task_status.started()
                await self._scheduler_actor(batch_tx, result_rx)
        finally:
            self.running = False
            self._end_all()
            self.loop.in_flight.clear()
            self.scheduler.flush_cache()  # nothing outlives the engine: every page is free again
            if workers is not None:  # the other ranks stop with us (a broken group: at once)
                with trio.CancelScope(shield=True):  # we are most often here because we were cancelled
                    if not self.group_broken:
                        await self.thread.run(self.runner.close)
                    await trio.to_thread.run_sync(workers.join, 0.0 if self.group_broken else 10.0)

    async def _watch_workers(self, workers: Ranks) -> None:
        """Fail fast when a tensor-parallel rank dies: the group can compute nothing more, so the
        engine stops (every open request ends) rather than wait on a collective forever. This
        machine's ranks are watched as processes; every rank, here or on other nodes, through a
        heartbeat broadcast whenever no step has run for a quarter of ``dist_timeout``."""
        period = self.config.dist_timeout / 4
        last_steps, next_beat = self.num_steps, trio.current_time() + period
        while not (dead := workers.dead()):
            await trio.sleep(0.2)
            if self.num_steps != last_steps:
                last_steps, next_beat = self.num_steps, trio.current_time() + period
            elif trio.current_time() >= next_beat:
                try:
                    await self.thread.run(self.runner.heartbeat)
                except Exception as exc:
                    self.group_broken = True
                    log.critical("a tensor-parallel rank stopped answering: %s", exc)
                    raise WorkerDied(f"a tensor-parallel rank stopped answering: {exc}") from exc
                next_beat = trio.current_time() + period
        self.group_broken = True
        names = ", ".join(f"{name} (exit code {code})" for name, code in dead)
        log.critical("tensor-parallel worker %s exited; the engine stops", names)
        raise WorkerDied(f"tensor-parallel worker {names} exited")

    async def _runner_actor(
        self,
        batch_rx: trio.MemoryReceiveChannel[tuple[Step[StepInputs], trio.Event]],
        result_tx: trio.MemorySendChannel[Sampled | Exception],
    ) -> None:
        """Runs each step's forward and sampling in the worker thread, strictly in order;
        sets the step's event as the thread starts it."""
        token = trio.lowlevel.current_trio_token()
        async with batch_rx, result_tx:
            async for step, started in batch_rx:

                def execute(step: Step[StepInputs] = step, started: trio.Event = started) -> Sampled:
                    token.run_sync_soon(started.set)
                    result = self.runner.execute(step.inputs)
                    if self._malloc_tuning and time.monotonic() - self._last_trim >= TRIM_INTERVAL:
                        self._trim()
                    return result

                try:
                    result: Sampled | Exception = await self.thread.run(execute)
                except WorkerDied as exc:  # a tensor-parallel forward failed: the group is out of step
                    self.group_broken = True
                    log.critical("%s (a rank died or stopped answering); the engine stops", exc)
                    raise
                except Exception as exc:  # a failed step (sampling, a grammar) fails its batch, not the server
                    log.exception("model step failed")
                    result = exc
                # An idle engine holds no finished step (nor its sequences' grammar state).
                del step, started, execute
                await result_tx.send(result)

    async def _scheduler_actor(
        self,
        batch_tx: trio.MemorySendChannel[tuple[Step[StepInputs], trio.Event]],
        result_rx: trio.MemoryReceiveChannel[Sampled | Exception],
    ) -> None:
        """Drives ``self.loop``: with ``overlap_schedule`` the next step is scheduled and sent
        before the one in flight returns, so the worker never waits for routing and
        scheduling; without it, one step at a time."""
        loop = self.loop
        started: deque[trio.Event] = deque()  # one per step in flight: set when the worker takes it
        speculation = self.scheduler.speculation
        host = 0.0  # seconds of our own work since the last step returned (speculation's cost model)
        async with batch_tx, result_rx:
            while True:
                if not loop.has_work:
                    if self._malloc_tuning and self._steps_at_trim != self.num_steps:
                        # gone idle: what the steps freed goes back to the kernel
                        await self.thread.run(self._trim)
                    self._handle(await self.inbox.receive())
                self._drain_inbox()
                began = time.perf_counter()
                step = loop.schedule()
                host += time.perf_counter() - began
                if step is not None:
                    started.append(trio.Event())
                    await batch_tx.send((step, started[-1]))
                if loop.due(step is not None):
                    result = await result_rx.receive()
                    started.popleft()
                    if started:  # the worker goes first: routing waits, not the model
                        await started[0].wait()
                    began = time.perf_counter()
                    self._resolve(result)
                    self._drain_inbox()  # aborts that arrived during the step: freed now
                    host += time.perf_counter() - began
                    if speculation is not None:
                        speculation.observe_host(host)
                    host = 0.0
                elif step is None and self.scheduler.has_work:  # nothing fits yet; wait for news
                    self._handle(await self.inbox.receive())
                step = None  # an idle engine holds no finished step (nor its sequences' grammar state)

    def _trim(self) -> None:
        """``native_memory.trim``, in a worker thread (it takes milliseconds), never beside a step."""
        started = time.monotonic()
        native_memory.trim()
        self._last_trim, self._steps_at_trim = time.monotonic(), self.num_steps
        log.debug("malloc_trim took %.1f ms", (self._last_trim - started) * 1000)

    def _on_scheduled(self, batch: Batch) -> None:
        """The step loop's hook: a batch was scheduled (its requests' queue time ends)."""
        self.router.on_scheduled([chunk.seq for chunk in batch.chunks], time.monotonic())

    def _resolve(self, result: Sampled | Exception) -> None:
        """Route the oldest step's tokens; a failed step ends its requests with "error"."""
        self.num_steps += 1
        if isinstance(result, Exception):
            for chunk in self.loop.fail().chunks:
                self.endings.end(chunk.seq.request_id, End.ERROR)
            return
        batch, updated = self.loop.resolve(result.tokens, result.accepted)
        if isinstance(result, StepResult):
            self._observe(batch, result.seconds)
        sampling = [chunk for chunk in batch.chunks if chunk.samples] if isinstance(result, StepResult) else []
        for index, values in result.scores if isinstance(result, StepResult) else ():
            chunk = sampling[index]
            if chunk.generation == chunk.seq.num_preemptions:
                chunk.seq.token_scores = values
        for pooled in result.pooled if isinstance(result, StepResult) else ():
            chunk = batch.chunks[pooled.chunk]
            if chunk.generation == chunk.seq.num_preemptions:  # else a preemption started its pooling over
                chunk.seq.pool(pooled.rows, pooled.count)
        for prompt in result.prompt_logprobs if isinstance(result, StepResult) else ():
            # kept before routing: the first token goes out with its prompt's logprobs
            self.router.add_prompt_logprobs(batch.chunks[prompt.chunk].seq, prompt.start, prompt.entries)
        # each emitted token's logprobs, by (sequence, index in its outputs): a verification emits several
        logprobs: dict[tuple[int, int], TokenLogprobs | None] = {}
        for sample, chunk in enumerate(c for c in batch.chunks if c.samples):
            first = chunk.end - len(chunk.draft) - len(chunk.seq.prompt_ids)  # its first token's index
            for offset, entry in enumerate(result.emitted_logprobs(sample)):
                logprobs[(id(chunk.seq), first + offset)] = entry
        for seq, indices in _runs(updated):
            matcher = seq.matcher
            if matcher is not None and matcher.failed_at is not None and indices[-1] >= matcher.failed_at:
                # Its grammar allowed no token there: what came before goes out, then the choice ends.
                before = [i for i in indices if i < matcher.failed_at]
                if before and self._route(seq, before, logprobs):
                    continue
                self.endings.end(
                    seq.request_id,
                    End.ERROR,
                    f"the output reached a point where its grammar allows "
                    f"no token ({matcher.reason}, after {matcher.failed_at} tokens)",
                )
                continue
            self._route(seq, indices, logprobs)

    def _route(self, seq: Sequence, indices: list[int], logprobs: dict[tuple[int, int], TokenLogprobs | None]) -> bool:
        """One step's tokens of ``seq`` to its consumer, as one output; True if that ended it."""
        ended = self.router.route(seq, indices, [logprobs.get((id(seq), i)) for i in indices])
        if ended is not None:
            self.endings.end(seq.request_id, ended)
        return ended is not None

    def _observe(self, batch: Batch, seconds: float) -> None:
        """A decode step's time, for speculation's cost model (prefill steps say nothing of it)."""
        speculation = self.scheduler.speculation
        if speculation is not None and all(c.decode_rows for c in batch.chunks):
            speculation.observe_step(batch.num_tokens, seconds, len(batch.chunks))

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._handle(self.inbox.receive_nowait())
            except trio.WouldBlock:
                return

    def _handle(self, message: Message) -> None:
        if isinstance(message, Arrival):
            seq = message.live.seq
            if seq.request_id in self.router.live:
                self.scheduler.add(seq)
                self.prompt_tokens_total += len(seq.prompt_ids)
        else:
            self.endings.end(message.request_id, End.ABORTED)

    def _end_all(self) -> None:
        for request_id in list(self.router.live):
            self.endings.end(request_id, End.SHUTDOWN)
        while True:  # submits still queued were closed just now
            try:
                self.inbox.receive_nowait()
            except trio.WouldBlock:
                return
