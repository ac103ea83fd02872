"""Decoding a request body: JSON whose strings are valid Unicode and whose numbers are finite.

Python's JSON reader accepts ``NaN``, ``Infinity`` and ``1e999`` (an infinite
float), and ``"\\ud800"`` (a lone UTF-16 surrogate, which no UTF-8 text can hold).
Both would reach the sampler or the tokenizer and fail there as a 500, or pass
into text we echo; here they are a 400 naming the field that held them, wherever
in the body it is.

A large body is decoded in a worker thread with a Python hook per object and
per integer: the C decoder holds the GIL through one call, and those frames are
where the interpreter can hand the GIL to the event loop (every 5 ms, and at once every
thousand objects, where the hook sleeps for zero seconds), so one client's 8 MB body
does not stall ``/health`` and every stream for its whole decode.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from pydantic import BaseModel

from trillm.api.errors import ApiError
from trillm.api.schemas.describe import locate

LARGE_BODY = 256 * 1024  # bytes; below this, decoding takes well under a millisecond-scale stall

# Where a surrogate could come from in the raw bytes: a ``\uDxxx`` escape (valid pairs too: the walk
# tells them apart) or one encoded as UTF-8 (``json.loads`` decodes bytes with "surrogatepass"), whose
# lead byte is 0xED. ``bytes.find`` scans megabytes in a millisecond, a regex in tens.
_SURROGATE_HINTS = (b"\\ud", b"\\uD", b"\xed")


class _Seen:
    """What the decoder's hooks noticed, so the walk for a path runs only on bad bodies."""

    def __init__(self) -> None:
        self.non_finite = False

    def constant(self, name: str) -> float:  # NaN, Infinity, -Infinity
        self.non_finite = True
        return float(name)

    def number(self, text: str) -> float:  # 1e999 is infinite too
        value = float(text)
        if not math.isfinite(value):
            self.non_finite = True
        return value


class _Polite:
    """The object hook of a large decode: every ``every`` objects it lets go of the GIL for a moment,
    so the event loop (and the forward pass) get it at once rather than after a switch interval."""

    def __init__(self, every: int = 1000) -> None:
        self.every, self.count = every, 0

    def pairs(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        self.count += 1
        if self.count % self.every == 0:
            time.sleep(0)
        return dict(pairs)


def _int(text: str) -> int:
    return int(text)


def decode(data: bytes, schema: type[BaseModel] | None = None) -> Any:
    """The decoded body, or a 400: ``invalid_json``, or a field error for a non-finite number or a
    lone surrogate, whose ``param`` is named as ``schema``'s validation errors name it (if given).
    Synchronous and thread-safe; for a body over ``LARGE_BODY`` call it in a worker thread.
    """
    seen = _Seen()
    hooks: dict[str, Any] = {"parse_constant": seen.constant, "parse_float": seen.number}
    if len(data) > LARGE_BODY:
        hooks.update(object_pairs_hook=_Polite().pairs, parse_int=_int)
    try:
        body = json.loads(data, **hooks)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, 5,000-digit numbers, deep nesting
        raise ApiError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if seen.non_finite or any(hint in data for hint in _SURROGATE_HINTS):
        found = first_bad_value(body)
        if found is not None:
            path, problem = found
            param = (locate(schema, tuple(path))[0] if schema is not None else None) or param_of(path)
            raise ApiError(f"'{param}': {problem}" if param else f"the request body {problem}", param=param)
    return body


def _bad_string(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        return f"contains a lone UTF-16 surrogate (\\u{code:04x}), which is not valid Unicode"
    return None


def first_bad_value(body: Any) -> tuple[list[str | int], str] | None:
    """The path to the first non-finite number or string with a surrogate (document order), and what is wrong.

    Iterative: as deep as the decoder itself went, without recursion."""
    stack: list[tuple[Any, list[str | int]]] = [(body, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path, f"must be a finite number, got {json.dumps(value)}"
        if isinstance(value, str):
            problem = _bad_string(value)
            if problem is not None:
                return path, problem
        elif isinstance(value, dict):
            children: list[tuple[Any, list[str | int]]] = []
            for key, item in value.items():
                problem = _bad_string(key)
                if problem is not None:
                    return path, f"has a key that {problem}"
                children.append((item, [*path, key]))
            stack.extend(reversed(children))
        elif isinstance(value, list):
            stack.extend((item, [*path, i]) for i, item in reversed(list(enumerate(value))))
    return None


def param_of(path: list[str | int]) -> str | None:
    """A path as OpenAI's ``param`` (``messages[2].content``); it stops at a mapping keyed by token ids
    (``logit_bias``), whose keys are data, not fields."""
    text = ""
    for step in path:
        if isinstance(step, int):
            text += f"[{step}]"
        elif step.isdigit():
            break
        else:
            text = f"{text}.{step}" if text else step
    return text or None
