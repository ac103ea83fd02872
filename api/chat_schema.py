"""The body of ``POST /v1/chat/completions``: messages (or a raw prompt) plus the shared fields."""

from __future__ import annotations

from typing import Any

import attrs

from api.fields import CommonFields, bad, boolean, integer, parse_common

ROLES = {"system", "user", "assistant", "developer"}
MAX_TOP_LOGPROBS = 20


@attrs.frozen
class ChatRequest:
    common: CommonFields
    messages: tuple[dict[str, str], ...] | None
    prompt: str | None


def _content(index: int, content: Any) -> str:
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(param, f"only text parts are supported, got a part of type {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(param, "must be a string or a list of text parts")


def parse_messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list):
        raise bad("messages", "must be a list of message objects")
    if not value:
        raise bad("messages", "must contain at least one message")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", "must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {sorted(ROLES)}, got {role!r}")
        if "content" not in message or message["content"] is None:
            raise bad(f"messages[{i}].content", "is required")
        out.append({"role": "system" if role == "developer" else role, "content": _content(i, message["content"])})
    return tuple(out)


def parse_chat_request(body: Any) -> ChatRequest:
    common = parse_common(body)
    messages = prompt = None
    if body.get("messages") is not None:
        messages = parse_messages(body["messages"])
    if body.get("prompt") is not None:
        if not isinstance(body["prompt"], str):
            raise bad("prompt", "must be a string")
        prompt = body["prompt"]
    if (messages is None) == (prompt is None):
        raise bad("messages", "give exactly one of 'messages' or 'prompt'")
    logprobs = boolean(body, "logprobs", False)
    top = integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if body.get("top_logprobs") is not None and not logprobs:
        raise bad("top_logprobs", "needs 'logprobs': true")
    if logprobs:
        common = attrs.evolve(common, params=attrs.evolve(common.params, logprobs=top))
    return ChatRequest(common, messages, prompt)
