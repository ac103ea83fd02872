"""Chat messages as the SDKs send them: text or text parts on every role, assistant
messages with ``tool_calls``, and ``tool`` messages answering them.

``for_template`` turns each into the plain dict ``tokenizer.apply_chat_template``
takes; how tools and tool turns are written into a prompt is ``api/tools/``'s.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from trillm.api.schemas.base import RequestModel


class TextPart(RequestModel):
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str


Content = str | list[TextPart]


def text_of(content: Content | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text for p in content)


class FunctionCall(RequestModel):
    name: str = Field(min_length=1)
    arguments: str = Field(description="the arguments as a JSON text, as the API returned them")


class ToolCall(RequestModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(RequestModel):
    role: Literal["system", "user", "developer"] = Field(description="`developer` is treated as `system`")
    content: Content = Field(description="a string, or text parts that are joined")

    def for_template(self) -> dict[str, Any]:
        return {"role": "system" if self.role == "developer" else self.role, "content": text_of(self.content)}


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: Content | None = Field(None, description="may be null when the turn only called tools")
    tool_calls: list[ToolCall] | None = Field(None, description="calls the assistant made in this turn")

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text_of(self.content)}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    # Templates write the arguments with ``tojson``: give them the object, not its text.
                    "function": {"name": call.function.name, "arguments": _json_or_text(call.function.arguments)},
                }
                for call in self.tool_calls
            ]
        return message


class ToolMessage(RequestModel):
    role: Literal["tool"]
    content: Content = Field(description="the tool's result")
    tool_call_id: str = Field(min_length=1, description="the `id` of the call this answers")

    def for_template(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.tool_call_id, "content": text_of(self.content)}


AnyMessage = Annotated[Message | AssistantMessage | ToolMessage, Field(discriminator="role")]


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


MESSAGES_DESCRIPTION = (
    'the conversation, each `{"role", "content"}`; role `system`, `user`, `assistant` (or `developer`, treated '
    'as `system`), or `tool` (with `tool_call_id`); `content` a string or a list of `{"type": "text", "text"}` '
    "parts (other part types, e.g. images, are a 400); assistant turns may carry `tool_calls` (content may "
    "then be null)"
)
