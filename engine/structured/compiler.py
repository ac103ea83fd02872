"""Grammars compiled for this model's tokenizer by xgrammar, off the event loop, cached.

xgrammar (``docs/architecture.md`` says why it was chosen) turns a JSON schema,
regex or EBNF grammar into per-token masks for one tokenizer. Compiling takes
milliseconds to seconds, so it runs in a worker thread under a time limit; a
repeated constraint is found in an LRU cache keyed by its canonical source and
costs nothing. A compile past the limit leaves its thread to finish (xgrammar
cannot be interrupted): at most ``threads`` compiles run at once, so a flood of
slow schemas queues instead of taking every core.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import attrs
import trio

from trillm.engine.structured.spec import GrammarError, GrammarSpec

log = logging.getLogger("trillm.engine")

# xgrammar's C++ errors start with "[12:00:00] /project/cpp/file.cc:123: "; clients need only the rest.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


@attrs.frozen(eq=False)
class CompiledGrammar:
    """A grammar ready for matchers: xgrammar's compiled form and the tokens that end it."""

    spec: GrammarSpec
    compiled: Any  # xgrammar.CompiledGrammar
    stop_ids: tuple[int, ...]
    compile_seconds: float


@attrs.define
class CompileStats:
    """What ``GrammarCompiler`` did so far (``/metrics`` and the benchmark report it)."""

    compiled: int = 0
    cache_hits: int = 0
    failed: int = 0
    timed_out: int = 0
    compile_seconds_total: float = 0.0


class GrammarCompiler:
    """Compiles ``GrammarSpec``s for one tokenizer; safe to call from any thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Iterable[int],
        *,
        cache_size: int = 256,
        timeout: float = 10.0,
        threads: int = 2,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = tuple(sorted(stop_ids))
        self.cache_size = cache_size
        self.timeout = timeout
        self.stats = CompileStats()
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the lazily built xgrammar compiler
        self._xgr: Any = None
        self._limiter = trio.CapacityLimiter(threads)

    # -- synchronous: any thread ---------------------------------------------------

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                self.stats.cache_hits += 1
            return grammar

    def compile_now(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or find) ``spec`` in the calling thread; raises ``GrammarError``."""
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        compiler = self._compiler()
        started = time.perf_counter()
        try:
            compiled = _compile(compiler, spec)
        except Exception as exc:  # xgrammar reports bad input as RuntimeError (C++), ValueError, ...
            with self._lock:
                self.stats.failed += 1
            raise GrammarError(_CPP_PREFIX.sub("", str(exc)).strip() or type(exc).__name__) from None
        seconds = time.perf_counter() - started
        grammar = CompiledGrammar(spec, compiled, self.stop_ids, seconds)
        with self._lock:
            self.stats.compiled += 1
            self.stats.compile_seconds_total += seconds
            self._cache[spec] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
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
            return self._xgr

    # -- on the event loop -----------------------------------------------------------

    async def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec`` in a worker thread within ``timeout`` seconds.

        Raises ``GrammarError`` for an invalid or unsupported grammar and for one that
        compiles too long. If the caller is cancelled (its client left), it returns at
        once; the thread finishes on its own and its result is cached."""
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        # Reading the vocabulary is not the request's fault: it is outside the time limit.
        await trio.to_thread.run_sync(self._compiler, abandon_on_cancel=True)
        with trio.move_on_after(self.timeout):
            return await trio.to_thread.run_sync(self.compile_now, spec, abandon_on_cancel=True, limiter=self._limiter)
        with self._lock:
            self.stats.timed_out += 1
        raise GrammarError(f"the grammar did not compile within {self.timeout:g} s (the grammar compile time limit)")


@functools.lru_cache(maxsize=4)
def tokenizer_info(tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    """xgrammar's view of a tokenizer's vocabulary; shared by the engines of one tokenizer
    (the same loaded model served twice, as tests do)."""
    import xgrammar

    return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    if spec.thinking == "none":
        return compiler.compile_grammar(_grammar(spec))
    return compiler.compile_grammar(_after_thinking(_grammar(spec), spec.thinking == "required"))


def _grammar(spec: GrammarSpec) -> Any:
    """xgrammar's ``Grammar`` of the constraint itself (compiled as is, or after thinking)."""
    import xgrammar

    if spec.kind == "json_object":
        return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "json_schema":
        # Compact JSON (single spaces after ',' and ':'): with any whitespace allowed, small
        # models can emit newlines until max_tokens. Strict: no properties beyond the schema's.
        return xgrammar.Grammar.from_json_schema(spec.source, any_whitespace=False, strict_mode=True)
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.source)
    if spec.kind == "choice":
        return xgrammar.Grammar.from_ebnf(choice_grammar(spec.options))
    if spec.kind == "ebnf":
        return xgrammar.Grammar.from_ebnf(spec.source)
    if spec.kind == "structural_tag":
        return xgrammar.Grammar.from_structural_tag(spec.source)
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


THINK_START, THINK_END = "<think>", "</think>"


def _after_thinking(answer: Any, required: bool) -> Any:
    """``answer`` preceded by free thinking up to ``</think>`` (``required``: always; the output
    may open with ``<think>`` or the template opened it) or by an optional ``<think>...</think>``
    block; a few blank characters are allowed around the block, as templates write them."""
    import xgrammar

    def thinking(begin: str) -> Any:
        tag = {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": THINK_END}
        return xgrammar.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": tag}))

    blank = xgrammar.Grammar.from_ebnf("root ::= [ \\t\\r\\n]{0,4}")
    if required:
        return xgrammar.Grammar.concat(thinking(""), blank, answer)
    return xgrammar.Grammar.union(answer, xgrammar.Grammar.concat(blank, thinking(THINK_START), blank, answer))


def choice_grammar(options: list[str]) -> str:
    """GBNF accepting exactly one of ``options`` (JSON string escapes are GBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(option, ensure_ascii=False) for option in options)
