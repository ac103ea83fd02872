"""The request field tables of ``docs/api.md``, generated from the declarations.

``python -m trillm.api.schemas.docs`` rewrites every table between
``<!-- fields: NAME -->`` and ``<!-- end fields -->`` in ``docs/api.md`` (or the
file given); ``--check`` only reports whether they are current. A test runs
the check, so the docs cannot drift from the code.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from pydantic import BaseModel

from trillm.api.schemas import PUBLISHED, GenerationBody
from trillm.api.schemas.describe import json_schema, phrase

DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
_SECTION = re.compile(r"(<!-- fields: (\w+) -->\n)(.*?)(<!-- end fields -->)", re.S)
_SHARED = [name for name in GenerationBody.model_fields if name != "model"]


def field_names(name: str) -> list[str]:
    """The fields a table lists: chat shows ``model``, its own fields, then the shared ones; the
    completions table only what it adds or declares anew, e.g. its own ``max_tokens`` default
    (its text points at the chat table for the rest)."""
    published: type[BaseModel] = PUBLISHED[name]  # type: ignore[assignment]
    fields = list(published.model_fields)
    if name == "ChatCompletionRequest":
        return ["model"] + [f for f in fields if f not in _SHARED and f != "model"] + _SHARED
    if name == "CompletionRequest":
        own = vars(published).get("__annotations__", {})
        return ["model"] + [f for f in fields if f not in GenerationBody.model_fields or f in own]
    return fields


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(name: str) -> str:
    model: type[BaseModel] = PUBLISHED[name]  # type: ignore[assignment]
    schema = json_schema(model)
    defs = schema.get("$defs", {})
    rows = ["| field | accepts | default | notes |", "|---|---|---|---|"]
    for field in field_names(name):
        prop = schema["properties"][field]
        if field in schema.get("required", ()):
            default = "required"
        else:
            default = "—" if prop.get("default") is None else f"`{json.dumps(prop['default'])}`"
        rows.append(f"| `{field}` | {_cell(phrase(prop, defs))} | {default} | {_cell(prop.get('description', ''))} |")
    rows.append("| any other field | anything | | accepted and ignored |")
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    """``text`` with every marked table regenerated."""
    return _SECTION.sub(lambda m: m.group(1) + table(m.group(2)) + m.group(4), text)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if a != "--check"] or [DOCS]
    stale = []
    for path in paths:
        text = path.read_text()
        if render(text) != text:
            stale.append(path)
            if not check:
                path.write_text(render(text))
    if check and stale:
        print(f"stale field tables in {', '.join(map(str, stale))}: run python -m trillm.api.schemas.docs")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
