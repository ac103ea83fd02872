"""The ``generic`` format, for chat templates that know no tools (after llama.cpp's generic
handler): the tools are described in the system prompt and the whole answer is JSON,
``{"tool_calls": [{"name", "arguments"}]}`` or ``{"response": "..."}``, under a grammar.

Both branches stream as they are written (``reading.ReplyReader``): the ``response``
string's decoded contents as content, each call's name then its arguments' JSON as
``tool_calls`` deltas. A reply cut short is its text so far, unwrapped, or its complete
calls; never the raw JSON. ``Imitation`` reads a reply to a conversation whose past tool
turns the model may imitate although the request offers no tools.
"""

from __future__ import annotations

import json
from typing import Any

from trillm.api.tools.base import ToolFormat, call_of, calls_in
from trillm.api.tools.reading import ReplyReader, StringDecoder, branch
from trillm.api.tools.schema import embedded
from trillm.api.tools.spec import Function, Parsed, ToolSet
from trillm.engine import GrammarSpec


class Generic(ToolFormat):
    """The JSON reply format for any template; its grammar holds the offered functions'
    arguments under one root (``schema.embedded``)."""

    name = "generic"
    trigger = None

    def grammar(self, tools: ToolSet) -> GrammarSpec | None:  # always one here (``Imitation``'s is None)
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
        return ReplyReader(calls=True)

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

    def grammar(self, tools: ToolSet) -> GrammarSpec | None:
        return None  # no tool was offered: the reply is free text

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
        return ReplyReader(calls=False)


def _call_schema(f: Function, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": arguments},
        "required": ["name", "arguments"],
    }
