"""``ConnectionGuard`` against a scripted server and app (no model, no sockets); the real server is
``tests/test_connections.py``."""

from __future__ import annotations

from typing import Any

import trio

from trillm.api.asgi_guard import ConnectionGuard


def scope(headers: list[tuple[bytes, bytes]] | None = None, http_version: str = "1.1", **extra: Any) -> dict:
    return {
        "type": "http",
        "http_version": http_version,
        "method": "POST",
        "path": "/nope",
        "raw_path": b"/nope",
        "headers": headers or [],
        **extra,
    }


class FakeServer:
    """Hypercorn's side: a receive channel, and a ``send`` that may hand the app ``http.disconnect``
    half-way through, as Hypercorn does in the app's last send."""

    def __init__(self) -> None:
        self.put, self.take = trio.open_memory_channel[dict](10)
        self.sent: list[dict] = []
        self.sent_at: list[float] = []
        self.finished_sends = 0
        self.disconnect_on_last_send = False

    async def receive(self) -> dict:
        return await self.take.receive()

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        self.sent_at.append(trio.current_time())
        if self.disconnect_on_last_send and not message.get("more_body", True):
            await self.put.send({"type": "http.disconnect"})
            await trio.sleep(0.01)  # the bookkeeping after it (keep-alive timer, close) takes a moment
        self.finished_sends += 1


async def quart_trio_like(scope: dict, receive: Any, send: Any) -> None:
    """Quart-Trio's shape: the receiving task cancels the request on ``http.disconnect``."""
    async with trio.open_nursery() as nursery:

        async def messages() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            nursery.cancel_scope.cancel()

        async def respond() -> None:
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"{}", "more_body": False})
            await trio.sleep_forever()  # Quart-Trio's handler waits to be cancelled

        nursery.start_soon(messages)
        nursery.start_soon(respond)


async def test_disconnect_during_the_last_send_waits_for_it_to_finish():
    """Regression: Quart-Trio cancelled Hypercorn's end-of-response work half-way (docs/upstream.md)."""
    for app in (quart_trio_like, ConnectionGuard(quart_trio_like)):
        server = FakeServer()
        server.disconnect_on_last_send = True
        await server.put.send({"type": "http.request", "body": b"", "more_body": False})
        with trio.fail_after(5):
            await app(scope(), server.receive, server.send)
        assert len(server.sent) == 2
        assert server.finished_sends == (2 if isinstance(app, ConnectionGuard) else 1)


async def run_early_response(headers: list, body_after: float | None, http_version: str = "1.1") -> tuple[dict, float]:
    """The app answers at once; the body (``{}``) follows after ``body_after`` seconds, or never.

    Returns the response start as the server got it, and how long after the request it came."""
    server = FakeServer()
    guard = ConnectionGuard(quart_trio_like, drain_seconds=0.5)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def body() -> None:
            if body_after is not None:
                await trio.sleep(body_after)
                await server.put.send({"type": "http.request", "body": b"{}", "more_body": False})
            await trio.sleep(1)
            await server.put.send({"type": "http.disconnect"})

        nursery.start_soon(body)
        await guard(scope(headers, http_version), server.receive, server.send)
        nursery.cancel_scope.cancel()
    return server.sent[0], server.sent_at[0] - start


async def test_early_response_waits_for_a_small_body_and_keeps_the_connection():
    start, elapsed = await run_early_response([(b"content-length", b"2")], body_after=0.1)
    assert (b"connection", b"close") not in start["headers"] and 0.05 < elapsed < 1.5


async def test_early_response_to_a_stalled_body_closes_the_connection():
    start, _ = await run_early_response([(b"content-length", b"2")], body_after=None)
    assert (b"connection", b"close") in start["headers"]


async def test_early_response_to_a_large_body_closes_the_connection_at_once():
    start, elapsed = await run_early_response([(b"content-length", b"9000000")], body_after=None)
    assert (b"connection", b"close") in start["headers"] and elapsed < 0.4


async def test_http2_responses_are_left_alone():
    """HTTP/2 streams end on their own, and ``Connection`` is not allowed there."""
    start, elapsed = await run_early_response([(b"content-length", b"2")], body_after=None, http_version="2")
    assert (b"connection", b"close") not in start["headers"] and elapsed < 0.4


async def test_root_path_is_served_with_or_without_the_prefix():
    seen: list[str] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        seen.append(scope["path"])

    guard = ConnectionGuard(app)
    for path in ("/llm/v1/models", "/v1/models"):
        await guard(scope(path=path, root_path="/llm"), FakeServer().receive, FakeServer().send)
    await guard(scope(path="/v1/models"), FakeServer().receive, FakeServer().send)
    assert seen == ["/llm/v1/models", "/llm/v1/models", "/v1/models"]
