"""What every tool-call format is: a grammar, a parser, and (where the whole reply is JSON) a
reader that finds the answer's text while it streams. Shared by ``formats`` and ``generic``."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

from trillm.api.tools.spec import Call, Parsed, ToolSet
from trillm.engine import GrammarSpec


class Reader(Protocol):
    """Follows one streamed reply: ``feed`` takes each new piece of text and returns the
    deltas to send now (``content``, ``tool_calls``; possibly none yet)."""

    def feed(self, piece: str) -> list[dict[str, Any]]: ...


class ToolFormat(ABC):
    name: ClassVar[str]
    trigger: ClassVar[str | None]  # the text that starts a call; None: the whole output is JSON

    @abstractmethod
    def grammar(self, tools: ToolSet) -> GrammarSpec | None:
        """What the model may write: calls forced or constrained as ``tools`` asks; None: free text."""

    @abstractmethod
    def parse(self, text: str) -> Parsed:
        """A reply, finished or cut short, split into the text the user reads and the calls it
        made; a call cut short is dropped, never returned as text."""

    def reader(self) -> Reader | None:
        """For a format without a ``trigger``: what shows the answer's text as it streams."""
        return None


def json_prefix(text: str) -> Any:
    """The JSON value ``text`` starts with, or None."""
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        return None


def call_of(item: Any, key: str) -> Call | None:
    """``{"name": ..., key: arguments}`` as a call, or None if it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or key not in item:
        return None
    return Call.of(item["name"], item[key])


def calls_in(text: str, key: str) -> list[Call]:
    """The complete calls at the start of ``text``, a run of JSON objects (``{...}, {...}``,
    ``;`` or spaces between), up to the first that is cut short or not a call."""
    calls: list[Call] = []
    rest = text
    while True:
        rest = rest.lstrip(" \n\t,;")
        try:
            item, end = json.JSONDecoder().raw_decode(rest)
        except ValueError:
            return calls
        call = call_of(item, key)
        if call is None:
            return calls
        calls.append(call)
        rest = rest[end:]
