"""ASGI middleware that lets Hypercorn finish its connection bookkeeping under Quart-Trio.

Why it exists (the upstream report is ``docs/upstream.md``): Hypercorn runs a
connection's end-of-response work (recycle the HTTP/1.1 connection and start
its keep-alive timer, or close it for ``Connection: close``) inside the app's
last ``send``, and on the way it hands the app ``http.disconnect``. Quart-Trio's
receiving task then cancels the request's nursery, which cancels that very
``send`` half-way: the keep-alive timer never starts and the close never
happens, so every connection that carried a response stays open for good.

``ConnectionGuard`` fixes it from outside both libraries:

- the app sees ``http.disconnect`` only once its ``send`` in flight has
  returned, never in the middle of one, so Hypercorn's work runs to its end;
- a response that is ready before the request's body has arrived (a 404, 405
  or 413 answered from the headers) waits briefly for a small remaining body,
  so the connection can be reused; otherwise it carries ``Connection: close``
  and Hypercorn closes it, instead of leaving the next request unanswered.

An ``Expect: 100-continue`` request answered before its handler asked for the
body (``expect_continue``: a 401) closes its connection, without waiting for a
body the client was never asked to send.

It merges repeated slashes in the path (``/v1//models`` is ``/v1/models``), as
nginx does by default: Werkzeug would answer a 308 redirect with an HTML body,
which no API client follows or reads.

It also serves a ``root_path`` (``--root-path``) both ways: Hypercorn passes the
request's path as it came while Quart routes only paths under ``root_path``, so
a proxy that strips the prefix (as uvicorn and vLLM expect) would get 404s;
such a path gets the prefix put back, as uvicorn does.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

from trillm.api.expect_continue import SEND_CONTINUE

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]  # Quart types its own with Hypercorn's TypedDicts

DRAIN_BYTES = 64 * 1024  # most unread body worth reading to keep a connection
DRAIN_SECONDS = 1.0  # most time an early response waits for the rest of a body
_SLASHES = re.compile("//+")
_RAW_SLASHES = re.compile(b"//+")


class ConnectionGuard:
    """Wraps an ASGI app (``app.asgi_app = ConnectionGuard(app.asgi_app)``); other scopes pass through."""

    def __init__(self, app: ASGIApp, drain_bytes: int = DRAIN_BYTES, drain_seconds: float = DRAIN_SECONDS) -> None:
        self.app = app
        self.drain_bytes = drain_bytes
        self.drain_seconds = drain_seconds

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:  # typed as the app it stands for
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if "//" in scope["path"]:
            raw = _RAW_SLASHES.sub(b"/", scope.get("raw_path") or scope["path"].encode())
            scope = {**scope, "path": _SLASHES.sub("/", scope["path"]), "raw_path": raw}
        root = scope.get("root_path", "")
        if root and scope["path"] != root and not scope["path"].startswith(root + "/"):
            scope = {**scope, "path": root + scope["path"], "raw_path": root.encode() + scope.get("raw_path", b"")}
        exchange = _Exchange(scope, receive, send, self.drain_bytes, self.drain_seconds)
        await self.app(scope, exchange.receive, exchange.send)


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body's length from the request headers: 0 for none, None when chunked or unreadable."""
    length = 0
    for name, value in headers:
        name = name.lower()
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return None
    return length


class _Exchange:
    """One request/response on a connection, seen from between the server and the app."""

    def __init__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send, drain: int, wait: float) -> None:
        self._receive = receive
        self._send = send
        self._drain = drain
        self._wait = wait
        self._declared = _declared_length(scope.get("headers", []))
        self._received = 0
        # HTTP/2 and 3 streams end on their own (and forbid ``Connection``): nothing to wait for.
        self.body_complete = self._declared == 0 or not str(scope.get("http_version", "1.1")).startswith("1")
        self._settled = trio.Event()  # body complete, client gone, or more body than worth draining
        if self.body_complete:
            self._settled.set()
        self._sending = False
        self._sent = trio.Event()
        # ``Expect: 100-continue``: whether the app has asked for the body yet (``expect_continue``)
        self._body_unasked = False
        extensions = scope.get("extensions") or {}
        if (send_continue := extensions.get(SEND_CONTINUE)) is not None:
            self._body_unasked = True

            async def asked() -> None:
                self._body_unasked = False
                await send_continue()

            extensions[SEND_CONTINUE] = asked

    async def receive(self) -> Message:
        """The server's next message; ``http.disconnect`` is held back while a ``send`` is in flight.

        Cancelled while waiting: nothing is lost (the message stays with the server, or, when held
        back, it is the last one of the exchange anyway)."""
        message = await self._receive()
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.body_complete = True
                self._settled.set()
            elif self._received > self._drain:
                self._settled.set()
        elif message["type"] == "http.disconnect":
            self._settled.set()
            if self._sending:  # wait for this send only: a streaming app keeps sending
                await self._sent.wait()
        return message

    async def send(self, message: Message) -> None:
        """Pass ``message`` to the server; a response start first waits for a small unread body.

        Cancelled: as the server's ``send`` (Hypercorn shields its socket writes)."""
        if message["type"] == "http.response.start" and not self.body_complete:
            message = await self._before_early_response(message)
        self._sending = True
        self._sent = trio.Event()
        try:
            await self._send(message)
        finally:
            self._sending = False
            self._sent.set()

    async def _before_early_response(self, message: Message) -> Message:
        """Let the rest of a small body arrive (up to the drain time); else ask to close the connection."""
        unread = None if self._declared is None else self._declared - self._received
        # A body never asked for (``Expect: 100-continue``) may come or not: no wait, the connection closes.
        if not self._body_unasked and (unread is None or unread <= self._drain):
            with trio.move_on_after(self._wait):
                await self._settled.wait()
        if self.body_complete:
            return message
        headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
        return {**message, "headers": [*headers, (b"connection", b"close")]}
