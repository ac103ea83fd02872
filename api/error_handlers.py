"""Every error as an OpenAI-shaped JSON body: ours (``ApiError``), the engine's refusals,
Quart's own (404, 405, 408, 413) and anything unexpected (500, logged). Under ``/v1/messages``
(Anthropic's Messages API) the same errors take Anthropic's shape and status codes."""

from __future__ import annotations

from quart import Blueprint, Response, current_app, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from trillm.api.anthropic_output import error_body, error_status, is_anthropic_path
from trillm.api.app_state import MAX_BODY_BYTES, json_response
from trillm.api.errors import ApiError, from_engine, not_found
from trillm.engine import EngineNotRunning, EngineOverloaded, RequestRejected

errors = Blueprint("errors", __name__)


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> Response:
    """The error in the shape of the API the request called."""
    headers = {**error.headers, **(headers or {})}
    if is_anthropic_path(request.path):
        return json_response(error_body(error), error_status(error), headers)
    return json_response(error.body(), error.status, headers)


@errors.app_errorhandler(ApiError)
async def api_error(exc: ApiError) -> Response:
    return error_response(exc)


@errors.app_errorhandler(RequestRejected)
@errors.app_errorhandler(EngineOverloaded)
@errors.app_errorhandler(EngineNotRunning)
async def engine_error(exc: Exception) -> Response:
    error = from_engine(exc)
    assert error is not None
    return error_response(error)


@errors.app_errorhandler(HTTPException)
async def http_error(exc: HTTPException) -> Response:
    status = exc.code or 500
    if status == 404:  # no route: an OpenAI API not served here, or an unknown URL
        return error_response(not_found(request.method, request.path))
    codes = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}
    code = codes.get(status)
    message = exc.description or exc.name
    if status == 413:
        message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
    headers = {}
    if isinstance(exc, MethodNotAllowed) and exc.valid_methods:  # RFC 9110: a 405 says what is allowed
        headers["Allow"] = ", ".join(sorted(exc.valid_methods))
    return error_response(ApiError(message, status, code=code), headers)


@errors.app_errorhandler(Exception)
async def unexpected(exc: Exception) -> Response:
    current_app.logger.exception("unexpected error")
    return error_response(ApiError(f"internal error: {type(exc).__name__}", 500))
