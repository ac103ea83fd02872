"""Words for a field's JSON schema: what a 400 says a field "must be", and the docs' "accepts" column.

Both read the JSON schema pydantic derives from the declaration, so the error
message, ``/openapi.json`` and ``docs/api.md`` cannot disagree.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import BaseModel, ValidationError

from trillm.api.errors import ApiError

Schema = dict[str, Any]


@functools.cache
def json_schema(model: type[BaseModel]) -> Schema:
    return model.model_json_schema()


def resolve(schema: Schema, defs: Schema) -> Schema:
    while "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def branches(schema: Schema, defs: Schema) -> list[Schema]:
    """The alternatives of a union (null left out: it always means "the default"), or the schema itself."""
    schema = resolve(schema, defs)
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if not alternatives:
        return [] if schema.get("type") == "null" else [schema]
    return [b for a in alternatives for b in branches(a, defs)]  # unions nest (a tagged union, or null)


def _num(x: Any) -> str:
    return json.dumps(x)


def _bounds(s: Schema) -> str:
    lo, lo_open = (s["exclusiveMinimum"], True) if "exclusiveMinimum" in s else (s.get("minimum"), False)
    hi, hi_open = (s["exclusiveMaximum"], True) if "exclusiveMaximum" in s else (s.get("maximum"), False)
    if lo is not None and lo == hi and not (lo_open or hi_open):
        text = f" equal to {_num(lo)}"
    elif lo is not None and hi is not None:
        text = f" in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    elif lo is not None:
        text = f" {'>' if lo_open else '>='} {_num(lo)}"
    elif hi is not None:
        text = f" {'<' if hi_open else '<='} {_num(hi)}"
    else:
        text = ""
    return text + (f", not {_num(s['not']['const'])}" if "const" in s.get("not", {}) else "")


def _count(lo: int | None, hi: int | None, noun: str) -> str:
    if lo and hi:
        return f"{lo} to {hi} {noun}"
    if hi is not None:
        return f"at most {hi} {noun}"
    return f"at least {lo} {noun}" if lo else noun


_NOUNS = {"number": "number", "integer": "integer", "boolean": "boolean", "string": "string", "object": "object"}


def _one(s: Schema, defs: Schema, plural: bool) -> str:
    """One alternative, as a noun phrase: "an integer in [1, 32]", or plural: "integers >= 0"."""
    if "const" in s:
        return _num(s["const"])
    if "enum" in s:
        return "one of " + ", ".join(_num(v) for v in s["enum"] if v is not None)
    kind = s.get("type", "")
    if kind == "array":
        items = branches(s.get("items", {}), defs)
        inner = " or ".join(_one(i, defs, True) for i in items) or "values"
        lo, hi = s.get("minItems"), s.get("maxItems")
        if hi == 0:
            return "empty arrays" if plural else "an empty array"
        if lo == 1 and hi is None:
            return f"non-empty arrays of {inner}" if plural else f"a non-empty array of {inner}"
        return ("arrays of " if plural else "an array of ") + _count(lo, hi, inner)
    noun = _NOUNS.get(kind, "value")
    if kind == "string" and s.get("maxLength") == 0:
        return "empty strings" if plural else "an empty string"
    head = noun + "s" if plural else ("an " if noun[0] in "aeiou" else "a ") + noun
    if kind == "object" and s.get("required"):
        return head + " with " + " and ".join(repr(r) for r in s["required"])
    if _is_mapping(s):
        values = [v for v in s.get("patternProperties", {}).values()] or [s.get("additionalProperties", {})]
        keys = "token ids" if s.get("patternProperties", {}).keys() == {"^[0-9]+$"} else "strings"
        inner = " or ".join(_one(b, defs, True) for v in values if isinstance(v, dict) for b in branches(v, defs))
        return head + (f" mapping {keys} to {inner}" if inner else "")
    if kind == "string" and "pattern" in s:
        return f"{head} matching {s['pattern']}"
    if kind == "string" and s.get("minLength") == 1 and "maxLength" not in s:
        return "non-empty strings" if plural else "a non-empty string"
    if kind == "string" and (s.get("minLength") or "maxLength" in s):
        return head + " of " + _count(s.get("minLength"), s.get("maxLength"), "characters")
    return head + _bounds(s)


def phrase(schema: Schema, defs: Schema) -> str:
    """What a value must be, e.g. ``a string or an array of at most 4 strings``."""
    alternatives = branches(schema, defs)
    if len(alternatives) > 1 and all(b.get("type") == "object" and "properties" in b for b in alternatives):
        # A tagged union of objects (messages, response_format): the keys every member requires.
        common = [
            r for r in alternatives[0].get("required", []) if all(r in b.get("required", []) for b in alternatives)
        ]
        return "an object" + (" with " + " and ".join(repr(r) for r in common) if common else "")
    parts = list(dict.fromkeys(_one(b, defs, False) for b in alternatives))
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _is_mapping(s: Schema) -> bool:
    return s.get("type") == "object" and "properties" not in s


def locate(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[str | None, Schema, list[int | str]]:
    """A pydantic error location as the OpenAI ``param`` (``messages[2].content``) and the schema there.

    Union members' tags in ``loc`` are skipped; the path stops at a mapping's keys
    (``logit_bias``) and at arrays of plain values (``stop``, ``stop_token_ids``).
    Also returns the steps kept, to find the offending value in the body.
    """
    root = json_schema(model)
    defs = root.get("$defs", {})
    node, path = root, ""
    kept: list[int | str] = []
    for step in loc:
        alternatives = branches(node, defs)
        if isinstance(step, int):
            arrays = [b for b in alternatives if b.get("type") == "array"]
            items = branches(arrays[0].get("items", {}), defs) if arrays else []
            if not items or not all("properties" in i for i in items):
                break
            node, path = arrays[0]["items"], f"{path}[{step}]"
            kept.append(step)
            continue
        owners = [b for b in alternatives if step in b.get("properties", {})]
        if owners:
            node, path = owners[0]["properties"][step], f"{path}.{step}" if path else step
            kept.append(step)
        elif any(_is_mapping(b) for b in alternatives):
            break
    return path or None, node, kept


def _at(body: Any, steps: list[int | str], fallback: Any) -> Any:
    try:
        for step in steps:
            body = body[step]
    except (KeyError, IndexError, TypeError):
        return fallback
    return body


def _got(value: Any) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def api_error(model: type[BaseModel], exc: ValidationError, body: Any) -> ApiError:
    """The first validation error as a 400 naming the field, what it must be, and what came."""
    error = exc.errors(include_url=False)[0]
    if error["type"] == "model_type" and not error["loc"]:
        return ApiError("the request body must be a JSON object")
    param, schema, steps = locate(model, error["loc"])
    ctx = error.get("ctx") or {}
    if error["type"] == "invalid":
        param = ctx.get("param") or param
        message = ctx["message"]
    elif error["type"] == "missing":
        message = "is required"
    elif error["type"] == "union_tag_not_found":
        tag = ctx["discriminator"].strip("'")
        param = f"{param}.{tag}" if param else tag
        message = "is required"
    elif error["type"] == "union_tag_invalid":  # a tagged union (``response_format``): name the tag
        tag = ctx["discriminator"].strip("'")
        param = f"{param}.{tag}" if param else tag
        message = f"must be one of {ctx['expected_tags']}, got {_got(ctx['tag'])}"
    else:
        allowed = phrase(schema, json_schema(model).get("$defs", {}))
        message = f"must be {allowed}, got {_got(_at(body, steps, error['input']))}"
    return ApiError(f"'{param}': {message}" if param else message, param=param)


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate ``body`` (already-decoded JSON) against ``model``; a 400 ``ApiError`` if it does not fit."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise api_error(model, exc, body) from None
