"""Each model family's tool-call syntax: the grammar that forces or constrains a call, and
the parser that finds calls in a finished text.

A format is chosen by the ``tool_call_parser`` setting, or from the chat template
(``detect``). Formats with a ``trigger`` let the model write text and start a call
with it (the grammar constrains a call once it has started, and forces one for
``required`` or a named function); ``generic`` is for templates that know no tools:
the model answers in JSON, either calls or a ``response``, always under a grammar.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from trillm.api.tools.spec import Call, Function, Parsed, ToolSet
from trillm.engine.structured import GrammarSpec


class ToolFormat(ABC):
    name: ClassVar[str]
    trigger: ClassVar[str | None]  # the text that starts a call; None: the whole output is JSON

    @abstractmethod
    def grammar(self, tools: ToolSet) -> GrammarSpec:
        """What the model may write: calls forced or constrained as ``tools`` asks."""

    @abstractmethod
    def parse(self, text: str) -> Parsed:
        """A finished reply split into the text the user reads and the calls it made."""


class _TaggedFormat(ToolFormat):
    """Calls written as ``opening {"name": <name>, "<key>": <arguments JSON> end``, one tag per function."""

    opening: ClassVar[str]  # what the model writes before the call's JSON object
    key: ClassVar[str]  # the arguments' key in that object
    end: ClassVar[str]

    def begin(self, name: str) -> str:
        return self.opening + '{"name": ' + json.dumps(name) + ', "' + self.key + '": '

    def grammar(self, tools: ToolSet) -> GrammarSpec:
        tags = [
            {
                "type": "tag",
                "begin": self.begin(f.name),
                "content": {"type": "json_schema", "json_schema": f.parameters},
                "end": self.end,
            }
            for f in tools.callable
        ]
        return GrammarSpec.structural_tag(
            {
                "type": "structural_tag",
                "format": {
                    "type": "triggered_tags",
                    "triggers": [self.trigger],
                    "tags": tags,
                    "at_least_one": tools.forced,
                    "stop_after_first": tools.max_calls == 1,
                },
            }
        )


class Hermes(_TaggedFormat):
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"
    trigger = "<tool_call>"
    opening, key, end = "<tool_call>\n", "arguments", "}\n</tool_call>"

    def parse(self, text: str) -> Parsed:
        blocks = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S)
        calls = [_call(b, "arguments") for b in blocks]
        if not blocks or None in calls:
            return Parsed(text)
        return Parsed(text[: text.index("<tool_call>")].strip() or None, tuple(c for c in calls if c))


class Mistral(_TaggedFormat):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``."""

    name = "mistral"
    trigger = "[TOOL_CALLS]"
    opening, key, end = "[TOOL_CALLS][", "arguments", "}]"

    def parse(self, text: str) -> Parsed:
        if self.trigger not in text:
            return Parsed(text)
        head, *blocks = text.split(self.trigger)
        calls: list[Call] = []
        for block in blocks:
            items = _json_prefix(block.strip())
            if not isinstance(items, list) or not items:
                return Parsed(text)
            for item in items:
                call = _call_of(item, "arguments")
                if call is None:
                    return Parsed(text)
                calls.append(call)
        return Parsed(head.strip() or None, tuple(calls))


class Llama3Json(_TaggedFormat):
    """Llama 3.1 / 3.2: ``{"name": ..., "parameters": {...}}`` (maybe after ``<|python_tag|>``)."""

    name = "llama3_json"
    trigger = '{"name": '
    opening, key, end = "", "parameters", "}"

    def parse(self, text: str) -> Parsed:
        body = text.replace("<|python_tag|>", "")
        start = body.find('{"name"')
        if start < 0:
            return Parsed(text)
        calls: list[Call] = []
        rest = body[start:]
        while rest.strip():
            rest = rest.strip().lstrip(";").strip()
            try:
                item, end = json.JSONDecoder().raw_decode(rest)
            except ValueError:
                return Parsed(text)
            call = _call_of(item, "parameters") or _call_of(item, "arguments")
            if call is None:
                return Parsed(text)
            calls.append(call)
            rest = rest[end:]
        return Parsed(body[:start].strip() or None, tuple(calls))


class Generic(ToolFormat):
    """Any model (after llama.cpp's generic handler): the tools are described in the system
    prompt and the answer is JSON, ``{"tool_calls": [{"name", "arguments"}]}`` or
    ``{"response": "..."}``, always under a grammar so it parses."""

    name = "generic"
    trigger = None

    def grammar(self, tools: ToolSet) -> GrammarSpec:
        calls: dict[str, Any] = {
            "type": "array",
            "items": {"anyOf": [_call_schema(f) for f in tools.callable]},
            "minItems": 1,
            "maxItems": tools.max_calls,
        }
        call_reply = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]}
        if tools.forced:
            return GrammarSpec.json_schema(call_reply)
        text_reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}
        return GrammarSpec.json_schema({"anyOf": [call_reply, text_reply]})

    def parse(self, text: str) -> Parsed:
        try:
            reply = json.loads(text)
        except ValueError:
            return _salvage(text)  # cut by max_tokens
        if isinstance(reply, dict) and isinstance(reply.get("tool_calls"), list):
            calls = [_call_of(item, "arguments") for item in reply["tool_calls"]]
            if calls and None not in calls:
                return Parsed(None, tuple(c for c in calls if c))
        if isinstance(reply, dict) and isinstance(reply.get("response"), str):
            return Parsed(reply["response"])
        return Parsed(text)

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


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Mistral(), Llama3Json(), Generic())}
PARSER_CHOICES = ("auto", *FORMATS)


def detect(template: str | None) -> ToolFormat:
    """The format a chat template's model was trained on; ``generic`` for templates without tools."""
    template = template or ""
    if "tools" not in template:
        return FORMATS["generic"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or "ipython" in template:
        return FORMATS["llama3_json"]
    return FORMATS["generic"]


def choose(setting: str, template: str | None) -> ToolFormat:
    return detect(template) if setting == "auto" else FORMATS[setting]


def renders_tools(template: str | None) -> bool:
    """Whether the chat template writes a ``tools`` list itself."""
    return "tools" in (template or "")


def _salvage(text: str) -> Parsed:
    """The complete calls of a generic reply cut short (``{"tool_calls": [{...}, {...}, {"na``),
    else the text as it is."""
    head = '{"tool_calls": ['
    if not text.startswith(head):
        return Parsed(text)
    rest, calls = text[len(head) :], []
    while True:
        rest = rest.lstrip(" ,")
        try:
            item, end = json.JSONDecoder().raw_decode(rest)
        except ValueError:
            break
        call = _call_of(item, "arguments")
        if call is None:
            break
        calls.append(call)
        rest = rest[end:]
    return Parsed(None, tuple(calls)) if calls else Parsed(text)


def _call_schema(f: Function) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": f.parameters},
        "required": ["name", "arguments"],
    }


def _json_prefix(text: str) -> Any:
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        return None


def _call(block: str, key: str) -> Call | None:
    return _call_of(_json_prefix(block.strip()), key)


def _call_of(item: Any, key: str) -> Call | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or key not in item:
        return None
    return Call.of(item["name"], item[key])
