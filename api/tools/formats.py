"""Each model family's tool-call syntax: the grammar that forces or constrains a call, and
the parser that finds calls in a reply (finished, or cut short: then its complete calls).

A format is chosen by the ``tool_call_parser`` setting, or from the chat template
(``detect``). Formats with a ``trigger`` let the model write text and start a call
with it (the grammar constrains a call once it has started, and forces one for
``required`` or a named function); ``generic`` is for templates that know no tools:
the model answers in JSON, either calls or a ``response``, always under a grammar.
"""

from __future__ import annotations

import json
from typing import ClassVar

from trillm.api.harmony import CALL, CHANNEL, MESSAGE
from trillm.api.tools.base import ToolFormat, call_of, calls_in, json_prefix
from trillm.api.tools.generic import Generic
from trillm.api.tools.spec import Call, Parsed, ToolSet
from trillm.engine import GrammarSpec

__all__ = ["FORMATS", "PARSER_CHOICES", "Generic", "ToolFormat", "choose", "detect"]


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
        head, *blocks = text.split(self.trigger)
        calls: list[Call] = []
        for block in blocks:
            call = _call(block.split("</tool_call>")[0], "arguments")
            if call is None:  # cut short (the grammar holds a call that has started)
                break
            calls.append(call)
        return Parsed(head.strip() or None, tuple(calls)) if blocks else Parsed(text)


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
            found = calls_in(block.strip().removeprefix("["), "arguments")
            calls += found
            if not found or not block.rstrip().endswith("]"):  # cut short: what came before it
                break
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
        calls = calls_in(body[start:], "parameters") or calls_in(body[start:], "arguments")
        return Parsed(body[:start].strip() or None, tuple(calls))


class Harmony(_TaggedFormat):
    """gpt-oss: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``
    (``api/harmony.py`` passes such a message on whole)."""

    name = "harmony"
    trigger = CHANNEL + "commentary to=functions."
    end = "<|call|>"

    def begin(self, name: str) -> str:
        return f"{self.trigger}{name} <|constrain|>json{MESSAGE}"

    def parse(self, text: str) -> Parsed:
        if self.trigger not in text:
            return Parsed(text)
        head, *blocks = text.split(CHANNEL)
        calls: list[Call] = []
        rest: list[str] = [head]
        for block in blocks:
            header, sep, body = block.partition(MESSAGE)
            found = CALL.search(header)
            if not found or not sep:
                rest.append(block)
                continue
            arguments, closed, after = body.partition(self.end)
            value = json_prefix(arguments)
            if not closed or value is None:
                break  # cut short: the calls before it
            calls.append(Call.of(found.group(1), value))
            rest.append(after)
        return Parsed("".join(rest).strip() or None, tuple(calls))


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Mistral(), Llama3Json(), Harmony(), Generic())}
PARSER_CHOICES = ("auto", *FORMATS)


def detect(template: str | None) -> ToolFormat:
    """The format a chat template's model was trained on; ``generic`` for templates without tools."""
    template = template or ""
    if "tools" not in template:
        return FORMATS["generic"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "<|channel|>" in template:  # gpt-oss's harmony
        return FORMATS["harmony"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or "ipython" in template:
        return FORMATS["llama3_json"]
    return FORMATS["generic"]


def choose(setting: str, template: str | None) -> ToolFormat:
    return detect(template) if setting == "auto" else FORMATS[setting]


def _call(block: str, key: str) -> Call | None:
    return call_of(json_prefix(block.strip()), key)
