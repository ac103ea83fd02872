"""A tool's ``parameters`` schema placed inside a bigger schema, its local ``$ref``s still resolving.

The generic format's grammar is one JSON schema holding every function's arguments under a
new root, where a ``#/$defs/User`` written against ``parameters`` would look for ``$defs`` at
the wrong place (pydantic writes such refs for every nested model). Each ``parameters`` goes
under the root's ``$defs`` and each local ref is rewritten to point inside it, so ``$defs``,
``definitions``, any other local JSON pointer and ``#`` (recursion to the top) keep their
meaning.
"""

from __future__ import annotations

from typing import Any

# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
# Keywords whose values map names (any name, "const" included) to schemas.
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def embedded(parameters: dict[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``parameters`` as the root's ``$defs[name]`` (returned second, rebased) and the ref to use in
    its place (returned first)."""
    base = "#/$defs/" + _escape(name)
    return {"$ref": base}, _rebased(parameters, base)


def _rebased(node: Any, base: str) -> Any:
    """A schema (or a list of schemas) with its local refs moved under ``base``."""
    if isinstance(node, list):
        return [_rebased(item, base) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):  # names are not keywords here
            out[key] = {name: _rebased(schema, base) for name, schema in value.items()}
        else:
            out[key] = _rebased(value, base)
    return out


def _escape(name: str) -> str:
    """A JSON pointer's escaping of one path segment (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")
