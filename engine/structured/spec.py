"""What a request asks its output to match, independent of any grammar engine."""

from __future__ import annotations

import json
from typing import Any, Literal

import attrs

GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "ebnf", "structural_tag"]
# Where the constraint starts, for reasoning models: "none" (the first token), "required" (after a
# ``</think>``; the output may open with ``<think>``: DeepSeek-R1 style, the template may have opened
# it already), "optional" (after a ``<think>...</think>`` block if the output opens with one: Qwen3).
ThinkingMode = Literal["none", "required", "optional"]


class GrammarError(ValueError):
    """A grammar that cannot be used: invalid, unsupported, or too slow to compile.

    ``param`` is left to the caller, which knows which request field held it."""


class GrammarCompilerBusy(Exception):
    """Every compile worker stayed busy for the whole wait: not the grammar's fault; retry later."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def canonical_json(value: Any) -> str:
    """A compact text of a JSON value: the cache key of a schema. Keys keep their order,
    which is the order a schema's properties are generated in."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@attrs.frozen
class GrammarSpec:
    """A constraint in its source form; ``source`` is compact JSON where it is JSON, so
    equal constraints written alike compare equal (and share one compiled grammar).

    ``json_object``: any JSON object (``source`` unused). ``json_schema``: the schema as
    canonical JSON. ``regex``: the pattern. ``choice``: a JSON list of the allowed strings.
    ``ebnf``: a GBNF grammar (llama.cpp's notation, root rule ``root``).
    ``structural_tag``: xgrammar's structural-tag JSON (used for tool calls).
    ``thinking``: free text the model may (or must) think first; the constraint holds the answer only.
    """

    kind: GrammarKind
    source: str = ""
    thinking: ThinkingMode = "none"

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        """``schema`` as a dict (or boolean schema), or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("a JSON schema must be an object")
        return cls("json_schema", canonical_json(schema))

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        if not pattern:
            raise GrammarError("the regex is empty")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        if not options:
            raise GrammarError("the choice needs at least one string")
        return cls("choice", canonical_json(list(options)))

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        if not grammar.strip():
            raise GrammarError("the grammar is empty")
        return cls("ebnf", grammar)

    @classmethod
    def structural_tag(cls, tag: Any) -> GrammarSpec:
        return cls("structural_tag", tag if isinstance(tag, str) else canonical_json(tag))

    def after_thinking(self, mode: ThinkingMode) -> GrammarSpec:
        """The same constraint on the answer of a reasoning model that thinks first (``mode``)."""
        return attrs.evolve(self, thinking=mode)

    @property
    def options(self) -> list[str]:
        """The strings of a ``choice``."""
        return list(json.loads(self.source)) if self.kind == "choice" else []
