"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any


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


def from_engine(exc: Exception) -> ApiError | None:
    """The one place the engine's refusals become HTTP errors; None for anything else (a bug)."""
    from trillm.engine.errors import EngineNotRunning, EngineOverloaded, RequestRejected

    if isinstance(exc, ApiError):
        return exc
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
