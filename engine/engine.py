"""The engine: a scheduler actor and a model-runner actor in one nursery.

Callers talk to it through three calls: ``submit`` (returns the request's
``OutputMailbox``, a receive channel that merges what a slow consumer has not
taken yet), ``abort`` (idempotent) and simply closing that mailbox. Both
``submit`` and ``abort`` are synchronous, so a handler can release its request
from a ``finally`` block even while it is being cancelled. The actors only move
messages: the loop itself is ``scheduling.step_loop``, the output path
``scheduling.output_router``.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import torch
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.errors import EngineNotRunning, EngineOverloaded, RequestRejected, check_logit_bias, check_prompt_ids
from trillm.engine.execution import native_memory
from trillm.engine.execution.launch import Ranks, launch
from trillm.engine.execution.llama import LlamaModel
from trillm.engine.execution.loading import load_model
from trillm.engine.execution.model_runner import ModelRunner, kv_bytes_per_token
from trillm.engine.execution.parallel.topology import WorkerDied
from trillm.engine.mailbox import OutputMailbox
from trillm.engine.outputs import EngineStats, RequestOutput
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.output_router import LiveRequest, OutputRouter
from trillm.engine.scheduling.policy import SchedulingPolicy
from trillm.engine.scheduling.prefix_cache import PrefixCache
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.engine.scheduling.step_loop import StepLoop
from trillm.engine.scheduling.telemetry import EngineObserver
from trillm.engine.step import Batch, Sampled, Step, StepInputs, StepResult
from trillm.engine.structured import CompiledGrammar, GrammarCompiler, GrammarSpec, Matcher

__all__ = [
    "Engine",
    "EngineNotRunning",
    "EngineOverloaded",
    "EngineStats",
    "OutputMailbox",
    "RequestOutput",
    "RequestRejected",
    "load_model",
]

log = logging.getLogger("trillm.engine")
_ids = itertools.count()
# Under load, the runner thread hands malloc's kept free memory back at most this often
# (``native_memory.trim``: a few ms each time); an engine that goes idle does it at once.
TRIM_INTERVAL = 5.0


@attrs.frozen
class _Submit:
    live: LiveRequest


@attrs.frozen
class _Abort:
    request_id: str


class Engine:
    """Continuous-batching engine around one model."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        tokenizer: Any,
        eos_ids: frozenset[int],
        ranks: Ranks | None = None,
    ) -> None:
        """``ranks``: the tensor-parallel ranks ``launch`` started for ``model``, which the
        engine watches and stops with it."""
        self.config = config
        self.model = model
        self.ranks = ranks
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        num_pages = config.num_pages or max(1, config.kv_cache_bytes // (kv_bytes_per_token(model) * config.page_size))
        self.allocator = PageAllocator(num_pages)
        cache = PrefixCache(self.allocator, config.page_size) if config.prefix_cache else None
        policy = SchedulingPolicy(config.scheduling_policy, config.priority_aging_seconds)
        self.scheduler = Scheduler(
            self.allocator, config.page_size, config.max_num_seqs, config.max_batch_tokens, cache, policy
        )
        self.max_model_len = min(
            config.max_model_len or model.shape.max_position_embeddings,
            model.shape.max_position_embeddings,
            num_pages * config.page_size,
        )
        graphs = model.device.type == "cuda" and model.backend.supports_cuda_graphs and not config.enforce_eager
        self.runner = ModelRunner(
            model,
            num_pages,
            config.page_size,
            config.forward_threads,
            graph_batch=config.max_num_seqs if graphs else 0,
            max_model_len=self.max_model_len,
        )
        self.router = OutputRouter(tokenizer, config.stall_timeout)
        self.grammars = GrammarCompiler(
            tokenizer,
            model.shape.vocab_size,
            eos_ids,
            cache_size=config.grammar_cache_size,
            cache_bytes=config.grammar_cache_bytes,
            timeout=config.grammar_compile_timeout,
            workers=config.grammar_compile_workers,
        )
        self.loop: StepLoop[StepInputs] = StepLoop(
            self.scheduler, self.runner.prepare, 2 if config.overlap_schedule else 1, self._on_scheduled
        )
        self._inbox_tx, self._inbox_rx = trio.open_memory_channel[_Submit | _Abort](math.inf)
        self._running = False
        self._limiter = trio.CapacityLimiter(1)
        self.num_aborted = 0
        self._group_broken = False  # a tensor-parallel rank died or hung: no collective can run again
        self.num_stalled = 0  # aborted because their consumer stopped taking outputs (``stall_timeout``)
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self._malloc_tuning = config.malloc_tuning
        if config.malloc_tuning:
            native_memory.pin_mmap_threshold()  # per-step tensors go back to the kernel when freed
        self._last_trim = time.monotonic()
        self._steps_at_trim = 0  # ``num_steps`` at the last trim: an idle engine trims once

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        """Resolve, download/convert if needed, and load the model (slow; call from a thread)."""
        launched = launch(config)
        return cls(config, launched.model, launched.tokenizer, launched.eos_ids, launched.ranks)

    # -- the interface handlers use ------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._running

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            free_pages=self.allocator.free_pages,
            evictable_pages=self.scheduler.evictable_pages,
            total_pages=self.allocator.num_pages,
            num_open_requests=len(self.router.live),
            num_aborted=self.num_aborted,
            num_stalled=self.num_stalled,
            num_merged_outputs=self.router.outputs_merged,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.router.generation_tokens_total,
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
            grammar_compiles=self.grammars.stats.compiled,
            grammar_compile_seconds=self.grammars.stats.compile_seconds_total,
            grammar_cache_hits=self.grammars.stats.cache_hits,
            grammar_compile_timeouts=self.grammars.stats.timed_out,
            grammar_compiler_busy=self.grammars.stats.busy,
            grammar_masked_steps=self.runner.mask_stats.steps,
            grammar_mask_seconds=self.runner.mask_stats.seconds,
        )

    def flush_cache(self) -> int:
        """Free every cached page no request holds; returns how many."""
        return self.scheduler.flush_cache()

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise ``RequestRejected`` for a prompt that can never run here."""
        check_prompt_ids(prompt_ids, self.max_model_len, self.model.shape.vocab_size)

    def check_params(self, params: SamplingParams) -> None:
        """Raise ``RequestRejected`` for sampling parameters this model cannot honour."""
        check_logit_bias(params.logit_bias, self.model.shape.vocab_size)

    def check_capacity(self, count: int) -> None:
        """Raise ``EngineOverloaded`` if ``count`` more requests would overfill the waiting queue."""
        queued = len(self.router.live) - len(self.scheduler.running)  # submitted, not yet running
        if queued + count > self.config.max_waiting:
            raise EngineOverloaded(f"{queued} requests are already waiting (the limit is {self.config.max_waiting})")

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, OutputMailbox]:
        """Queue a request; return its id and the mailbox its outputs arrive in.

        Never blocks. Raises ``RequestRejected`` for a request that can never
        run and ``EngineNotRunning`` when the engine is stopped. Closing the
        returned mailbox cancels the request.
        """
        ids, receive = self.submit_many([(prompt_ids, params)])
        return ids[0], receive

    def submit_many(self, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list[str], OutputMailbox]:
        """Queue several requests whose outputs share one mailbox (``RequestOutput.index``
        tells them apart): the choices of one API call. All or none are queued.

        The mailbox ends when every request has finished; closing it cancels all of them.
        """
        if not self._running:
            raise EngineNotRunning("the engine is not running")
        self.check_capacity(len(requests))
        for prompt_ids, params in requests:
            self.check_prompt(prompt_ids)
            self.check_params(params)
        # Every sequence is built before any is queued: one that fails to build queues none.
        seqs = [self._sequence(prompt_ids, params) for prompt_ids, params in requests]
        leaders: dict[tuple[int, ...], Sequence] = {}
        for seq in seqs:
            if seq.params.prompt_logprobs is None:  # else each choice computes (and scores) its prompt
                seq.leader = leaders.setdefault(tuple(seq.prompt_ids), seq)
                if seq.leader is seq:
                    seq.leader = None
        mailbox = OutputMailbox()
        for index, seq in enumerate(seqs):
            self._inbox_tx.send_nowait(_Submit(self.router.open(seq, mailbox, index)))
        return [seq.request_id for seq in seqs], mailbox

    def _sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        max_len = self.max_model_len
        if params.max_tokens is not None:
            max_len = min(max_len, len(prompt_ids) + params.max_tokens)
        seq = Sequence(
            f"req-{next(_ids)}", list(prompt_ids), params, max_len, self.eos_ids, arrival_time=time.monotonic()
        )
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        if params.grammar is not None:
            seq.matcher = Matcher(params.grammar)
        return seq

    async def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled for this tokenizer, for ``SamplingParams.grammar``; off the event
        loop, cached, time-limited. Raises ``GrammarError``."""
        return await self.grammars.compile(spec)

    def abort(self, request_id: str) -> None:
        """Ask the scheduler to drop a request and free its pages; idempotent, never blocks."""
        if self._running and request_id in self.router.live:
            self._inbox_tx.send_nowait(_Abort(request_id))

    @asynccontextmanager
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[OutputMailbox]:
        """Submit, yield the output mailbox, and release the request on exit.

        On cancellation (or any exit) the mailbox is closed and the request
        aborted synchronously, so its pages are freed within one step.
        """
        request_id, receive = self.submit(prompt_ids, params)
        try:
            with receive:
                yield receive
        finally:
            self.abort(request_id)

    # -- the actors ----------------------------------------------------------------

    async def run(
        self, *, observer: EngineObserver | None = None, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled, reporting request timings to ``observer`` (e.g. Prometheus).

        On cancellation: stops admitting, waits for the step in flight (the
        worker thread is never abandoned), ends every open request with
        finish_reason "abort", frees all pages, and returns.
        """
        if observer is not None:
            self.router.observer = observer
        # One batch may wait while another runs, and one result while the next
        # batch runs: the worker goes from step to step without waiting for us.
        batch_tx, batch_rx = trio.open_memory_channel[tuple[Step[StepInputs], trio.Event]](1)
        result_tx, result_rx = trio.open_memory_channel[Sampled | Exception](1)
        workers = self.ranks
        try:
            async with trio.open_nursery() as nursery:
                if workers is not None:
                    nursery.start_soon(self._watch_workers, workers)
                nursery.start_soon(self._runner_actor, batch_rx, result_tx)
                self._running = True
                task_status.started()
                await self._scheduler_actor(batch_tx, result_rx)
        finally:
            self._running = False
            self._end_all("abort")
            self.grammars.close()  # no compile process outlives the engine
            self.loop.in_flight.clear()
            self.scheduler.flush_cache()  # nothing outlives the engine: every page is free again
            if workers is not None:  # the other ranks stop with us (a broken group: at once)
                with trio.CancelScope(shield=True):  # we are most often here because we were cancelled
                    if not self._group_broken:
                        await trio.to_thread.run_sync(self.runner.close, limiter=self._limiter)
                    await trio.to_thread.run_sync(workers.join, 0.0 if self._group_broken else 10.0)

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
                    await trio.to_thread.run_sync(self.runner.heartbeat, limiter=self._limiter)
                except Exception as exc:
                    self._group_broken = True
                    log.critical("a tensor-parallel rank stopped answering: %s", exc)
                    raise WorkerDied(f"a tensor-parallel rank stopped answering: {exc}") from exc
                next_beat = trio.current_time() + period
        self._group_broken = True
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
                    result: Sampled | Exception = await trio.to_thread.run_sync(execute, limiter=self._limiter)
                except WorkerDied as exc:  # a tensor-parallel forward failed: the group is out of step
                    self._group_broken = True
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
        async with batch_tx, result_rx:
            while True:
                if not loop.has_work:
                    if self._malloc_tuning and self._steps_at_trim != self.num_steps:
                        # gone idle: what the steps freed goes back to the kernel
                        await trio.to_thread.run_sync(self._trim, limiter=self._limiter)
                    self._handle(await self._inbox_rx.receive())
                self._drain_inbox()
                step = loop.schedule()
                if step is not None:
                    started.append(trio.Event())
                    await batch_tx.send((step, started[-1]))
                if loop.due(step is not None):
                    result = await result_rx.receive()
                    started.popleft()
                    if started:  # the worker goes first: routing waits, not the model
                        await started[0].wait()
                    self._resolve(result)
                    self._drain_inbox()  # aborts that arrived during the step: freed now
                elif step is None and self.scheduler.has_work:  # nothing fits yet; wait for news
                    self._handle(await self._inbox_rx.receive())
                step = None  # an idle engine holds no finished step (nor its sequences' grammar state)

    def _trim(self) -> None:
        """``native_memory.trim``, in a worker thread (it takes milliseconds), never beside a step."""
        started = time.monotonic()
        native_memory.trim()
        self._last_trim, self._steps_at_trim = time.monotonic(), self.num_steps
        log.debug("malloc_trim took %.1f ms", (self._last_trim - started) * 1000)

    def _on_scheduled(self, batch: Batch) -> None:
        self.router.on_scheduled([chunk.seq for chunk in batch.chunks], time.monotonic())

    def _resolve(self, result: Sampled | Exception) -> None:
        """Route the oldest step's tokens; a failed step ends its requests with "error"."""
        self.num_steps += 1
        if isinstance(result, Exception):
            for chunk in self.loop.fail().chunks:
                self._finish(chunk.seq.request_id, "error")
            return
        batch, updated = self.loop.resolve(result.tokens)
        for prompt in result.prompt_logprobs if isinstance(result, StepResult) else ():
            # kept before routing: the first token goes out with its prompt's logprobs
            self.router.add_prompt_logprobs(batch.chunks[prompt.chunk].seq, prompt.start, prompt.entries)
        logprobs = {id(chunk.seq): lp for chunk, lp in zip((c for c in batch.chunks if c.samples), result.logprobs)}
        for seq, index in updated:
            matcher = seq.matcher
            if matcher is not None and matcher.failed_at is not None and index >= matcher.failed_at:
                # Its grammar allowed no token here: the row's sample is not sent, the choice ends.
                if self.router.close(
                    seq.request_id,
                    "error",
                    f"the output reached a point where its grammar allows "
                    f"no token ({matcher.reason}, after {matcher.failed_at} tokens)",
                ):
                    self.scheduler.abort(seq.request_id)
                continue
            routed = self.router.route(seq, index, logprobs.get(id(seq)))
            if routed == "gone":  # its consumer has left
                self.num_aborted += 1
                self._finish(seq.request_id, None)
            elif routed == "stalled":  # its consumer took nothing for ``stall_timeout``: end it, say so
                log.info(
                    "request %s aborted: its client read nothing for %ss", seq.request_id, self.config.stall_timeout
                )
                self.num_aborted += 1
                self.num_stalled += 1
                self._finish(seq.request_id, "abort")
            elif seq.is_finished:  # a stop string may have ended it: free its pages now (else a no-op)
                self.scheduler.abort(seq.request_id)

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._handle(self._inbox_rx.receive_nowait())
            except trio.WouldBlock:
                return

    def _handle(self, message: _Submit | _Abort) -> None:
        if isinstance(message, _Submit):
            seq = message.live.seq
            if seq.request_id in self.router.live:
                self.scheduler.add(seq)
                self.prompt_tokens_total += len(seq.prompt_ids)
        elif message.request_id in self.router.live:
            self.num_aborted += 1
            self._finish(message.request_id, None)

    def _finish(self, request_id: str, reason: str | None) -> None:
        """Drop a request now: free its pages and, if given a reason, tell its consumer."""
        self.router.close(request_id, reason)
        self.scheduler.abort(request_id)

    def _end_all(self, reason: str) -> None:
        for request_id in list(self.router.live):
            self._finish(request_id, reason)
        while True:  # submits still queued were closed just now
            try:
                self._inbox_rx.receive_nowait()
            except trio.WouldBlock:
                return
