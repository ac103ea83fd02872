"""Reading a generic reply (``generic.py``) while it streams: which branch it opens, the
``response`` string decoded as it comes (an escape held back until it is whole), the calls
as OpenAI's ``tool_calls`` deltas as their names and arguments are written."""

from __future__ import annotations

import json
import re
from typing import Any

from trillm.api.tools.spec import new_call_id

# The keys a generic reply (or an imitation of one) opens with, and what follows each.
_OPENINGS = ('{"response":"', '{"tool_calls":[', '{"tool_response":{')
_KEY = re.compile(r'\s*\{\s*"(\w+)"\s*:\s*')
_PLAIN = re.compile(r'[^"\\]*')
_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')
_PARTIAL_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?")
_CALL_HEAD = re.compile(r'[\s},]*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def branch(text: str) -> tuple[str | None, int]:
    """Which reply ``text`` opens: ``"response"``, ``"tool_calls"`` or ``"tool_response"`` and
    where its value starts (after the string's quote, the list's bracket), ``"other"`` for
    anything else, None while too little is written to tell."""
    m = _KEY.match(text)
    if m is None or m.end() == len(text):
        compact = re.sub(r"\s", "", text)
        return (None, 0) if any(o.startswith(compact) for o in _OPENINGS) else ("other", 0)
    key, value = m.group(1), text[m.end()]
    expected = {"response": '"', "tool_calls": "[", "tool_response": "{"}.get(key)
    if expected is None or value != expected:
        return "other", 0
    return key, m.end() + (1 if key != "tool_response" else 0)


class StringDecoder:
    """A JSON string's contents decoded as they arrive (after its opening quote): each
    ``feed`` returns what is certain so far; a partial escape, or the first half of a
    surrogate pair, waits for the rest. ``done`` once the closing quote came."""

    def __init__(self) -> None:
        self.pending = ""
        self.done = False

    def feed(self, chunk: str) -> str:
        if self.done:
            return ""
        s, i, out = self.pending + chunk, 0, []
        while i < len(s):
            plain = _PLAIN.match(s, i)
            assert plain is not None  # it matches the empty string
            out.append(plain.group())
            i = plain.end()
            if i == len(s):
                break
            if s[i] == '"':
                self.done, i = True, i + 1
                break
            escape = _ESCAPE.match(s, i)
            if escape is None:
                if _PARTIAL_ESCAPE.fullmatch(s, i):
                    break  # the rest of the escape has not come yet
                out.append(s[i])  # not an escape JSON knows (the grammar forbids it): as written
                i += 1
                continue
            code = escape.group()
            if code[1] == "u" and 0xD800 <= int(code[2:], 16) < 0xDC00:  # a pair's first half
                low = _ESCAPE.match(s, escape.end())
                if escape.end() == len(s) or (low is None and _PARTIAL_ESCAPE.fullmatch(s, escape.end())):
                    break
                if low is not None and low.group()[1] == "u" and 0xDC00 <= int(low.group()[2:], 16) < 0xE000:
                    code += low.group()
            out.append(json.loads('"' + code + '"'))
            i += len(code)
        self.pending = s[i:]
        return "".join(out)


class CallReader:
    """The calls of a generic reply as they are written (the text after ``{"tool_calls": [``):
    a head delta (index, id, name) once a call's name is whole, then its arguments' JSON text
    as it comes, to the brace that closes it. The grammar writes ``name`` before ``arguments``."""

    def __init__(self) -> None:
        self.pending = ""
        self.index = -1
        self.in_arguments = False
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, chunk: str) -> list[dict[str, Any]]:
        self.pending += chunk
        deltas: list[dict[str, Any]] = []
        while True:
            if not self.in_arguments:
                head = _CALL_HEAD.match(self.pending)
                if head is None or head.end() == len(self.pending):
                    return deltas
                self.index += 1
                self.in_arguments, self.pending = True, self.pending[head.end() :]
                function = {"name": json.loads(head.group(1)), "arguments": ""}
                call = {"index": self.index, "id": new_call_id(), "type": "function", "function": function}
                deltas.append({"tool_calls": [call]})
            end = self._scan()
            if end:
                piece, self.pending = self.pending[:end], self.pending[end:]
                deltas.append({"tool_calls": [{"index": self.index, "function": {"arguments": piece}}]})
            if self.in_arguments:
                return deltas

    def _scan(self) -> int:
        """How much of ``pending`` belongs to the arguments; ``in_arguments`` falls once they close."""
        for i, ch in enumerate(self.pending):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
            if self.depth == 0 and not self.in_string and ch not in " \n\t":
                self.in_arguments = False
                return i + 1
        return len(self.pending)


class ReplyReader:
    """What a streamed generic reply shows as it is written: the ``response`` string, decoded,
    as content; the calls as ``tool_calls`` deltas (with ``calls``; else as text: no tools were
    offered); a ``tool_response`` imitation nothing (parsed whole at the end); anything else as
    it is (only an unconstrained reply can be something else)."""

    def __init__(self, calls: bool) -> None:
        self.calls = CallReader() if calls else None
        self.text = ""
        self.kind: str | None = None
        self.decoder = StringDecoder()

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        if self.kind is None:
            self.kind, start = branch(self.text)
            piece = self.text[start:]
        if self.kind is None or self.kind == "tool_response":
            return []
        if self.kind == "tool_calls" and self.calls is not None:
            return self.calls.feed(piece)
        text = self.decoder.feed(piece) if self.kind == "response" else piece
        return [{"content": text}] if text else []
