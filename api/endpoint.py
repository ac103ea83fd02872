"""What makes a generation endpoint: the one handler path in ``app.py`` calls these parts."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from trillm.api.gateway import EngineHandle
from trillm.api.streaming import ChunkRenderer


@attrs.frozen
class ServerContext:
    """What handlers need of the server's settings."""

    tool_call_parser: str = "auto"


@attrs.frozen
class GenerationEndpoint:
    """Chat and completions differ only in these; validation, limits, deadlines and streaming are shared."""

    parse: Callable[[Any], Any]  # the JSON body -> a request with ``.common``
    prompt_ids: Callable[[EngineHandle, Any], list[list[int]]]  # one token list per prompt
    prompt_param: Callable[[Any], str]  # the field named when a prompt is refused
    complete: Callable[[EngineHandle, str, Any, list[list[int]], float], Awaitable[dict[str, Any]]]
    renderer: Callable[[EngineHandle, Any, list[list[int]]], ChunkRenderer]
    # The request with what depends on the model and the server settings decided (chat: the tool format).
    bind: Callable[[EngineHandle, Any, ServerContext], Any] = lambda engine, req, ctx: req
