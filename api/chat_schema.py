"""The body of ``POST /v1/chat/completions``: messages (or a raw prompt) plus the shared fields."""

from __future__ import annotations

from typing import Any

import attrs

from trillm.api.fields import CommonFields, Field, bad, boolean_field, integer_field, parse_common

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


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
MESSAGES = Field(
    "messages",
    {"type": ["array", "null"], "minItems": 1, "description": "the conversation; give messages or prompt",
     "items": {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"enum": sorted(ROLES)},
                              "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}}},
    lambda body: None if body.get("messages") is None else parse_messages(body["messages"]),
)


def _prompt(body: dict[str, Any]) -> str | None:
    if body.get("prompt") is not None and not isinstance(body["prompt"], str):
        raise bad("prompt", "must be a string")
    return body.get("prompt")


PROMPT = Field("prompt", {"type": ["string", "null"], "description": "raw text without the chat template"}, _prompt)
LOGPROBS = boolean_field("logprobs", False, "return log-probabilities of the generated tokens")
TOP_LOGPROBS = integer_field("top_logprobs", 0, 0, MAX_TOP_LOGPROBS, "alternatives per token; needs logprobs")
CHAT_FIELDS: tuple[Field, ...] = (MESSAGES, PROMPT, LOGPROBS, TOP_LOGPROBS)


def parse_chat_request(body: Any) -> ChatRequest:
    common = parse_common(body)
    messages, prompt = MESSAGES.parse(body), PROMPT.parse(body)
    if (messages is None) == (prompt is None):
        raise bad("messages", "give exactly one of 'messages' or 'prompt'")
    logprobs, top = LOGPROBS.parse(body), TOP_LOGPROBS.parse(body)
    if body.get("top_logprobs") is not None and not logprobs:
        raise bad("top_logprobs", "needs 'logprobs': true")
    if logprobs:
        common = attrs.evolve(common, params=attrs.evolve(common.params, logprobs=top))
    return ChatRequest(common, messages, prompt)
