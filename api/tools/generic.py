"""The ``generic`` format, for chat templates that know no tools (after llama.cpp's generic
handler): the tools are described in the system prompt and the whole answer is JSON,
``{"tool_calls": [{"name", "arguments"}]}`` or ``{"response": "..."}``, under a grammar.

The ``response`` string is streamed as it is written (``ReplyReader``): once the reply's
opening shows the text branch, the string's decoded contents go out as content, an escape
held back until it is whole. A reply cut short is its text so far, unwrapped, or its complete
calls; never the raw JSON. ``Imitation`` reads a reply to a conversation whose past tool
turns the model may imitate although the request offers no tools.
"""

from __future__ import annotations

import json
import re
from typing import Any

from trillm.api.tools.base import ToolFormat, call_of, calls_in
from trillm.api.tools.schema import embedded
from trillm.api.tools.spec import Function, Parsed, ToolSet
from trillm.engine.structured import GrammarSpec

# The keys a generic reply (or an imitation of one) opens with, and what follows each.
_OPENINGS = ('{"response":"', '{"tool_calls":[', '{"tool_response":{')
_KEY = re.compile(r'\s*\{\s*"(\w+)"\s*:\s*')
_PLAIN = re.compile(r'[^"\\]*')
_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')
_PARTIAL_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?")


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


class ReplyReader:
    """The content of a streamed generic reply as it is written: the ``response`` string,
    decoded; nothing for the branches in ``held`` (parsed whole at the end); anything else
    as it is (only an unconstrained reply can be something else)."""

    def __init__(self, held: frozenset[str]) -> None:
        self.held = held
        self.text = ""
        self.kind: str | None = None
        self.decoder = StringDecoder()

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.kind is None:
            self.kind, start = branch(self.text)
            piece = self.text[start:]
        if self.kind is None or self.kind in self.held:
            return ""
        return self.decoder.feed(piece) if self.kind == "response" else piece


class Generic(ToolFormat):
    name = "generic"
    trigger = None

    def grammar(self, tools: ToolSet) -> GrammarSpec:
        defs: dict[str, Any] = {}
        cases = []
        for i, f in enumerate(tools.callable):
            ref, defs[f"tool_{i}"] = embedded(f.parameters, f"tool_{i}")
            cases.append(_call_schema(f, ref))
        calls: dict[str, Any] = {"type": "array", "items": {"anyOf": cases}, "minItems": 1, "maxItems": tools.max_calls}
        call_reply = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}
        text_reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}
        root: dict[str, Any] = call_reply if tools.forced else {"anyOf": [call_reply, text_reply]}
        return GrammarSpec.json_schema({"$defs": defs, **root})

    def parse(self, text: str) -> Parsed:
        try:
            reply = json.loads(text)
        except ValueError:
            return self._cut(text)
        if isinstance(reply, dict) and isinstance(reply.get("tool_calls"), list):
            calls = [call_of(item, "arguments") for item in reply["tool_calls"]]
            if calls and None not in calls:
                return Parsed(None, tuple(c for c in calls if c))
        if isinstance(reply, dict) and isinstance(reply.get("response"), str):
            return Parsed(reply["response"])
        return Parsed(text)

    def reader(self) -> ReplyReader:
        return ReplyReader(frozenset({"tool_calls", "tool_response"}))

    def _cut(self, text: str) -> Parsed:
        """A reply that is not whole JSON (cut by ``max_tokens``): the answer so far,
        unwrapped; the complete calls (a call cut short is dropped); nothing while the
        opening was not even written."""
        kind, start = branch(text)
        if kind == "response":
            return Parsed(StringDecoder().feed(text[start:]) or None)
        if kind == "tool_calls":
            return Parsed(None, tuple(calls_in(text[start:], "arguments")))
        return Parsed(None) if kind is None else Parsed(text)

    @staticmethod
    def system_prompt(tools: ToolSet) -> str:
        listing = json.dumps([f.openai()["function"] for f in tools.callable], ensure_ascii=False)
        must = "You must call a tool." if tools.forced else "Call tools when they help; otherwise answer."
        many = "" if tools.max_calls > 1 else " Call one tool only."
        return (
            f"You can call these tools (JSON Schema of their arguments): {listing}\n{must}{many} Reply with "
            'JSON only: {"tool_calls": [{"name": "<tool name>", "arguments": {...}}]} to call tools, or '
            '{"response": "<your answer>"} to answer.'
        )

    @staticmethod
    def assistant_text(content: str, calls: list[dict[str, Any]]) -> str:
        """A past assistant turn written as this format's JSON, as the model would have written it."""
        if not calls:
            return json.dumps({"response": content}, ensure_ascii=False)
        items = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
        return json.dumps({"tool_calls": items}, ensure_ascii=False)


class Imitation(Generic):
    """A reply to a conversation with past tool turns and no tools now (no grammar): text,
    unless the model imitates the generic JSON anyway, which is unwrapped (``response``, a
    ``tool_response``'s content). Imitated calls stay text: no tool was offered."""

    def grammar(self, tools: ToolSet) -> GrammarSpec:
        raise NotImplementedError("imitation replies are never constrained")

    def parse(self, text: str) -> Parsed:
        try:
            reply = json.loads(text)
        except ValueError:
            kind, start = branch(text)
            if kind == "response":
                return Parsed(StringDecoder().feed(text[start:]))
            return Parsed(text)
        if isinstance(reply, dict) and len(reply) == 1:
            if isinstance(reply.get("response"), str):
                return Parsed(reply["response"])
            inner = reply.get("tool_response")
            if isinstance(inner, dict) and isinstance(inner.get("content"), str):
                return Parsed(inner["content"])
        return Parsed(text)

    def reader(self) -> ReplyReader:
        return ReplyReader(frozenset({"tool_response"}))


def _call_schema(f: Function, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": arguments},
        "required": ["name", "arguments"],
    }
