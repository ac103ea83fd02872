"""What every request model shares: strict types, ignored extras, null as "the default".

A field is declared once, as a pydantic field (type, default, bounds,
description); parsing, the 400's ``param`` and message, ``/openapi.json`` and
the field tables of ``docs/api.md`` are all derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler, GetJsonSchemaHandler, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

# Keys that describe a property rather than constrain its value; they stay outside the null union.
_ANNOTATIONS = ("title", "description", "default", "examples")


def _nullable_optionals(schema: dict[str, Any], cls: type) -> None:
    """Clients send ``null`` for "not given" (the OpenAI SDKs do); say so in the schema."""
    schema["additionalProperties"] = True  # unknown fields are accepted and ignored
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        branches = prop.get("anyOf", [])
        if name in required or {"type": "null"} in branches:
            continue
        value = {k: v for k, v in prop.items() if k not in _ANNOTATIONS}
        for key in value:
            del prop[key]
        prop["anyOf"] = (branches if list(value) == ["anyOf"] else [value]) + [{"type": "null"}]


class RequestModel(BaseModel):
    """Base of every request body and nested request object.

    Strict: ``"1"`` is not 1, ``1.5`` or ``true`` is not an integer; NaN and infinities are not
    numbers (``api/body.py`` refuses them in the body already, naming the field). Extra
    fields are ignored (benchmark clients send them). ``null`` means "not
    given": the field takes its default and is absent from ``model_fields_set``.
    """

    model_config = ConfigDict(
        strict=True, extra="ignore", frozen=True, allow_inf_nan=False, json_schema_extra=_nullable_optionals
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def invalid(message: str, param: str | None = None) -> PydanticCustomError:
    """A 400 with our own message; ``param`` overrides the error's location (for checks across fields)."""
    return PydanticCustomError("invalid", "{message}", {"message": message, "param": param})


@dataclass(frozen=True)
class Not:
    """One value a field refuses, e.g. ``top_k`` 0; enforced and published as ``not: {const}``."""

    value: Any

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        def check(v: Any) -> Any:
            if v == self.value:
                raise PydanticCustomError("not_allowed", "{value} is not allowed", {"value": self.value})
            return v

        return core_schema.no_info_after_validator_function(check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {**handler(schema), "not": {"const": self.value}}


@dataclass(frozen=True)
class Unsupported:
    """An OpenAI field we do not implement yet: empty is fine, asking for it is a 400 with ``reason``.

    Never silently ignored; published as ``maxItems``/``maxLength`` 0 so clients see it too.
    """

    reason: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        def check(v: Any) -> Any:
            if v:
                raise invalid(self.reason)
            return v

        return core_schema.no_info_after_validator_function(check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        value = handler(schema)
        limit = {"array": "maxItems", "string": "maxLength", "object": "maxProperties"}.get(value.get("type", ""))
        return {**value, limit: 0} if limit else value
