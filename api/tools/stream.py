"""One streamed choice's text as OpenAI deltas when tools are on: content as it comes until
a call may be starting (held back like a stop string), then ``tool_calls`` deltas, never
the call's markup. A format whose whole reply is JSON (``generic``) has a reader that shows
the answer's text as it is written, unwrapped, and its calls as they are written."""

from __future__ import annotations

from typing import Any

from trillm.api.held_back import held_back
from trillm.api.tools.base import ToolFormat
from trillm.api.tools.spec import Call


class ToolStream:
    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.reader = fmt.reader() if fmt.trigger is None else None
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent as content (formats with a trigger)
        self.shown = ""  # the content sent so far (formats without: it is not a slice of ``text``)
        self.in_call = False
        self.streamed_calls = False  # the reader sent calls as they came: not again at the end
        self.calls: tuple[Call, ...] = ()

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """Deltas for the text so far; content that could start a call is held back."""
        self.text += piece
        trigger = self.fmt.trigger
        if trigger is None:
            deltas = self.reader.feed(piece) if self.reader is not None else []
            self.shown += "".join(d.get("content", "") for d in deltas)
            self.streamed_calls = self.streamed_calls or any("tool_calls" in d for d in deltas)
            return deltas
        if self.in_call:
            return []
        at = self.text.find(trigger, self.sent)
        if at >= 0:
            self.in_call = True
            return self._content(at)
        return self._content(len(self.text) - held_back(self.text, trigger))

    def finish(self) -> list[dict[str, Any]]:
        """The rest: the calls (first chunk of each with id, type and name, then its arguments),
        or the held-back text if it was no call after all. A call cut short is dropped (unless
        its start was streamed already, as the generic format's are)."""
        if self.fmt.trigger is not None and not self.in_call:
            return self._content(len(self.text))
        parsed = self.fmt.parse(self.text)
        deltas: list[dict[str, Any]] = []
        if self.fmt.trigger is None:
            content = parsed.content or ""
            if content.startswith(self.shown):  # else it was shown differently as it came: keep that
                deltas += self._show(content[len(self.shown) :])
        self.calls = parsed.calls
        if self.streamed_calls:
            return deltas
        for i, call in enumerate(parsed.calls):
            head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            deltas.append({"tool_calls": [head]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        return deltas

    def _show(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.shown += text
        return [{"content": text}]

    def _content(self, upto: int) -> list[dict[str, Any]]:
        if upto <= self.sent:
            return []
        text, self.sent = self.text[self.sent : upto], upto
        return [{"content": text}]
