"""Structured-output fields: OpenAI's ``response_format`` and vLLM's extensions, declared once.

Each names one constraint on the output; at most one may be given. ``grammar()``
returns it as an engine ``GrammarSpec`` together with the field that held it, so a
schema that fails to compile is a 400 naming that field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from trillm.api.schemas.base import RequestModel, invalid
from trillm.engine import GrammarError, GrammarSpec

MAX_CHOICES = 256

_Schema = dict[str, Any] | bool


class TextFormat(RequestModel):
    type: Literal["text"] = Field(description="plain text, no constraint")


class JsonObjectFormat(RequestModel):
    type: Literal["json_object"] = Field(description="any JSON object")


class JsonSchema(RequestModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="the schema's name (letters, digits, _ and -)")
    description: str | None = Field(None, description="what the response is for; not shown to the model")
    schema_: _Schema = Field(
        default_factory=dict,
        alias="schema",
        description="a JSON Schema (objects, arrays, enums, bounds, `$ref`/`$defs`, `anyOf`, ...)",
    )
    strict: bool | None = Field(
        None,
        description="accepted for compatibility: the output always matches the schema, and objects never "
        "have properties the schema does not list",
    )


class JsonSchemaFormat(RequestModel):
    type: Literal["json_schema"] = Field(description="JSON matching `json_schema.schema`")
    json_schema: JsonSchema = Field(description="`{name, schema, strict, description}`")


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs`` object; exactly one member."""

    json_: _Schema | str | None = Field(None, alias="json", description="a JSON Schema (object or JSON text)")
    json_object: bool | None = Field(None, description="`true`: any JSON object")
    regex: str | None = Field(None, description="a regular expression the whole output matches")
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description="the output is exactly one of these strings"
    )
    grammar: str | None = Field(None, description="a GBNF grammar (llama.cpp's notation, start rule `root`)")


class StructuredFields(RequestModel):
    """The constraint fields every generation request shares."""

    response_format: ResponseFormat | None = Field(
        None,
        description='`{"type": "text"}`, `{"type": "json_object"}` (any JSON object), or `{"type": "json_schema", '
        '"json_schema": {"name", "schema", "strict"}}`: the output is guaranteed to match, unless cut by '
        '`max_tokens` (`finish_reason: "length"`); it ends (`"stop"`) when the JSON is complete. JSON is '
        "compact: one space after `,` and `:`, no newlines",
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's extension: one of `json`, `json_object`, `regex`, `choice`, `grammar`"
    )
    guided_json: _Schema | str | None = Field(None, description="vLLM's older name for `structured_outputs.json`")
    guided_regex: str | None = Field(None, description="vLLM's older name for `structured_outputs.regex`")
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = Field(
        None, description="vLLM's older name for `structured_outputs.choice`"
    )
    guided_grammar: str | None = Field(None, description="vLLM's older name for `structured_outputs.grammar`")

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredFields:
        self.grammar()  # the checks run while validating, so a conflict is a 400 naming its field
        return self

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        """The one constraint asked for, and the field that holds it; a 400 if several are."""
        found: list[tuple[GrammarSpec, str]] = []
        try:
            found += _format_grammar(self.response_format)
            if self.structured_outputs is not None:
                found += _structured_grammars(self.structured_outputs)
            for param, make in (
                ("guided_json", GrammarSpec.json_schema),
                ("guided_regex", GrammarSpec.regex),
                ("guided_choice", GrammarSpec.choice),
                ("guided_grammar", GrammarSpec.ebnf),
            ):
                if getattr(self, param) is not None:
                    found.append(_spec(param, make, getattr(self, param)))
        except _FieldError as exc:
            raise invalid(str(exc.error), exc.param) from None
        if len(found) > 1:
            names = ", ".join(param for _, param in found)
            raise invalid(f"give at most one output constraint, got {names}", found[1][1])
        return found[0] if found else None


class _FieldError(Exception):
    def __init__(self, error: GrammarError, param: str) -> None:
        self.error = error
        self.param = param


def _spec(param: str, make: Any, *args: Any) -> tuple[GrammarSpec, str]:
    try:
        return make(*args), param
    except GrammarError as exc:
        raise _FieldError(exc, param) from None


def _format_grammar(fmt: TextFormat | JsonObjectFormat | JsonSchemaFormat | None) -> list[tuple[GrammarSpec, str]]:
    if isinstance(fmt, JsonObjectFormat):
        return [_spec("response_format", GrammarSpec.json_object)]
    if isinstance(fmt, JsonSchemaFormat):
        return [_spec("response_format", GrammarSpec.json_schema, fmt.json_schema.schema_)]
    return []


def _structured_grammars(so: StructuredOutputs) -> list[tuple[GrammarSpec, str]]:
    found = []
    if so.json_ is not None:
        found.append(_spec("structured_outputs.json", GrammarSpec.json_schema, so.json_))
    if so.json_object:
        found.append(_spec("structured_outputs.json_object", GrammarSpec.json_object))
    if so.regex is not None:
        found.append(_spec("structured_outputs.regex", GrammarSpec.regex, so.regex))
    if so.choice is not None:
        found.append(_spec("structured_outputs.choice", GrammarSpec.choice, so.choice))
    if so.grammar is not None:
        found.append(_spec("structured_outputs.grammar", GrammarSpec.ebnf, so.grammar))
    if not found:
        raise _FieldError(GrammarError("needs one of json, json_object, regex, choice, grammar"), "structured_outputs")
    return found
