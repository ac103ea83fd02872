"""Grammars compiled for this model's tokenizer by xgrammar, in worker processes, cached.

xgrammar (``docs/architecture.md`` says why it was chosen) turns a JSON schema,
regex or EBNF grammar into per-token masks for one tokenizer. Compiling takes
milliseconds to minutes and cannot be interrupted, so a request's constraint is
first measured against ``GrammarLimits`` (a 400 past one), then compiled in one of
a few worker processes (``worker``) under a time limit: one past it is killed, so
its core and its slot are free at once. A request that cannot get a worker within
the time limit (every one busy) is told to retry (``GrammarCompilerBusy``), since its
grammar is not at fault. A repeated constraint is found in an LRU cache keyed by its
canonical source, bounded in entries and in bytes, and costs nothing.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import attrs
import trio

from trillm.engine.structured.build import build
from trillm.engine.structured.limits import GrammarLimits
from trillm.engine.structured.spec import GrammarCompilerBusy, GrammarError, GrammarSpec
from trillm.engine.structured.worker import CompileWorker, WorkerGone

log = logging.getLogger("trillm.engine")


@attrs.frozen(eq=False)
class CompiledGrammar:
    """A grammar ready for matchers: xgrammar's compiled form and the tokens that end it."""

    spec: GrammarSpec
    compiled: Any  # xgrammar.CompiledGrammar
    stop_ids: tuple[int, ...]
    compile_seconds: float

    @property
    def nbytes(self) -> int:
        """What it holds in memory (xgrammar's count: the per-state token masks, mostly)."""
        return int(self.compiled.memory_size_bytes)


@attrs.define
class CompileStats:
    """What ``GrammarCompiler`` did so far (``/metrics`` and the benchmark report it)."""

    compiled: int = 0
    cache_hits: int = 0
    failed: int = 0
    timed_out: int = 0  # compiles killed at the time limit
    busy: int = 0  # requests that found no free worker within the time limit (503)
    compile_seconds_total: float = 0.0
    workers_started: int = 0


class GrammarCompiler:
    """Compiles ``GrammarSpec``s for one tokenizer; ``cached`` and ``compile_now`` are safe from
    any thread, ``compile`` runs on the event loop.

    At most ``workers`` compiles run at once, each in its own process; the processes start
    on first use and live until ``close`` (one killed at the time limit is replaced when next needed)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Iterable[int],
        *,
        cache_size: int = 256,
        cache_bytes: int = 256 * 1024 * 1024,
        timeout: float = 10.0,
        workers: int = 2,
        limits: GrammarLimits | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = tuple(sorted(stop_ids))
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.timeout = timeout
        self.limits = limits or GrammarLimits()
        self.stats = CompileStats()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()  # the cache, the idle workers and the lazily built xgrammar objects
        self._xgr: Any = None
        self._info: Any = None
        self._info_json: str | None = None
        self._idle: list[CompileWorker] = []
        self._busy: set[CompileWorker] = set()
        self._slots = trio.Semaphore(workers)
        self._generation = 0  # ``close`` moves it on: a worker of an older one is not kept

    # -- synchronous: any thread ---------------------------------------------------

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                self.stats.cache_hits += 1
            return grammar

    def compile_now(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or find) ``spec`` in the calling thread, with no time limit (offline use,
        tests, the benchmark); raises ``GrammarError``."""
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        self.limits.check(spec)
        compiler = self._compiler()
        started = time.perf_counter()
        try:
            compiled = build(compiler, spec)
        except GrammarError:
            with self._lock:
                self.stats.failed += 1
            raise
        return self._keep(spec, compiled, time.perf_counter() - started)

    def _keep(self, spec: GrammarSpec, compiled: Any, seconds: float) -> CompiledGrammar:
        """Count and cache a fresh compile; the oldest entries go while either bound is passed
        (one larger than the whole byte bound is used, not kept)."""
        grammar = CompiledGrammar(spec, compiled, self.stop_ids, seconds)
        size = grammar.nbytes
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_seconds_total += seconds
            if size > self.cache_bytes or spec in self._cache:
                return self._cache.get(spec, grammar)
            self._cache[spec] = grammar
            self._cached_bytes += size
            while len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.nbytes
        return grammar

    def _compiler(self) -> Any:
        """xgrammar's compiler for this tokenizer, built on first use (reading the
        vocabulary takes a second or two, which a server that never sees a grammar should not pay)."""
        with self._lock:
            if self._xgr is None:
                import xgrammar

                info = tokenizer_info(self._tokenizer, self.vocab_size, self.stop_ids)
                # Our own cache above (keyed by the canonical source) replaces xgrammar's.
                self._xgr = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._info = info
                self._info_json = info.serialize_json()
            return self._xgr

    def _take_worker(self) -> CompileWorker:
        """An idle worker, or a new one (blocking: a fork, or the fork server's first start)."""
        self._compiler()
        with self._lock:
            if self._idle:
                worker = self._idle.pop()
                self._busy.add(worker)
                return worker
            assert self._info_json is not None
            info_json, generation = self._info_json, self._generation
        worker = CompileWorker(info_json)
        worker.generation = generation
        with self._lock:
            self.stats.workers_started += 1
            self._busy.add(worker)
        return worker

    def _give_back(self, worker: CompileWorker, *, kill: bool) -> None:
        """Back to the idle workers, or killed (the next compile that needs one starts another)."""
        with self._lock:
            self._busy.discard(worker)
            if not kill and worker.generation == self._generation:
                self._idle.append(worker)
                return
        if kill:
            worker.kill()  # a thread may still wait on it: it closes the pipe as it sees the end
        else:
            worker.close()

    def _run(self, worker: CompileWorker, spec: GrammarSpec) -> tuple[Any, float]:
        """In a thread: the worker compiles, this process deserializes (a few ms)."""
        import xgrammar

        started = time.perf_counter()
        try:
            serialized = worker.compile(spec)
        except WorkerGone:
            worker.close()  # killed (at the limit, on cancellation) or crashed: its pipe is ours to close
            raise
        seconds = time.perf_counter() - started
        self._compiler()
        return xgrammar.CompiledGrammar.deserialize_json(serialized, self._info), seconds

    def close(self) -> None:
        """Kill every worker (idle or compiling; one starting now is killed when given back);
        the engine closes it as it stops. A later compile starts new workers."""
        with self._lock:
            self._generation += 1
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
        for worker in idle:
            worker.close()
        for worker in busy:
            worker.kill()  # the thread waiting on it closes its pipe

    @property
    def worker_pids(self) -> list[int]:
        """The live workers' process ids (tests check that a killed compile's process is gone)."""
        with self._lock:
            return [w.pid for w in self._idle + list(self._busy)]

    # -- on the event loop -----------------------------------------------------------

    async def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec`` in a worker process within ``timeout`` seconds.

        Raises ``GrammarError`` for an invalid, unsupported or empty grammar, one past a
        ``GrammarLimits`` bound, and one that compiles too long (its worker is killed);
        ``GrammarCompilerBusy`` when no worker came free within ``timeout`` seconds.
        If the caller is cancelled (its client left), the compile's worker is killed and
        it returns at once: nothing of it is left running."""
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        self.limits.check(spec)
        with trio.move_on_after(self.timeout) as waited:
            await self._slots.acquire()
        if waited.cancelled_caught:
            with self._lock:
                self.stats.busy += 1
            raise GrammarCompilerBusy(
                f"every grammar compile worker stayed busy for {self.timeout:g} s; retry shortly",
                math.ceil(self.timeout),
            )
        try:
            return await self._compile_in_worker(spec)
        finally:
            self._slots.release()

    async def _compile_in_worker(self, spec: GrammarSpec) -> CompiledGrammar:
        # Starting a worker (and reading the vocabulary) is not the request's fault: outside the limit.
        try:
            worker = await trio.to_thread.run_sync(self._take_worker)
        except WorkerGone as exc:
            raise GrammarCompilerBusy(f"no grammar compile worker could start ({exc}); retry shortly", 1) from None
        kill = True
        try:
            with trio.move_on_after(self.timeout):
                try:
                    compiled, seconds = await trio.to_thread.run_sync(self._run, worker, spec, abandon_on_cancel=True)
                except GrammarError:
                    kill = False
                    with self._lock:
                        self.stats.failed += 1
                    raise
                except WorkerGone as exc:
                    raise GrammarCompilerBusy(f"the grammar compile worker died ({exc}); retry shortly", 1) from None
                kill = False
                return self._keep(spec, compiled, seconds)
        finally:
            self._give_back(worker, kill=kill)  # killed at the limit, on cancellation, or if it died
        with self._lock:
            self.stats.timed_out += 1
        log.warning("a %s grammar did not compile within %g s; its worker was killed", spec.kind, self.timeout)
        raise GrammarError(f"the grammar did not compile within {self.timeout:g} s (the grammar compile time limit)")


@functools.lru_cache(maxsize=4)
def tokenizer_info(tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    """xgrammar's view of a tokenizer's vocabulary; shared by the engines of one tokenizer
    (the same loaded model served twice, as tests do)."""
    import xgrammar

    return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
