"""``Expect: 100-continue`` answered once the app asks for the body, not before it has looked.

Hypercorn's HTTP/1.1 protocol sends ``100 Continue`` as soon as it has parsed
the headers, before the app runs: a client without a key (or with a body too
large, or for an unknown path) is told to send its body, uploads it, and only
then gets its 401. uvicorn sends the 100 on the app's first ``receive``, but
Quart receives at once, whatever the handler does; so here the handler asks for
it, when it reads the body (``app.json_body`` calls ``send_continue``), after
the front door has let the request in (the upstream report is ``docs/upstream.md``).

How: the protocol's connection never reports a waiting client (so Hypercorn's
eager 100 is never sent), and the request's scope carries ``SEND_CONTINUE``, a
coroutine function that sends the 100 if the client still waits for it. A
response sent without it (the 401) closes the connection (``asgi_guard``): the
client may or may not send the body it was not asked for, and nothing tells which.
A handler that reads a body must call ``send_continue`` first, or such a client
waits for the 100 (curl sends the body anyway after a second).
"""

from __future__ import annotations

from typing import Any

import h11
import hypercorn.protocol
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream

SEND_CONTINUE = "trillm.send_100_continue"  # the scope's extension: ``await ext[SEND_CONTINUE]()``


class _Connection(h11.Connection):
    """h11's connection, except that the protocol's loop never sees a client waiting for 100."""

    @property
    def they_are_waiting_for_100_continue(self) -> bool:
        return False


class DeferredContinueProtocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol with the ``100 Continue`` left to the app's first ``receive``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection = _Connection(h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size)

    async def _create_stream(self, request: h11.Request) -> None:
        await super()._create_stream(request)
        # The app's task was only scheduled (no checkpoint since): it sees the extension.
        waiting = isinstance(self.connection, h11.Connection) and self.connection.client_is_waiting_for_100_continue
        if isinstance(self.stream, HTTPStream) and waiting:
            extensions: dict[str, Any] = self.stream.scope["extensions"]
            extensions[SEND_CONTINUE] = self._send_continue

    async def _send_continue(self) -> None:
        """Cancelled: as Hypercorn's own send of the 100 (its socket writes are shielded)."""
        connection = self.connection
        if isinstance(connection, h11.Connection) and connection.client_is_waiting_for_100_continue:
            await self._send_h11_event(
                h11.InformationalResponse(status_code=100, headers=self.config.response_headers("h11"))
            )


async def send_continue(scope: Any) -> None:
    """Tell a client waiting on ``Expect: 100-continue`` to send its body; nothing otherwise.
    Idempotent. Cancelled: the 100 is sent whole or not at all (Hypercorn shields socket writes)."""
    send = scope.get("extensions", {}).get(SEND_CONTINUE)
    if send is not None:
        await send()


def install() -> None:
    """Make every Hypercorn server in this process speak HTTP/1.1 through ``DeferredContinueProtocol``
    (``ProtocolWrapper`` looks the class up by name when a connection opens); idempotent."""
    hypercorn.protocol.H11Protocol = DeferredContinueProtocol  # type: ignore[misc]
