"""gpt-oss's harmony format: a reply is messages on channels, each ``<|channel|>NAME<|message|>
TEXT`` ended by ``<|end|>``, ``<|return|>`` or ``<|call|>``, the next opened by ``<|start|>assistant``.

``analysis`` is the model's thinking (``reasoning_content``), ``final`` the answer (``content``),
``commentary`` a preamble the user may read (``content``) or, addressed ``to=functions.NAME``, a
tool call whose arguments are the message (``HarmonyTools``, the ``harmony`` tool-call format).
The markers are special tokens: under this parser the server decodes them (the request's
``skip_special_tokens`` off), and the parser takes them out. A reply with no marker at all is
all answer. Incremental like ``reasoning.ReasoningParser``: a marker split across deltas is held
back until it is complete or proven not to be one.
"""

from __future__ import annotations

import json
import re

from trillm.api.tools.base import ToolFormat
from trillm.api.tools.spec import Call, Parsed, ToolSet
from trillm.engine import GrammarSpec

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (CHANNEL, MESSAGE, START, "<|constrain|>", *ENDS)
_CALL = re.compile(r"to=functions\.([\w.-]+)")


def _held_back(text: str) -> int:
    """Length of the end of ``text`` that may still become a marker (``<|`` ... without ``|>``)."""
    at = text.rfind("<")
    if at < 0 or "|>" in text[at:]:
        return 0
    tail = text[at:]
    return len(tail) if any(m.startswith(tail) for m in MARKERS) else 0


class HarmonyParser:
    """One reply's text in, ``(reasoning, content)`` deltas out; ``finish`` flushes what is held.

    A commentary message addressed to a function is passed on as content in its raw form
    (``<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>``) for the tool parser."""

    def __init__(self) -> None:
        self._state = "outside"  # outside (no marker yet) -> header -> body -> between -> header ...
        self._channel = ""  # the header of the message being read
        self._pending = ""
        self._seen_marker = False

    def feed(self, text: str) -> tuple[str, str]:
        buf, self._pending = self._pending + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self._state in ("outside", "between"):
                at = buf.find(CHANNEL)
                if at < 0:
                    keep = _held_back(buf)
                    if self._state == "outside" and not self._seen_marker:  # plain text: the answer
                        content.append(buf[: len(buf) - keep])
                    self._pending = buf[len(buf) - keep :] if keep else ""
                    break
                if self._state == "outside" and not self._seen_marker:
                    content.append(buf[:at])
                self._seen_marker = True
                self._state, self._channel, buf = "header", "", buf[at + len(CHANNEL) :]
            elif self._state == "header":
                at = buf.find(MESSAGE)
                if at < 0:
                    self._pending = buf
                    break
                self._channel = (self._channel + buf[:at]).strip()
                self._state, buf = "body", buf[at + len(MESSAGE) :]
                if self._is_call():
                    content.append(f"{CHANNEL}{self._channel}{MESSAGE}")
            else:  # body
                ends = [(buf.find(e), e) for e in ENDS if e in buf]
                if not ends:
                    keep = _held_back(buf)
                    self._route(buf[: len(buf) - keep], reasoning, content)
                    self._pending = buf[len(buf) - keep :] if keep else ""
                    break
                at, end = min(ends)
                self._route(buf[:at], reasoning, content)
                if self._is_call():
                    content.append("<|call|>")
                self._state, buf = "between", buf[at + len(end) :]
        return "".join(reasoning), "".join(content)

    def _is_call(self) -> bool:
        return self._channel.startswith("commentary") and _CALL.search(self._channel) is not None

    def _route(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        (reasoning if self._channel.startswith("analysis") else content).append(text)

    def finish(self) -> tuple[str, str]:
        rest, self._pending = self._pending, ""
        if self._state == "body":
            reasoning: list[str] = []
            content: list[str] = []
            self._route(rest, reasoning, content)
            return "".join(reasoning), "".join(content)
        return ("", rest) if self._state == "outside" and not self._seen_marker else ("", "")


class HarmonyTools(ToolFormat):
    """gpt-oss's calls: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``."""

    name = "harmony"
    trigger = CHANNEL + "commentary to=functions."

    def grammar(self, tools: ToolSet) -> GrammarSpec | None:
        tags = [
            {
                "type": "tag",
                "begin": f"{self.trigger}{f.name} <|constrain|>json{MESSAGE}",
                "content": {"type": "json_schema", "json_schema": f.parameters},
                "end": "<|call|>",
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

    def parse(self, text: str) -> Parsed:
        if self.trigger not in text:
            return Parsed(text)
        head, *blocks = text.split(CHANNEL)
        calls: list[Call] = []
        rest: list[str] = [head]
        for block in blocks:
            header, sep, body = block.partition(MESSAGE)
            found = _CALL.search(header)
            if not found or not sep:
                rest.append(block)
                continue
            arguments, closed, after = body.partition("<|call|>")
            try:
                value = json.loads(arguments)
            except ValueError:
                break  # cut short: the calls before it
            if not closed:
                break
            calls.append(Call.of(found.group(1), value))
            rest.append(after)
        text_left = "".join(rest).strip()
        return Parsed(text_left or None, tuple(calls))
