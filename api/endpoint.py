"""What makes a generation endpoint: the one handler path in ``generation_routes.py`` calls these parts."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
from pydantic import BaseModel

from trillm.api.gateway import EngineHandle
from trillm.api.streaming import ChunkRenderer, stream_choices


@attrs.frozen
class ServerContext:
    """What handlers need of the server's settings."""

    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None


@attrs.frozen
class GenerationEndpoint:
    """Chat, completions and responses differ only in these; validation, limits, deadlines and
    streaming are shared."""

    parse: Callable[[Any], Any]  # the JSON body -> a request with ``.common``
    prompt_ids: Callable[[EngineHandle, Any], list[list[int]]]  # one token list per prompt
    prompt_param: Callable[[Any], str]  # the field named when a prompt is refused
    complete: Callable[[EngineHandle, str, Any, list[list[int]], float], Awaitable[dict[str, Any]]]
    # Chunk-style streams (chat, completions) give a renderer; others (responses) their own stream.
    renderer: Callable[[EngineHandle, Any, list[list[int]]], ChunkRenderer] | None = None
    # (engine, model, req, prompts, deadline, ping interval) -> the SSE stream
    stream: Callable[[EngineHandle, str, Any, list[list[int]], float, float], AsyncIterator[bytes]] | None = None
    # The request with what depends on the model and the server settings decided (chat: the tool format).
    bind: Callable[[EngineHandle, Any, ServerContext], Any] = lambda engine, req, ctx: req
    schema: type[BaseModel] | None = None  # the body's declaration: names the field of a value refused in decoding

    def events(
        self,
        engine: EngineHandle,
        model: str,
        req: Any,
        prompts: list[list[int]],
        deadline: float,
        ping: float = math.inf,
    ) -> AsyncIterator[bytes]:
        """The SSE stream of a ``stream: true`` request; ``: ping`` after ``ping`` seconds without an event."""
        if self.stream is not None:
            return self.stream(engine, model, req, prompts, deadline, ping)
        assert self.renderer is not None, "an endpoint needs a renderer or a stream"
        common = req.common
        renderer = self.renderer(engine, req, prompts)
        return stream_choices(
            engine,
            model,
            prompts,
            common.params,
            common.n,
            common.include_usage,
            deadline,
            renderer,
            ping,
            continuous_usage=common.continuous_usage,
        )
