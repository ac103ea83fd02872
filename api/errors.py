"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

MAX_MESSAGE = 2048  # the net under ``shown``: no error message is longer
MAX_SHOWN = 64  # the longest a value the client sent is echoed in a message


def shown(value: object, limit: int = MAX_SHOWN) -> str:
    """A client's value as an error message echoes it: whole when short, else its start and its
    length (a 10 KB model name or a 4,000-digit number is not sent back whole)."""
    text = str(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 16]}... ({len(text)} characters)"


class ApiError(Exception):
    """An error the client gets back as JSON with the given HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _default_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "internal_server_error"
    return "invalid_request_error"


def context_length_error(
    max_model_len: int, prompt_tokens: int, completion_tokens: int, where: str, param: str
) -> ApiError:
    """A request over the context, worded as OpenAI words it: clients (litellm, LangChain) detect
    it by "maximum context length" in the message and ``code: "context_length_exceeded"``.
    ``where`` names the input: "messages" (chat) or "prompt" (completions)."""
    return ApiError(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{shown(prompt_tokens + completion_tokens)} tokens ({prompt_tokens} in the {where}, "
        f"{shown(completion_tokens)} in the completion). Please reduce the length of the {where} or completion.",
        param=param,
        code="context_length_exceeded",
        type="invalid_request_error",
    )


def from_engine(exc: Exception) -> ApiError | None:
    """The one place the engine's refusals become HTTP errors; None for anything else (a bug)."""
    from trillm.engine import EngineNotRunning, EngineOverloaded, PromptTooLong, RequestRejected

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, PromptTooLong):  # the handlers check first, naming their field; this is the fallback
        return context_length_error(exc.max_model_len, exc.num_prompt_tokens, 1, "prompt", "prompt")
    if isinstance(exc, RequestRejected):
        return ApiError(str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, EngineOverloaded):
        return ApiError(
            f"the server is overloaded: {exc}; retry shortly",
            503,
            code="server_overloaded",
            headers={"Retry-After": "1"},
        )
    if isinstance(exc, EngineNotRunning):
        return ApiError("the engine is not serving (starting or shutting down)", 503, code="engine_unavailable")
    return None


# OpenAI APIs this server does not implement: a 404 that says so, rather than "unknown URL".
UNSUPPORTED_APIS = {
    "/v1/audio": "the audio API",
    "/v1/images": "the images API",
    "/v1/moderations": "the moderations API",
    "/v1/files": "the files API",
    "/v1/uploads": "the uploads API",
    "/v1/batches": "the batch API",
    "/v1/fine_tuning": "the fine-tuning API",
    "/v1/fine-tunes": "the fine-tuning API",
    "/v1/assistants": "the Assistants API",
    "/v1/threads": "the Assistants API (threads)",
    "/v1/vector_stores": "the vector stores API",
    "/v1/realtime": "the Realtime API",
    "/v1/evals": "the evals API",
    "/v1/containers": "the containers API",
    "/v1/organization": "the administration API",
    "/v1/edits": "the edits API",
    "/v1/engines": "the engines API",
    "/v1/chat/completions/": "stored chat completions",  # only the exact path is a route
    "/v1/responses/": "stored responses (it stores none: send the whole conversation in 'input')",
}


def not_found(method: str, path: str) -> ApiError:
    """A 404 for a path no route serves, in OpenAI's shape: ``unsupported_endpoint`` for an
    OpenAI API this server does not implement, else ``unknown_url`` (OpenAI's own wording)."""
    for prefix, name in UNSUPPORTED_APIS.items():
        if path == prefix.rstrip("/") or path.startswith(prefix.rstrip("/") + "/"):
            return ApiError(
                f"trillm does not serve {name} ({shown(path)}); see /openapi.json for what it serves",
                404,
                code="unsupported_endpoint",
                type="invalid_request_error",
            )
    return ApiError(
        f"Unknown request URL: {shown(method)} {shown(path)}. Please check the URL for typos, "
        "or see /openapi.json for the routes this server serves.",
        404,
        code="unknown_url",
        type="invalid_request_error",
    )
