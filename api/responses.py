"""Small pieces every OpenAI-style response is built from."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from trillm.api.errors import ApiError
from trillm.api.json_text import dumps

log = logging.getLogger("trillm.api")


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, prediction: tuple[int, int] | None = None
) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens`` are prompt tokens served from the prefix cache.
    ``prediction`` (a request with Predicted Outputs): its tokens, and how many of them speculation
    verified into the output; the others are ``rejected_prediction_tokens``, as OpenAI counts them."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if prediction is not None:
        predicted, accepted = prediction
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": max(0, predicted - accepted),
        }
    return body


def new_completion_id(prefix: str = "cmpl") -> str:
    """OpenAI's id forms: ``chatcmpl-…`` for chat, ``cmpl-…`` for completions."""
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event; ``payload`` is a JSON body or the literal ``[DONE]``."""
    data = payload if isinstance(payload, str) else dumps(payload, compact=True)
    return f"data: {data}\n\n".encode()


def stream_end(obj: str, completion_id: str, created: int, model: str, totals: dict[str, Any] | None) -> list[bytes]:
    """The last events of a stream: the usage chunk (``choices: []``) when asked for, then ``[DONE]``."""
    events = []
    if totals is not None:
        events.append(
            sse(
                {"id": completion_id, "object": obj, "created": created, "model": model, "choices": [], "usage": totals}
            )
        )
    return [*events, sse("[DONE]")]


def stream_failure(exc: Exception) -> list[bytes]:
    """A bug must end the stream with an error event and ``[DONE]``, not cut the connection."""
    log.exception("stream failed", exc_info=exc)
    return [sse(ApiError(f"internal error: {type(exc).__name__}", 500).body()), sse("[DONE]")]


def typed_sse(payload: dict[str, Any]) -> bytes:
    """One Server-Sent Event named by its payload's ``type`` (``event: response.created``), as
    the Responses API sends them."""
    data = dumps(payload, compact=True)
    return f"event: {payload['type']}\ndata: {data}\n\n".encode()
