"""The front door: what every request passes before a handler sees it, wired in by ``install``.

In order: the request gets its id (``X-Request-Id``, echoed on every response,
errors too); then its API key is checked (``auth``); a generation request then
takes one of its key's slots (``--max-concurrent-per-key``); CORS headers are
added on the way out (``quart-cors``; preflights are answered by Quart's
automatic ``OPTIONS`` response, so they reach neither a handler nor the engine).

A slot is taken in a ``before_request`` hook, so a refusal is an ordinary
error response with every header, and given back by a thin wrapper around the
ASGI app when the whole exchange is over: the stream has ended, the client
went away, or the handler was cancelled, whichever comes first.
"""

from __future__ import annotations

import contextvars
import logging
import uuid
from collections import Counter
from typing import Any, cast

import attrs
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from quart import Response, request
from quart_cors import cors
from quart_trio import QuartTrio

from trillm.api.auth import ApiKeys, presented_key
from trillm.api.errors import ApiError
from trillm.api.settings import ServerConfig

log = logging.getLogger("trillm.api")

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID = 128
GENERATION_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/rerank",
        "/v2/rerank",
        "/rerank",
        "/v1/score",
        "/score",
    }
)
_SLOT = "trillm.slot"  # the request's ASGI scope holds its slot here until the exchange ends
_REQUEST_ID = "trillm.request_id"

# The id of the request the current task serves, for log lines written far from the
# handler (``submission.submit_choices`` logs which engine requests it became).
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("trillm_request_id", default=None)


def request_id_from(header: str | None) -> str:
    """The client's id when it is printable ASCII of at most 128 characters, else a fresh one."""
    if header and len(header) <= MAX_REQUEST_ID and header.isascii() and header.isprintable():
        return header
    return uuid.uuid4().hex


@attrs.define(eq=False)
class Slot:
    """One request's place in its key's count; ``release`` is idempotent and never blocks."""

    limiter: KeyLimiter
    key: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limiter.release(self.key)


@attrs.define
class KeyLimiter:
    """How many generation requests each key has in flight, against ``limit`` (None: no limit)."""

    limit: int | None
    in_flight: Counter[int] = attrs.field(factory=Counter)

    def acquire(self, key: int) -> Slot | None:
        """A slot for ``key``, or a 429 ``rate_limit_exceeded`` when it has ``limit`` already."""
        if self.limit is None:
            return None
        if self.in_flight[key] >= self.limit:
            raise ApiError(
                f"Too many concurrent requests for this API key: at most {self.limit} may be in flight at once "
                "(--max-concurrent-per-key). Retry when one of them has finished.",
                429,
                code="rate_limit_exceeded",
                type="requests",
                headers={"Retry-After": "1"},
            )
        self.in_flight[key] += 1
        return Slot(self, key)

    def release(self, key: int) -> None:
        self.in_flight[key] -= 1
        if self.in_flight[key] <= 0:
            del self.in_flight[key]

    def total(self) -> int:
        """Requests holding a slot now, over every key."""
        return sum(self.in_flight.values())


def _state(scope: Scope) -> dict[str, Any]:
    """The ASGI scope as the plain dict it is: the front door keeps its per-request state there."""
    return cast(dict[str, Any], scope)


def _releasing_slots(asgi_app: Any) -> Any:
    """The ASGI app, giving back the request's slot however the exchange ends (even cancelled)."""

    async def app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        try:
            await asgi_app(scope, receive, send)
        finally:
            slot = _state(scope).get(_SLOT)
            if slot is not None:
                slot.release()

    return app


def install(app: QuartTrio, server: ServerConfig, keys: ApiKeys) -> KeyLimiter:
    """Wire the front door into ``app``; returns the limiter (tests read its counts)."""
    limiter = KeyLimiter(server.max_concurrent_per_key if keys.enabled else None)

    @app.before_request
    async def identify() -> None:
        request_id = request_id_from(request.headers.get(REQUEST_ID_HEADER))
        _state(request.scope)[_REQUEST_ID] = request_id
        current_request_id.set(request_id)

    @app.before_request
    async def authorize() -> None:
        if not keys.needs_key(request.method, request.path):
            return
        key = keys.check(presented_key(request.headers.getlist("Authorization"), request.headers.getlist("x-api-key")))
        if request.method == "POST" and request.path in GENERATION_PATHS:
            _state(request.scope)[_SLOT] = limiter.acquire(key)

    @app.after_request
    async def echo_request_id(response: Response) -> Response:
        request_id = _state(request.scope).get(_REQUEST_ID) or request_id_from(None)
        response.headers[REQUEST_ID_HEADER] = request_id
        return response

    if server.allowed_origins:
        cors(
            app,
            allow_origin=list(server.allowed_origins),
            allow_methods=list(server.allowed_methods),
            allow_headers=list(server.allowed_headers),
            expose_headers=[REQUEST_ID_HEADER, "Retry-After"],
        )
    app.asgi_app = _releasing_slots(app.asgi_app)  # type: ignore[method-assign]  # Quart's way to add middleware
    return limiter
