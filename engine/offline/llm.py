"""``LLM``: the engine without HTTP, as vLLM's offline API looks (``from trillm import LLM``).

The same engine the server runs, driven the way the server drives it: each prompt is
a ``submit_many`` of its ``n`` choices, stop strings and logprobs are the engine's,
chat prompts come from the tokenizer's chat template as the chat endpoint makes them.
The engine lives in a Trio loop on a background thread (``loop.EngineLoop``) from the
constructor to ``close``, so its caches stay warm between calls; each call's prompts
run there together, continuously batched (``batch.Batch``).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import attrs
import torch
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine
from trillm.engine.errors import EngineNotRunning
from trillm.engine.execution.pooling import Pooling, pooling_for
from trillm.engine.offline.batch import SETTLE_SECONDS, Batch, Ended, Prompt
from trillm.engine.offline.loop import EngineLoop, unwrap
from trillm.engine.offline.params import SamplingParams
from trillm.engine.offline.progress import Progress
from trillm.engine.offline.results import RequestOutput
from trillm.engine.outputs import EngineStats
from trillm.engine.replicas.front import ReplicaSet
from trillm.engine.settings import settings_of

Conversation = Sequence[Mapping[str, Any]]
DEFAULT_MODEL: str = str(attrs.fields(EngineConfig).model.default)


def engine_config(**settings: Any) -> EngineConfig:
    """An ``EngineConfig`` from keywords: each setting by its field name (``kv_cache_bytes``) or as
    its flag spells it (``kv_cache_mb``, in the flag's unit). No environment is read."""
    spellings: dict[str, tuple[str, float]] = {}
    for s in settings_of(EngineConfig):
        spellings[s.name] = (s.name, 1)
        flag = s.flag.lstrip("-").replace("-", "_")
        if s.kind is not bool and flag != s.name:
            spellings[flag] = (s.name, s.scale)
    values: dict[str, Any] = {}
    for key, value in settings.items():
        if key not in spellings:
            raise TypeError(f"LLM() has no setting {key!r}; the settings are {', '.join(sorted(spellings))}")
        name, scale = spellings[key]
        if name in values:
            raise TypeError(f"LLM(): {key!r} sets {name!r} a second time")
        values[name] = value if scale == 1 or value is None else int(value * scale)
    return EngineConfig(**values)


def _prompt_list(prompts: str | Sequence[int] | Sequence[str | Sequence[int]]) -> list[str | list[int]]:
    """One prompt or many; a prompt is text or its token ids (a list of ints is one prompt)."""
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]
    found: list[str | list[int]] = []
    for item in items:
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, Sequence) and all(isinstance(t, int) for t in item):
            found.append([int(t) for t in item])
        else:
            raise TypeError(f"a prompt is a string or a list of token ids, not {type(item).__name__}")
    return found


def _params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    found = list(params)
    if len(found) != count:
        raise ValueError(f"{len(found)} sampling params for {count} prompts: give one, or one per prompt")
    return found


class LLM:
    """A model loaded into a running engine; ``generate`` and ``chat`` block until every prompt is done.

    ``LLM(model="smollm2-135m-instruct", dtype="float32", kv_cache_mb=256, tp=2, dp=2, ...)``: any
    engine setting as a keyword (``trillm serve --help`` lists them). Close it (or use ``with``) to
    stop the engine and every process it started; one call runs at a time.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **settings: Any) -> None:
        config = engine_config(model=model, **settings)
        if config.node_rank != 0:
            raise ValueError("node_rank: only node 0 runs requests (the other nodes run `trillm serve`)")
        self.config = config
        self._engine: Engine | ReplicaSet = ReplicaSet(config) if config.dp > 1 else Engine.load(config)
        self._loop = EngineLoop(self._engine)
        self._close = weakref.finalize(self, self._loop.stop)  # at interpreter exit too
        self._lock = threading.Lock()
        self._pooling: Pooling | None = None  # how ``embed`` pools, once asked

    # -- what it holds -------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self._engine.tokenizer

    def stats(self) -> EngineStats:
        """The engine's counters (free pages, open requests, ...), read between its steps."""
        return self._loop.call(self._engine.stats)

    @property
    def closed(self) -> bool:
        return not self._close.alive

    def close(self) -> None:
        """Stop the engine: open requests end, pages are freed, ranks and replicas exit. Idempotent."""
        self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- generating ----------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete each prompt (text, or token ids); one result per prompt, in their order."""
        self._check_open()
        items = _prompt_list(prompts)
        params = _params_list(sampling_params, len(items))
        tok = self.tokenizer
        batch = [
            Prompt(p, tok(p)["input_ids"], sp) if isinstance(p, str) else Prompt(None, p, sp)
            for p, sp in zip(items, params)
        ]
        return self._run(batch, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a list of them;
        the prompt is the chat template with the generation prompt added, as the chat endpoint's."""
        self._check_open()
        conversations: list[Any] = [messages] if not messages or isinstance(messages[0], Mapping) else list(messages)
        params = _params_list(sampling_params, len(conversations))
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a prompt")
        batch = []
        for conversation, sp in zip(conversations, params):
            text = tok.apply_chat_template(
                [dict(m) for m in conversation],
                add_generation_prompt=True,
                tokenize=False,
                **dict(chat_template_kwargs or {}),
            )
            batch.append(Prompt(text, tok(text, add_special_tokens=False)["input_ids"], sp))
        return self._run(batch, use_tqdm)

    def embed(
        self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]], *, use_tqdm: bool = True
    ) -> list[tuple[float, ...]]:
        """Each prompt's embedding, as ``/v1/embeddings`` gives it: the final-normed hidden states
        pooled as the model's files say (``--pooling``; else the mean), normalized where they say so
        (a model that names nothing: yes)."""
        if self._pooling is None:  # read from the model's files once
            self._pooling = pooling_for(self.config)
        pooling = self._pooling
        params = SamplingParams(max_tokens=1, temperature=0, pooling=pooling.mode, speculative=False)
        vectors = []
        for result in self.generate(prompts, params, use_tqdm=use_tqdm):
            if result.embedding is None:
                raise EngineNotRunning(
                    f"prompt {result.request_id} was not embedded ({result.outputs[0].finish_reason})"
                )
            vector = torch.tensor(result.embedding)
            if pooling.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            vectors.append(tuple(vector.tolist()))
        return vectors

    def _check_open(self) -> None:
        if self.closed:
            raise EngineNotRunning("this LLM has been closed")

    def _run(self, prompts: list[Prompt], use_tqdm: bool) -> list[RequestOutput]:
        if not prompts:
            return []
        batch = Batch(self._engine, prompts)
        results: list[RequestOutput | None] = [None] * len(prompts)
        with self._lock, Progress(len(prompts), use_tqdm) as progress:
            try:
                self._loop.spawn(batch.run)
                ended = self._wait(batch, results, progress)
            except BaseException:  # Ctrl-C (or any error) here: the engine drops the batch, frees its pages
                self._cancel(batch)
                raise
        if ended.error is not None:
            error = unwrap(ended.error)
            if isinstance(error, trio.Cancelled):  # the loop stopped under it
                raise EngineNotRunning("the engine stopped while this call ran") from self._loop.failure
            raise error
        return [r for r in results if r is not None]

    def _wait(self, batch: Batch, results: list[RequestOutput | None], progress: Progress) -> Ended:
        while True:
            try:
                item = batch.done.get(timeout=0.1)  # a timed wait: Ctrl-C interrupts it
            except queue.Empty:
                if not self._loop.running:
                    raise EngineNotRunning("the engine stopped while this call ran") from self._loop.failure
                continue
            if isinstance(item, Ended):
                return item
            index, out = item
            results[index] = out
            progress.finished(out)

    def _cancel(self, batch: Batch) -> None:
        """Cancel ``batch`` in the loop and wait until its requests are gone from the engine."""
        try:
            self._loop.call(batch.scope.cancel)
        except EngineNotRunning:
            return
        deadline = time.monotonic() + SETTLE_SECONDS + 5
        while time.monotonic() < deadline and self._loop.running:
            try:
                if isinstance(batch.done.get(timeout=0.1), Ended):
                    return
            except queue.Empty:
                continue
