"""Chat messages as the chat template wants them: ``{"role", "content"}`` with text content.

New message kinds (tool messages, assistant tool calls) and content parts
(images) slot in here as further models in the unions below.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trillm.api.schemas.base import RequestModel


class TextPart(RequestModel):
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str


class Message(RequestModel):
    role: Literal["system", "user", "assistant", "developer"] = Field(description="`developer` is treated as `system`")
    content: str | list[TextPart] = Field(description="a string, or text parts that are joined")

    def for_template(self) -> dict[str, str]:
        """The plain dict ``tokenizer.apply_chat_template`` takes."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


MESSAGES_DESCRIPTION = (
    'the conversation, each `{"role", "content"}`; role `system`, `user`, `assistant` (or `developer`, treated '
    'as `system`); content a string or a list of `{"type": "text", "text"}` parts (other part types, e.g. '
    "images, are a 400)"
)
