"""``POST /v1/responses``: OpenAI's Responses API, stateless, served by the chat path.

The body becomes a chat request (``api/schemas/responses.py``); the prompt, tool
calls, structured output and reasoning split are chat's. This module writes what
chat produced in the Responses shape: a ``response`` object whose ``output`` holds
``reasoning``, ``message`` and ``function_call`` items. The stream's typed events
and the output items are ``api/responses_output.py``'s.
"""

from __future__ import annotations

import time
from typing import Any

from trillm.api import chat
from trillm.api.endpoint import GenerationEndpoint
from trillm.api.errors import ApiError
from trillm.api.gateway import EngineHandle
from trillm.api.responses_output import STATUS, ResponseEvents, new_id, output_items, response_object, usage
from trillm.api.schemas.responses import ResponsesBody, ResponsesRequest, parse_responses_request
from trillm.api.streaming import relay


async def complete(
    engine: EngineHandle,
    model: str,
    req: ResponsesRequest,
    prompts: list[list[int]],
    deadline: float,
    reasoning_parser: str | None = None,
) -> dict[str, Any]:
    """Run the chat completion and return it as a ``response`` object."""
    created_at = int(time.time())
    reply = await chat.complete(engine, model, req, prompts, deadline, reasoning_parser)
    choice = reply["choices"][0]
    status = STATUS.get(choice["finish_reason"], "completed")
    output = output_items(choice["message"], status)
    totals = reply["usage"]
    cached = totals["prompt_tokens_details"]["cached_tokens"]
    return response_object(
        req,
        new_id("resp"),
        created_at,
        model,
        status,
        output,
        usage(engine, totals["prompt_tokens"], totals["completion_tokens"], cached, output),
    )


def prompt_ids(engine: EngineHandle, req: ResponsesRequest) -> list[list[int]]:
    """Chat's prompt; a template that fails names ``input``, the field that holds the messages."""
    try:
        return chat.prompt_ids(engine, req)
    except ApiError as exc:
        if exc.param == "messages":
            exc.param = "input"
        raise


def endpoint(reasoning_parser: str | None = None) -> GenerationEndpoint:
    """The Responses endpoint; ``reasoning_parser`` (the server's setting) makes thinking a reasoning item."""

    def stream(
        engine: EngineHandle, model: str, req: Any, prompts: list[list[int]], deadline: float, ping: float
    ) -> Any:
        events = ResponseEvents(engine, chat.chunks(engine, req, reasoning_parser), req, model, len(prompts[0]))
        return relay(engine, prompts, req.common.params, 1, deadline, events, ping)

    return GenerationEndpoint(
        parse=parse_responses_request,
        prompt_ids=prompt_ids,
        prompt_param=lambda req: "input",
        complete=lambda engine, model, req, prompts, deadline: complete(
            engine, model, req, prompts, deadline, reasoning_parser
        ),
        stream=stream,
        bind=chat.bind,
        schema=ResponsesBody,
    )
