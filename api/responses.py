"""Small pieces every OpenAI-style response is built from."""

from __future__ import annotations

import json
import uuid
from typing import Any


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` are prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def sse(payload: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event; ``payload`` is a JSON body or the literal ``[DONE]``."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()
