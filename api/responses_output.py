"""The Responses API's output: the ``response`` object, its items, and the typed stream events.

``output_items`` writes a finished chat message as items; ``ResponseEvents`` turns a
chat stream's deltas (chat's ``ChatChunks``: thinking, text, tool calls, finish) into
OpenAI's typed events as it goes, building the same items, so a streamed response
ends with the object a non-streamed one returns.
"""

from __future__ import annotations

import copy
import secrets
import time
from collections.abc import Iterable
from typing import Any

import attrs

from trillm.api.chat import ChatChunks
from trillm.api.errors import ApiError
from trillm.api.gateway import EngineHandle
from trillm.api.responses import log, typed_sse
from trillm.api.schemas.responses import ResponsesRequest
from trillm.api.submission import ChoiceProgress
from trillm.engine import RequestOutput

# The response status for chat's finish reasons; "length" is a response cut short.
STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [output_text(text)],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [reasoning_text(text)], "status": status}


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage(engine: EngineHandle, input_tokens: int, output_tokens: int, cached: int, output: list[Any]) -> Any:
    """The Responses usage object; ``reasoning_tokens`` is the thinking's text tokenized again."""
    thinking = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
    reasoning = len(engine.tokenizer(thinking, add_special_tokens=False)["input_ids"]) if thinking else 0
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning, output_tokens)},
        "total_tokens": input_tokens + output_tokens,
    }


def response_object(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``response`` object, in full, for any ``status`` (``in_progress`` while streaming)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "truncation": "disabled",
        "usage": usage,
        **req.echo,
    }


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A finished chat message as output items: thinking, text, then calls (an empty text
    message when there is nothing else, so a reply always has an item). The last one carries
    an ``incomplete`` status when the reply was cut short."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
    if message.get("content") or not message.get("tool_calls"):
        items.append(message_item(new_id("msg"), message.get("content") or "", "completed"))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append(function_call_item(new_id("fc"), call["id"], function["name"], function["arguments"], "completed"))
    if status == "incomplete":
        items[-1]["status"] = "incomplete"
    return items


# The delta / done events of the items that hold text.
_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_STOPPED = {"code": "server_error", "message": "the server stopped this request before it finished"}


@attrs.define
class ResponseEvents:
    """A ``StreamWriter`` (``api/streaming.py``): ``response.created``, ``response.in_progress``,
    each item's added / delta / done events in order, then ``response.completed`` (or
    ``.incomplete``, ``.failed``) with the whole response. Every event has ``type`` and
    ``sequence_number``; at most one item is open at a time."""

    engine: EngineHandle
    chunks: ChatChunks  # the chat stream's deltas, one choice
    req: ResponsesRequest
    model: str
    input_tokens: int
    response_id: str = attrs.field(factory=lambda: new_id("resp"))
    created_at: int = attrs.field(factory=lambda: int(time.time()))
    items: list[dict[str, Any]] = attrs.field(factory=list)
    open: int | None = None  # output index of the item being written
    finish: str | None = None  # chat's finish reason, once it came
    sequence: int = 0
    started: bool = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return typed_sse(payload)

    def _response(self, status: str, totals: dict[str, Any] | None = None, error: Any = None) -> dict[str, Any]:
        output = copy.deepcopy(self.items)
        return response_object(self.req, self.response_id, self.created_at, self.model, status, output, totals, error)

    def opening(self) -> Iterable[bytes]:
        self.started = True
        response = self._response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def pieces(self, out: RequestOutput) -> Iterable[bytes]:
        return [event for choice in self.chunks.pieces(out) for event in self._choice(choice)]

    def cut(self, unfinished: list[int]) -> Iterable[bytes]:
        return [event for index in unfinished for event in self._choice(self.chunks.cut(index))]

    def end(self, progress: ChoiceProgress) -> Iterable[bytes]:
        status = STATUS.get(self.finish or "", "failed")
        totals = usage(self.engine, self.input_tokens, sum(progress.generated), progress.cached[0], self.items)
        response = self._response(status, totals, _STOPPED if status == "failed" else None)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        return [self._event(kind, response=response)]

    def refused(self, error: ApiError) -> Iterable[bytes]:
        return self._fail(error.code or "server_error", error.message, error.param)

    def failed(self, exc: Exception) -> Iterable[bytes]:
        log.exception("stream failed", exc_info=exc)
        return self._fail("server_error", f"internal error: {type(exc).__name__}", None)

    def _fail(self, code: str, message: str, param: str | None) -> list[bytes]:
        """An ``error`` event, then ``response.failed`` (after ``response.created`` if not yet sent,
        which the SDKs' stream helpers expect first)."""
        events = [] if self.started else list(self.opening())
        events.append(self._event("error", code=code, message=message, param=param))
        events.append(
            self._event("response.failed", response=self._response("failed", None, {"code": code, "message": message}))
        )
        return events

    def _choice(self, choice: dict[str, Any]) -> list[bytes]:
        delta, finish = choice["delta"], choice["finish_reason"]
        events: list[bytes] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        if finish:
            self.finish = finish
            status = "incomplete" if STATUS.get(finish) != "completed" else "completed"
            if not any(item["type"] in ("message", "function_call") for item in self.items):
                events += self._text("message", "")  # a reply always has a message or a call
            events += self._close(status)
        return events

    def _text(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self.open is None or self.items[self.open]["type"] != kind:
            events += self._close("completed")
            item_id = new_id("msg" if kind == "message" else "rs")
            item = (
                message_item(item_id, "", "in_progress")
                if kind == "message"
                else reasoning_item(item_id, "", "in_progress")
            )
            events += self._add(item)
            part = copy.deepcopy(item["content"][0])
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        assert self.open is not None
        item = self.items[self.open]
        if text:
            item["content"][0]["text"] += text
            extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
            events.append(
                self._event(_TEXT_EVENTS[kind] + ".delta", **self._where(), content_index=0, delta=text, **extra)
            )
        return events

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        function = call.get("function") or {}
        if call.get("id"):  # the first delta of a call: its id and name
            events += self._close("completed")
            events += self._add(function_call_item(new_id("fc"), call["id"], function["name"], "", "in_progress"))
        if function.get("arguments") and self.open is not None:
            self.items[self.open]["arguments"] += function["arguments"]
            events.append(
                self._event("response.function_call_arguments.delta", **self._where(), delta=function["arguments"])
            )
        return events

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.items.append(item)
        self.open = len(self.items) - 1
        added = {**copy.deepcopy(item), **({"content": []} if "content" in item else {})}
        return [self._event("response.output_item.added", output_index=self.open, item=added)]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.items[self.open]["id"], "output_index": self.open}

    def _close(self, status: str) -> list[bytes]:
        """The open item's done events, with its final status."""
        if self.open is None:
            return []
        item, where = self.items[self.open], self._where()
        item["status"] = status
        events: list[bytes] = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        else:
            part = item["content"][0]
            extra: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            events.append(
                self._event(_TEXT_EVENTS[item["type"]] + ".done", **where, content_index=0, text=part["text"], **extra)
            )
            events.append(self._event("response.content_part.done", **where, content_index=0, part=copy.deepcopy(part)))
        events.append(self._event("response.output_item.done", output_index=self.open, item=copy.deepcopy(item)))
        self.open = None
        return events
