"""One SSE path for every generation endpoint: submit, relay each output as events, end cleanly.

``relay`` owns channels, deadlines, failures and cancellation, once. What the
events look like is a ``StreamWriter``: chat and completions send chunks
(``ChunkWriter`` around an endpoint's ``ChunkRenderer``: the chunk's shape, the
opening chunks, the cut at the deadline); the Responses API sends typed events.

Cancellation: the stream is an async generator that Quart-Trio cancels
(``trio.Cancelled``) or closes (``GeneratorExit``) when the client goes away; its
``finally`` closes the output mailbox and aborts every choice with synchronous
calls only, so the scheduler frees the pages within one step.

Slow readers: the generator takes the next output only once Hypercorn has written
the previous events to the socket, so a client that reads slowly gets bigger
deltas (the engine's ``OutputMailbox`` merges what it has not taken) and one that
reads nothing is aborted by the engine after ``stall_timeout``. Silence (queued,
prefilling) longer than the ping interval sends an SSE comment, ``: ping``, which
clients ignore and proxies count as traffic.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

import attrs
import trio

from trillm.api.errors import ApiError, from_engine
from trillm.api.gateway import EngineHandle
from trillm.api.responses import new_completion_id, sse, stream_end, stream_failure, usage
from trillm.api.submission import ChoiceProgress, RequestTimedOut, abort_all, receive_until, submit_choices
from trillm.engine import RequestOutput, SamplingParams

PING = b": ping\n\n"  # an SSE comment: every client skips it, every proxy sees traffic


class StreamWriter(Protocol):
    """The events of one stream, each method returning encoded SSE events."""

    def opening(self) -> Iterable[bytes]: ...
    def pieces(self, out: RequestOutput) -> Iterable[bytes]: ...
    def cut(self, unfinished: list[int]) -> Iterable[bytes]:
        """The deadline passed: end these choices (they were cut short)."""

    def end(self, progress: ChoiceProgress) -> Iterable[bytes]: ...
    def refused(self, error: ApiError) -> Iterable[bytes]:
        """The engine refused the request at submit time (queue full since the up-front check, shutdown)."""

    def failed(self, exc: Exception) -> Iterable[bytes]:
        """A bug: end the stream with an error event, never a cut connection."""


async def relay(
    engine: EngineHandle,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    deadline: float,
    writer: StreamWriter,
    ping: float = math.inf,
) -> AsyncIterator[bytes]:
    """Submit every choice, then the writer's opening, its events for each output, [its cut
    at the deadline] and its end, with ``PING`` after ``ping`` seconds without an output. The
    engine's requests are aborted however the stream ends."""
    try:
        request_ids, outputs = submit_choices(engine, prompts, params, n)
    except Exception as exc:
        error = from_engine(exc)
        if error is None:
            raise
        for event in writer.refused(error):
            yield event
        return
    try:
        with outputs:
            for event in writer.opening():
                yield event
            progress = ChoiceProgress(len(prompts) * n)
            try:
                while True:
                    with trio.move_on_after(ping) as silence:  # covers one receive, never a yield
                        out = await receive_until(outputs, deadline)
                    if silence.cancelled_caught:
                        yield PING
                        continue
                    if out is None:
                        break
                    progress.record(out)
                    for event in writer.pieces(out):
                        yield event
            except RequestTimedOut:
                for event in writer.cut(progress.unfinished()):
                    yield event
            for event in writer.end(progress):
                yield event
    except Exception as exc:
        for event in writer.failed(exc):
            yield event
    finally:
        # Runs on normal end, on trio.Cancelled and on GeneratorExit alike; no awaits here.
        abort_all(engine, request_ids)


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


def stream_choices(
    engine: EngineHandle,
    model: str,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    include_usage: bool,
    deadline: float,
    renderer: ChunkRenderer,
    ping: float = math.inf,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    """SSE: the opening chunks, a chunk per piece of output, [usage], ``[DONE]``.
    ``continuous_usage`` (vLLM's ``continuous_usage_stats``): every chunk carries its choice's usage so far.

    At the deadline every unfinished choice gets the renderer's final chunk
    (``finish_reason: "length"``) and the stream ends normally. A refusal at
    submit time (the queue filled since the up-front check, shutdown) is an
    error event; a bug is an error event too, never a cut connection.
    """
    writer = ChunkWriter(renderer, model, prompts, n, include_usage, continuous_usage, predicted=len(params.prediction))
    return relay(engine, prompts, params, n, deadline, writer, ping)


@attrs.define
class ChunkWriter:
    """Chat and completions chunks: one choice each, the same ``id``, ``created`` and ``model``."""

    renderer: ChunkRenderer
    model: str
    prompts: list[list[int]]
    n: int
    include_usage: bool
    continuous_usage: bool = False
    # what each choice has generated (and found cached) so far, for ``continuous_usage``
    generated: dict[int, int] = attrs.field(factory=dict)
    cached: dict[int, int] = attrs.field(factory=dict)
    predicted: int = 0  # tokens of the request's predicted output (Predicted Outputs), 0: none
    accepted: dict[int, int] = attrs.field(factory=dict)  # of them, verified into each choice so far
    completion_id: str = attrs.field(
        default=attrs.Factory(lambda self: new_completion_id(self.renderer.id_prefix), takes_self=True)
    )
    created: int = attrs.field(factory=lambda: int(time.time()))

    def _event(self, choice: dict[str, Any]) -> bytes:
        body: dict[str, Any] = {
            "id": self.completion_id,
            "object": self.renderer.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            body["usage"] = self._so_far(choice["index"]) if self.continuous_usage else None
        return sse(body)

    def _so_far(self, index: int) -> dict[str, Any]:
        generated = self.generated.get(index, 0) if self.renderer.generates else 0
        prediction = (self.predicted, self.accepted.get(index, 0)) if self.predicted else None
        return usage(len(self.prompts[index // self.n]), generated, self.cached.get(index, 0), prediction)

    def opening(self) -> Iterable[bytes]:
        return [self._event(choice) for choice in self.renderer.opening()]

    def pieces(self, out: RequestOutput) -> Iterable[bytes]:
        self.generated[out.index] = out.num_output_tokens
        self.cached[out.index] = out.num_cached_tokens
        self.accepted[out.index] = out.accepted_prediction_tokens
        return [self._event(choice) for choice in self.renderer.pieces(out)]

    def cut(self, unfinished: list[int]) -> Iterable[bytes]:
        return [self._event(self.renderer.cut(index)) for index in unfinished]

    def end(self, progress: ChoiceProgress) -> Iterable[bytes]:
        totals = None
        if self.include_usage:
            generated = sum(progress.generated) if self.renderer.generates else 0
            choices = len(self.prompts) * self.n
            prediction = (self.predicted * choices, sum(self.accepted.values())) if self.predicted else None
            totals = usage(sum(len(p) for p in self.prompts), generated, sum(progress.cached[:: self.n]), prediction)
        return stream_end(self.renderer.object, self.completion_id, self.created, self.model, totals)

    def refused(self, error: ApiError) -> Iterable[bytes]:
        return [sse(error.body()), sse("[DONE]")]

    def failed(self, exc: Exception) -> Iterable[bytes]:
        return stream_failure(exc)
