"""``POST /v1/messages``: Anthropic's Messages API, served by the chat path.

The body becomes a chat request (``api/schemas/anthropic.py``); the prompt, tool
calls, grammars and the thinking split are chat's. This module writes what chat
produced in Anthropic's shape; the blocks, the errors and the stream's events are
``api/anthropic_output.py``'s. ``count_tokens`` templates the same prompt and
counts it without generating.
"""

from __future__ import annotations

from typing import Any

from trillm.api import chat
from trillm.api.anthropic_output import MessageEvents, content_blocks, message_object, new_id, stop_reason, usage
from trillm.api.endpoint import GenerationEndpoint
from trillm.api.gateway import EngineHandle
from trillm.api.input_limits import check_text
from trillm.api.schemas.anthropic import MessagesBody, MessagesRequest, parse_messages_request, tool_input
from trillm.api.streaming import relay
from trillm.api.submission import collect, submit_choices


def prompt_ids(engine: EngineHandle, req: MessagesRequest) -> list[list[int]]:
    """Chat's prompt, then a prefill (a last assistant turn's text) the reply continues."""
    [ids] = chat.prompt_ids(engine, req)
    if req.prefill:
        check_text(engine, [req.prefill], "messages")
        ids = ids + engine.tokenizer(req.prefill, add_special_tokens=False)["input_ids"]
    return [ids]


async def complete(
    engine: EngineHandle,
    model: str,
    req: MessagesRequest,
    prompts: list[list[int]],
    deadline: float,
    reasoning_parser: str | None = None,
) -> dict[str, Any]:
    """Run the reply to its end and return the ``message`` object (aborted, pages freed, if cancelled)."""
    request_ids, outputs = submit_choices(engine, prompts, req.common.params, 1)
    done = await collect(engine, request_ids, outputs, [""], deadline)
    last = done.last[0]
    message, finish = chat.finished_message(req, done.texts[0], last.finish_reason, reasoning_parser)
    reason = stop_reason(finish, last.stop_string, req.stop_sequences)
    return message_object(
        new_id("msg"),
        model,
        content_blocks(message, tool_input),
        reason,
        last.stop_string if reason == "stop_sequence" else None,
        usage(len(prompts[0]), last.num_cached_tokens, last.num_output_tokens),
    )


def endpoint(reasoning_parser: str | None = None) -> GenerationEndpoint:
    """The Messages endpoint; ``reasoning_parser`` (the server's setting) makes thinking ``thinking`` blocks."""

    def stream(
        engine: EngineHandle, model: str, req: Any, prompts: list[list[int]], deadline: float, ping: float
    ) -> Any:
        chunks = chat.chunks(engine, req, reasoning_parser)
        events = MessageEvents(chunks, model, len(prompts[0]), req.stop_sequences)
        return relay(engine, prompts, req.common.params, 1, deadline, events, ping)

    return GenerationEndpoint(
        parse=parse_messages_request,
        prompt_ids=prompt_ids,
        prompt_param=lambda req: "messages",
        complete=lambda engine, model, req, prompts, deadline: complete(
            engine, model, req, prompts, deadline, reasoning_parser
        ),
        stream=stream,
        bind=chat.bind,
        schema=MessagesBody,
    )
