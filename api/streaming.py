"""One SSE path for chat and completions: submit, relay each output as chunks, end cleanly.

What differs between the endpoints (the chunk's shape, the opening chunks, the
cut at the deadline) is a ``ChunkRenderer``; everything about channels,
deadlines, usage, failures and cancellation is here, once.

Cancellation: the stream is an async generator that Quart-Trio cancels
(``trio.Cancelled``) or closes (``GeneratorExit``) when the client goes away; its
``finally`` closes the output channel and aborts every choice with synchronous
calls only, so the scheduler frees the pages within one step.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

from trillm.api.errors import from_engine
from trillm.api.gateway import EngineHandle
from trillm.api.responses import new_completion_id, sse, stream_end, stream_failure, usage
from trillm.api.submission import ChoiceProgress, RequestTimedOut, abort_all, receive_until, submit_choices
from trillm.engine.outputs import RequestOutput
from trillm.engine.sampling_params import SamplingParams


class ChunkRenderer(Protocol):
    """The endpoint-specific part of a stream: each method returns the ``choices`` entries to send."""

    @property
    def object(self) -> str:
        """``chat.completion.chunk`` or ``text_completion``."""

    @property
    def id_prefix(self) -> str:
        """``chatcmpl`` or ``cmpl``: the stream's id starts with it."""

    @property
    def generates(self) -> bool:
        """False when the sampled tokens are dropped (completions' ``max_tokens`` 0): usage counts none."""

    def opening(self) -> Iterable[dict[str, Any]]: ...
    def pieces(self, out: RequestOutput) -> Iterable[dict[str, Any]]: ...
    def cut(self, index: int) -> dict[str, Any]: ...


async def stream_choices(
    engine: EngineHandle,
    model: str,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    include_usage: bool,
    deadline: float,
    renderer: ChunkRenderer,
) -> AsyncIterator[bytes]:
    """SSE: the opening chunks, a chunk per piece of output, [usage], ``[DONE]``.

    At the deadline every unfinished choice gets the renderer's final chunk
    (``finish_reason: "length"``) and the stream ends normally. A refusal at
    submit time (the queue filled since the up-front check, shutdown) is an
    error event; a bug is an error event too, never a cut connection.
    """
    completion_id, created = new_completion_id(renderer.id_prefix), int(time.time())

    def event(choice: dict[str, Any]) -> bytes:
        body: dict[str, Any] = {
            "id": completion_id,
            "object": renderer.object,
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        return sse(body)

    try:
        request_ids, outputs = submit_choices(engine, prompts, params, n)
    except Exception as exc:
        error = from_engine(exc)
        if error is None:
            raise
        yield sse(error.body())
        yield sse("[DONE]")
        return
    try:
        with outputs:
            for choice in renderer.opening():
                yield event(choice)
            progress = ChoiceProgress(len(prompts) * n)
            try:
                while (out := await receive_until(outputs, deadline)) is not None:
                    progress.record(out)
                    for choice in renderer.pieces(out):
                        yield event(choice)
            except RequestTimedOut:
                for index in progress.unfinished():
                    yield event(renderer.cut(index))
            totals = None
            if include_usage:
                generated = sum(progress.generated) if renderer.generates else 0
                totals = usage(sum(len(p) for p in prompts), generated, sum(progress.cached[::n]))
            for end in stream_end(renderer.object, completion_id, created, model, totals):
                yield end
    except Exception as exc:
        for failure in stream_failure(exc):
            yield failure
    finally:
        # Runs on normal end, on trio.Cancelled and on GeneratorExit alike; no awaits here.
        abort_all(engine, request_ids)
