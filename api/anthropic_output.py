"""The Messages API's output: the ``message`` object, its content blocks, its errors, and the stream.

``content_blocks`` writes a finished chat message as Anthropic's blocks (``thinking``,
``text``, ``tool_use``); ``MessageEvents`` turns a chat stream's deltas (chat's
``ChatChunks``) into Anthropic's event sequence as it goes: ``message_start``,
``ping``, each block's ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta`` (the stop reason, the usage) and ``message_stop``. Errors, in a
reply or in a stream, are ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Any

import attrs

from trillm.api.chat import ChatChunks
from trillm.api.errors import ApiError
from trillm.api.json_text import dumps
from trillm.api.responses import log
from trillm.api.submission import ChoiceProgress
from trillm.engine import RequestOutput

# Anthropic's error type for each status; a 503 (overloaded, draining, not serving) is its 529.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)  # and what is under it (count_tokens)


def is_anthropic_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


def error_status(error: ApiError) -> int:
    return 529 if error.status == 503 else error.status


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error shape for one of ours (whose message names the field at fault)."""
    status = error_status(error)
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def tool_use_id(call_id: str) -> str:
    """Chat's call id (``call_…``) in Anthropic's form (``toolu_…``)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, stop_string: str | None, stop_sequences: tuple[str, ...]) -> str | None:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "stop":
        return "stop_sequence" if stop_string is not None and stop_string in stop_sequences else "end_turn"
    return None


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the cache apart from the others."""
    return {
        "input_tokens": prompt_tokens - cached,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def message_object(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    reason: str | None,
    stop_sequence: str | None,
    totals: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence,
        "usage": totals,
    }


def thinking_block(text: str) -> dict[str, Any]:
    # No signature: nothing here is redacted or checked when a later turn sends the block back.
    return {"type": "thinking", "thinking": text, "signature": ""}


def content_blocks(message: dict[str, Any], tool_input: Any) -> list[dict[str, Any]]:
    """A finished chat message as blocks: thinking, text, then calls (an empty text block when there
    is nothing else, so a reply always has a block; a stream ends the same way)."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append(thinking_block(message["reasoning_content"]))
    if message.get("content") or not (blocks or message.get("tool_calls")):
        blocks.append({"type": "text", "text": message.get("content") or ""})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call["id"]),
                "name": function["name"],
                "input": tool_input(function["arguments"]),
            }
        )
    return blocks


def event(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Event named by its payload's ``type``, as Anthropic sends them."""
    return f"event: {payload['type']}\ndata: {dumps(payload, compact=True)}\n\n".encode()


PING = event({"type": "ping"})

# The block each kind of chat delta writes into, and the delta it sends.
_TEXT_KINDS = {"thinking": ("thinking", "thinking_delta"), "text": ("text", "text_delta")}


@attrs.define
class MessageEvents:
    """A ``StreamWriter`` (``api/streaming.py``) for one choice. ``message_start`` waits for the
    first output, which says how much of the prompt came from the cache."""

    chunks: ChatChunks
    model: str
    prompt_tokens: int
    stop_sequences: tuple[str, ...]
    message_id: str = attrs.field(factory=lambda: new_id("msg"))
    blocks: list[str] = attrs.field(factory=list)  # each block's kind, by index
    open: bool = False  # the last block is still open
    started: bool = False
    cached: int = 0
    finish: str | None = None
    stop_string: str | None = None

    def opening(self) -> Iterable[bytes]:
        return []

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        message = message_object(self.message_id, self.model, [], None, None, usage(self.prompt_tokens, self.cached, 0))
        return [event({"type": "message_start", "message": message}), PING]

    def pieces(self, out: RequestOutput) -> Iterable[bytes]:
        self.cached = out.num_cached_tokens
        if out.stop_string is not None:
            self.stop_string = out.stop_string
        events = self._start()
        for choice in self.chunks.pieces(out):
            events += self._choice(choice)
        return events

    def cut(self, unfinished: list[int]) -> Iterable[bytes]:
        return [*self._start(), *[e for index in unfinished for e in self._choice(self.chunks.cut(index))]]

    def end(self, progress: ChoiceProgress) -> Iterable[bytes]:
        events = self._start()
        reason = stop_reason(self.finish, self.stop_string, self.stop_sequences)
        if reason is None:  # aborted or failed in the engine: no stop reason to give
            return [*events, *self._close(), self._error(ApiError("the server stopped this request", 500))]
        if not self.blocks:
            events += self._open("text", {"type": "text", "text": ""})
        events += self._close()
        delta = {"stop_reason": reason, "stop_sequence": self.stop_string if reason == "stop_sequence" else None}
        totals = usage(self.prompt_tokens, progress.cached[0], progress.generated[0])
        events.append(event({"type": "message_delta", "delta": delta, "usage": totals}))
        events.append(event({"type": "message_stop"}))
        return events

    def refused(self, error: ApiError) -> Iterable[bytes]:
        return [self._error(error)]

    def failed(self, exc: Exception) -> Iterable[bytes]:
        log.exception("stream failed", exc_info=exc)
        return [self._error(ApiError(f"internal error: {type(exc).__name__}", 500))]

    @staticmethod
    def _error(error: ApiError) -> bytes:
        return event(error_body(error))

    def _choice(self, choice: dict[str, Any]) -> list[bytes]:
        delta, events = choice["delta"], []
        if delta.get("reasoning_content"):
            events += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        if choice["finish_reason"]:
            self.finish = choice["finish_reason"]
        return events

    def _text(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        field, delta_type = _TEXT_KINDS[kind]
        if not (self.open and self.blocks[-1] == kind):
            start = thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            events += self._close() + self._open(kind, start)
        delta = {"type": delta_type, field: text}
        events.append(event({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}))
        return events

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        function = call.get("function") or {}
        if call.get("id"):  # the first delta of a call: its id and name
            block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"], "input": {}}
            events += self._close() + self._open("tool_use", block)
        if function.get("arguments") and self.open and self.blocks[-1] == "tool_use":
            delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
            events.append(event({"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}))
        return events

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        self.blocks.append(kind)
        self.open = True
        return [event({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block})]

    def _close(self) -> list[bytes]:
        if not self.open:
            return []
        self.open = False
        return [event({"type": "content_block_stop", "index": len(self.blocks) - 1})]
