"""A request's tools in our own terms (no pydantic): what the formats and the prompt need."""

from __future__ import annotations

import json
import secrets
from typing import Any

import attrs

MAX_PARALLEL_CALLS = 8


@attrs.frozen
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """As OpenAI's ``tools`` entry, which chat templates expect."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@attrs.frozen
class ToolSet:
    """The functions a request offers and what it asks: ``choice`` is "auto", "required" or a
    function's name (a request with ``"none"`` has no ToolSet)."""

    functions: tuple[Function, ...]
    choice: str
    parallel: bool
    legacy: bool = False  # asked with ``functions``: answered with ``function_call`` (one call)

    @property
    def max_calls(self) -> int:
        """A named function is called once; parallel calls are capped so that a small model
        repeating itself still ends (``MAX_PARALLEL_CALLS``)."""
        many = self.parallel and not self.legacy and self.choice in ("auto", "required")
        return MAX_PARALLEL_CALLS if many else 1

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def callable(self) -> tuple[Function, ...]:
        """The functions a call may name (one, when the choice names it)."""
        if self.choice in ("auto", "required"):
            return self.functions
        return tuple(f for f in self.functions if f.name == self.choice)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@attrs.frozen
class Call:
    """One parsed call; ``arguments`` is a JSON text, as the API returns it."""

    name: str
    arguments: str
    id: str = attrs.field(factory=new_call_id)

    @classmethod
    def of(cls, name: str, arguments: Any) -> Call:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(name, text)

    def openai(self, index: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return body if index is None else {"index": index, **body}


@attrs.frozen
class Parsed:
    """A finished choice's text split into what the user reads and the calls it made."""

    content: str | None
    calls: tuple[Call, ...] = ()
