"""The engine: its wiring, and the interface handlers use.

Callers talk to it through three calls: ``submit`` (returns the request's
``OutputMailbox``, a receive channel that merges what a slow consumer has not
taken yet), ``abort`` (idempotent) and simply closing that mailbox. Both
``submit`` and ``abort`` are synchronous, so a handler can release its request
from a ``finally`` block even while it is being cancelled. What a request must
pass to be queued is ``admission``; the two actors that serve it are ``actors``
(the loop itself is ``scheduling.step_loop``, the output path
``scheduling.output_router``, every way a request ends ``scheduling.endings``).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
import trio

from trillm.engine import admission
from trillm.engine.actors import Actors, Arrival, Cancel, Message
from trillm.engine.config import EngineConfig
from trillm.engine.errors import EngineNotRunning, EngineOverloaded, RequestRejected
from trillm.engine.execution import native_memory
from trillm.engine.execution.draft import DraftModel, load_draft_model
from trillm.engine.execution.gguf_support import available_memory
from trillm.engine.execution.launch import Ranks, launch
from trillm.engine.execution.loading import load_model
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_runner import ModelRunner, kv_bytes_per_token
from trillm.engine.kv_budget import plan_kv_pool
from trillm.engine.mailbox import OutputMailbox
from trillm.engine.outputs import EngineStats, RequestOutput, SpeculationCounts
from trillm.engine.runner_thread import RunnerThread
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.endings import Endings
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.output_router import OutputRouter
from trillm.engine.scheduling.policy import SchedulingPolicy
from trillm.engine.scheduling.prefix_cache import PrefixCache
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.engine.scheduling.speculation import SpeculationControl
from trillm.engine.scheduling.step_loop import StepLoop
from trillm.engine.scheduling.telemetry import EngineObserver
from trillm.engine.step import StepInputs
from trillm.engine.structured import CompiledGrammar, GrammarCompiler, GrammarSpec, Matcher
from trillm.engine.structured.thinking_budget import ThinkingBudget

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

_ids = itertools.count()
log = logging.getLogger("trillm.engine")


class Engine:
    """Continuous-batching engine around one model."""

    def __init__(
        self,
        config: EngineConfig,
        model: DecoderModel,
        tokenizer: Any,
        eos_ids: frozenset[int],
        ranks: Ranks | None = None,
        kv_sharers: int = 1,
        draft_model: DecoderModel | None = None,
    ) -> None:
        """``ranks``: the tensor-parallel ranks ``launch`` started for ``model``, which the
        engine watches and stops with it. ``draft_model``: ``--draft-model``, loaded (``load``)."""
        self.config = config
        self.model = model
        self.draft_model = draft_model  # kept for parking (``parking.py``)
        self.ranks = ranks
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        per_token = kv_bytes_per_token(model)
        context = min(config.max_model_len or model.shape.max_position_embeddings, model.shape.max_position_embeddings)
        free: int | None
        if model.device.type == "cuda":
            free, sharers = torch.cuda.mem_get_info(model.device)[0], kv_sharers
        else:  # tensor-parallel ranks on one CPU each hold a pool of these pages (of their heads)
            free, sharers = available_memory(), kv_sharers * model.tp.size
        plan = plan_kv_pool(config, per_token, context, free, sharers)
        num_pages = plan.num_pages
        self.allocator = PageAllocator(num_pages)
        cache = PrefixCache(self.allocator, config.page_size) if config.prefix_cache else None
        policy = SchedulingPolicy(config.scheduling_policy, config.priority_aging_seconds)
        self.scheduler = Scheduler(
            self.allocator,
            config.page_size,
            config.max_num_seqs,
            config.max_batch_tokens,
            cache,
            policy,
            window=model.shape.attention_span,
            speculation=SpeculationControl(
                config.speculative,
                config.num_speculative_tokens,
                overlap=config.overlap_schedule,
                draft_model=draft_model is not None,
            ),
        )
        self.kv_pool_bytes = plan.pool_bytes
        self.max_model_len = min(context, num_pages * config.page_size)
        log.info(
            "KV pool: %.0f MiB, %d tokens in %d pages (%s); context length %d (the model's %d)",
            plan.pool_bytes / 2**20,
            num_pages * config.page_size,
            num_pages,
            plan.reason,
            self.max_model_len,
            model.shape.max_position_embeddings,
        )
        if draft_model is not None and draft_model.shape.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"--draft-model reaches {draft_model.shape.max_position_embeddings} positions, fewer than the "
                f"context of {self.max_model_len}: lower --max-model-len to it, or draft with a longer model"
            )
        graphs = model.device.type == "cuda" and model.backend.supports_cuda_graphs and not config.enforce_eager
        # A mixture's routing has shapes that depend on the tokens (its pairs per expert): not capturable.
        graphs = graphs and not any(layer.moe is not None for layer in model.layers)
        self.runner = ModelRunner(
            model,
            num_pages,
            config.page_size,
            config.forward_threads,
            graph_batch=config.max_num_seqs if graphs else 0,
            max_model_len=self.max_model_len,
            draft=DraftModel(draft_model, num_pages, config.page_size) if draft_model is not None else None,
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
        self.endings = Endings(self.router, self.scheduler)
        self._inbox_tx, inbox_rx = trio.open_memory_channel[Message](math.inf)
        self._thread = RunnerThread.for_device(model.device)
        self.actors = Actors(config, self.runner, self.scheduler, self.router, self.endings, inbox_rx, self._thread)
        self.loop: StepLoop[StepInputs] = self.actors.loop
        if config.malloc_tuning:
            native_memory.pin_mmap_threshold()  # per-step tensors go back to the kernel when freed
            # What loading freed (a GGUF file's parsed metadata, a conversion's buffers) stays in malloc's
            # arenas until trimmed: Gemma 3's server held 117 MiB of it until its first request.
            native_memory.trim()

    @classmethod
    def load(cls, config: EngineConfig, kv_sharers: int = 1) -> Engine:
        """Resolve, download/convert if needed, and load the model (slow; call from a thread)."""
        draft = load_draft_model(config) if config.draft_model else None
        launched = launch(config)
        return cls(config, launched.model, launched.tokenizer, launched.eos_ids, launched.ranks, kv_sharers, draft)

    # -- the interface handlers use ------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self.actors.running

    @property
    def num_steps(self) -> int:
        """Steps that have returned since the engine started."""
        return self.actors.num_steps

    @property
    def vocab_size(self) -> int:
        return self.model.shape.vocab_size

    @property
    def footprint_bytes(self) -> int:
        """What this engine holds: its weights and KV pool, on every tensor-parallel rank
        (``--models-memory`` weighs loaded models by it)."""
        return (self.model.resident_bytes + self.kv_pool_bytes) * self.model.tp.size

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            free_pages=self.allocator.free_pages,
            evictable_pages=self.scheduler.evictable_pages,
            total_pages=self.allocator.num_pages,
            num_open_requests=len(self.router.live),
            num_aborted=self.endings.num_aborted,
            num_stalled=self.endings.num_stalled,
            num_merged_outputs=self.router.outputs_merged,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.actors.prompt_tokens_total,
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
            speculation=self._speculation_stats(),
        )

    def _speculation_stats(self) -> tuple[SpeculationCounts, ...]:
        control = self.scheduler.speculation
        if control is None:
            return ()
        return tuple(
            SpeculationCounts(method, s.drafts, s.draft_tokens, s.accepted_tokens, s.emitted_tokens)
            for method, s in sorted(control.stats.items())
        )

    def flush_cache(self) -> int:
        """Free every cached page no request holds; returns how many."""
        return self.scheduler.flush_cache()

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise ``RequestRejected`` for a prompt that can never run here."""
        admission.check_prompt(self, prompt_ids)

    def check_params(self, params: SamplingParams) -> None:
        """Raise ``RequestRejected`` for sampling parameters this model cannot honour."""
        admission.check_params(self, params)

    def check_capacity(self, count: int) -> None:
        """Raise ``EngineOverloaded`` if ``count`` more requests would overfill the waiting queue."""
        admission.check_capacity(self, count)

    def num_queued(self) -> int:
        """Requests submitted and not yet running (what ``max_waiting`` limits)."""
        return len(self.router.live) - len(self.scheduler.running)

    def max_queued(self) -> int:
        return self.config.max_waiting

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
        admission.admit(self, requests)
        # Every sequence is built before any is queued: one that fails to build queues none.
        seqs = [self._sequence(prompt_ids, params) for prompt_ids, params in requests]
        leaders: dict[tuple[int, ...], Sequence] = {}
        for seq in seqs:
            if seq.params.prompt_logprobs is None and seq.params.pooling is None:  # else each computes its prompt
                seq.leader = leaders.setdefault(tuple(seq.prompt_ids), seq)
                if seq.leader is seq:
                    seq.leader = None
        mailbox = OutputMailbox()
        for index, seq in enumerate(seqs):
            self._inbox_tx.send_nowait(Arrival(self.router.open(seq, mailbox, index)))
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
        if params.thinking_budget is not None:
            seq.thinking = ThinkingBudget(
                params.thinking_budget,
                params.thinking_start_ids,
                params.thinking_end_ids,
                params.thinking_after_ids,
                params.max_tokens,
            )
        return seq

    async def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled for this tokenizer, for ``SamplingParams.grammar``; off the event
        loop, cached, time-limited. Raises ``GrammarError``."""
        return await self.grammars.compile(spec)

    def abort(self, request_id: str) -> None:
        """Ask the scheduler to drop a request and free its pages; idempotent, never blocks."""
        if self.actors.running and request_id in self.router.live:
            self._inbox_tx.send_nowait(Cancel(request_id))

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

    # -- its life ------------------------------------------------------------------

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
        try:
            await self.actors.run(self.ranks, task_status)
        finally:
            self.grammars.close()  # no compile process outlives the engine
