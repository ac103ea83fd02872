"""What a grammar may ask for before it is compiled: cheap checks that bound a compile's cost.

xgrammar's compile time grows with the grammar, steeply for some shapes (a chain of
1,000 ``$ref`` took 0.8 s here, 5,000 minutes; an enum of 100,000 values 18 s), and
nothing inside it can be interrupted. So the request's constraint is measured first,
in microseconds, and one past a bound is a 400 naming the bound; only what passes
takes a compile worker. The time limit (``compiler``) catches what slips through.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import attrs

from trillm.engine.structured.spec import GrammarError, GrammarSpec

# JSON Schema keywords whose value is a count the grammar repeats up to.
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains")
# "{n}", "{n,}" and "{n,m}" in a regex or in GBNF.
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@attrs.frozen
class GrammarLimits:
    """Bounds on a constraint's source; each was chosen so that a grammar at the bound compiles
    in well under a second here (``docs/api.md`` lists them)."""

    max_source_bytes: int = 128 * 1024  # the schema / regex / grammar text, UTF-8
    max_refs: int = 256  # ``$ref`` occurrences in a schema (a 256-long chain: ~20 ms)
    max_ref_depth: int = 64  # the longest chain of ``$ref`` through ``$defs`` (recursion is fine)
    max_nesting: int = 64  # nested objects and arrays in the schema's JSON
    max_enum_values: int = 1024  # values of one ``enum``
    max_enum_total: int = 4096  # values of every ``enum`` of the schema together
    max_repeat: int = 65536  # maxLength, maxItems, ... and ``{n,m}`` in a regex or a grammar

    def check(self, spec: GrammarSpec) -> None:
        """Raise ``GrammarError`` naming the first bound ``spec`` is past; costs microseconds."""
        size = len(spec.source.encode())
        if size > self.max_source_bytes:
            raise GrammarError(f"it is {size} bytes long; the limit is {self.max_source_bytes} bytes")
        if spec.kind in ("json_schema", "structural_tag"):  # a tool set's tag holds its tools' schemas
            self._check_json(json.loads(spec.source))
        elif spec.kind in ("regex", "ebnf"):
            for match in _REPEAT.finditer(spec.source):
                for number in match.groups():
                    if number and int(number) > self.max_repeat:
                        raise GrammarError(
                            f"the repetition {match.group(0)} is past the limit of {self.max_repeat} repetitions"
                        )

    def _check_json(self, schema: Any) -> None:
        refs = enums = 0
        for node, depth in _walk(schema):
            if depth > self.max_nesting:
                raise GrammarError(f"it nests deeper than {self.max_nesting} levels")
            if not isinstance(node, dict):
                continue
            if isinstance(node.get("$ref"), str):
                refs += 1
                if refs > self.max_refs:
                    raise GrammarError(f"it has more than {self.max_refs} $ref")
            values = node.get("enum")
            if isinstance(values, list):
                enums += len(values)
                if len(values) > self.max_enum_values:
                    raise GrammarError(f"an enum has {len(values)} values; the limit is {self.max_enum_values}")
                if enums > self.max_enum_total:
                    raise GrammarError(f"its enums have more than {self.max_enum_total} values together")
            for key in _COUNTS:
                value = node.get(key)
                if isinstance(value, int | float) and value > self.max_repeat:
                    raise GrammarError(f"{key} is {value:g}; the limit is {self.max_repeat}")
        if refs:
            depth = _ref_depth(schema)
            if depth > self.max_ref_depth:
                raise GrammarError(f"it has a chain of {depth} $ref; the limit is {self.max_ref_depth}")


def _walk(value: Any) -> Iterator[tuple[Any, int]]:
    """Every object and array inside ``value`` with its depth, without recursion (a
    deeply nested request must not overflow the stack)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            yield node, depth
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            yield node, depth
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))


def _ref_depth(schema: Any) -> int:
    """The longest chain of local ``$ref`` (``#/...``) from the root, each target counted once
    on a path: a recursive schema (a tree) has a finite chain, as it compiles to a loop."""

    found: dict[str, list[str]] = {}

    def refs_in(node: Any) -> list[str]:
        return [n["$ref"] for n, _ in _walk(node) if isinstance(n, dict) and isinstance(n.get("$ref"), str)]

    def refs_of(ref: str) -> list[str]:
        if ref not in found:
            found[ref] = refs_in(target(ref))
        return found[ref]

    def target(ref: str) -> Any:
        node = schema
        if not ref.startswith("#"):
            return None
        for part in ref[1:].split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    # Iterative DFS with memo over ref strings; a ref on the current path (recursion) adds nothing.
    depth: dict[str, int] = {}
    on_path: set[str] = set()

    def visit(ref: str) -> int:
        stack: list[tuple[str, list[str]]] = [(ref, list(refs_of(ref)))]
        on_path.add(ref)
        while stack:
            current, pending = stack[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in depth and nxt not in on_path:
                    on_path.add(nxt)
                    stack.append((nxt, list(refs_of(nxt))))
                continue
            stack.pop()
            on_path.discard(current)
            children = [depth.get(r, 0) for r in refs_of(current)]
            depth[current] = 1 + max(children, default=0)
        return depth[ref]

    return max((visit(r) if r not in depth else depth[r] for r in refs_in(schema)), default=0)
