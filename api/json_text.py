"""The one way replies become JSON text: never ``NaN`` or ``Infinity``, which are not JSON.

Python's ``json`` writes bare ``NaN``/``Infinity`` by default, and a strict parser
(``JSON.parse``, Go, serde) rejects the whole reply for it. Numbers that may be
non-finite are clamped where they are made (``api/logprobs.py``); this is the net
under them: a non-finite number that still reaches a writer becomes ``null``, and
is logged, rather than breaking the reply.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

log = logging.getLogger("trillm.api")

_COMPACT = (",", ":")


def dumps(payload: Any, *, compact: bool = False) -> str:
    """``payload`` as strict JSON text (non-ASCII kept as is); ``compact``: no spaces (SSE)."""
    separators = _COMPACT if compact else None
    try:
        return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=separators)
    except ValueError:
        log.warning("a reply held a non-finite number; it is written as null")
        return json.dumps(finite(payload), ensure_ascii=False, allow_nan=False, separators=separators)


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
