"""Graceful drain: on SIGTERM/SIGINT stop admitting, let running requests finish, then stop, bounded.

The phases (``shutdown_on_signals``, run beside Hypercorn by ``trillm serve``):

1. The first signal starts the drain: new generation requests get a 503
   ``server_draining`` with ``Retry-After`` and ``/health`` a 503 with ``"status":
   "draining"`` (a load balancer's readiness probe takes the server out), while
   the listener stays open so that clients still routed here get an answer rather
   than a refused connection. Every HTTP request that arrived before the drain runs
   on, for up to ``timeout`` seconds.
2. Then (or at once when they are all done, or on a second signal) the engine
   stops: streams still open get their final chunk and ``[DONE]``, every page is
   freed. Hypercorn's shutdown trigger fires: the listener closes and open
   connections get ``graceful`` seconds to take their last bytes.
3. A connection still open after that (a client that stopped reading: Hypercorn
   sends inside a shielded scope, so no cancellation ends that send) is shut
   down at the socket, which fails the send; should anything still hold the
   process a few seconds later, it exits anyway. Shutdown is bounded whatever
   clients do.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio
from hypercorn.config import Config

from trillm.api.errors import ApiError

log = logging.getLogger("trillm.api")

RETRY_AFTER_SECONDS = 1  # a client's retry should reach another replica, through the load balancer
LAST_RESORT_SECONDS = 5.0  # after connections are shut down, how long before the process exits anyway
HURRIED_GRACE_SECONDS = 1.0  # after a second signal, Hypercorn's graceful_timeout: connections' last bytes

Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


@attrs.define(eq=False)
class Drain:
    """Whether the server still admits work, and how many HTTP requests that it admitted are open.

    The app checks it (``check``, ``health_error``); the signal task sets it; ``track``
    wraps the ASGI app to count requests from arrival until their response is sent.
    """

    timeout: float  # seconds running requests may take once the drain starts (``--shutdown-timeout``)
    draining: bool = False
    in_flight: int = 0  # HTTP requests that arrived before the drain and are not done
    _idle: trio.Event = attrs.field(factory=trio.Event)

    def begin(self) -> None:
        self.draining = True
        if self.in_flight == 0:
            self._idle.set()

    def error(self) -> ApiError:
        return ApiError(
            "the server is shutting down and accepts no new requests; retry (another replica will answer)",
            503,
            code="server_draining",
            # A client's retry opens a new connection, which the load balancer sends elsewhere.
            headers={"Retry-After": str(RETRY_AFTER_SECONDS), "Connection": "close"},
        )

    def check(self) -> None:
        """Raise the 503 ``server_draining`` once the drain has begun."""
        if self.draining:
            raise self.error()

    def health(self) -> dict[str, Any] | None:
        """``/health``'s 503 body while draining (the error shape plus ``"status": "draining"``), else None."""
        if not self.draining:
            return None
        return {"status": "draining", **self.error().body()}

    async def wait_idle(self) -> None:
        """Return once every request that arrived before the drain is done (call after ``begin``)."""
        await self._idle.wait()

    def track(self, app: Asgi) -> Asgi:
        """``app`` counting its HTTP requests that arrive before the drain, until each returns
        (its response sent, or its client gone); those arriving later are only refused, so not waited for."""

        async def tracked(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http" or self.draining:
                await app(scope, receive, send)
                return
            self.in_flight += 1
            try:
                await app(scope, receive, send)
            finally:
                self.in_flight -= 1
                if self.in_flight == 0 and self.draining:
                    self._idle.set()

        return tracked


async def _first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return when the first of ``waits`` returns, cancelling the others."""
    async with trio.open_nursery() as nursery:
        for wait in waits:

            async def run(wait: Callable[[], Awaitable[object]] = wait) -> None:
                await wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(run)


def _say(message: str) -> None:
    print(f"[trillm] {message}", file=sys.stderr, flush=True)


async def shutdown_on_signals(
    drain: Drain,
    stop_engine: Callable[[], Awaitable[None]],
    stop_serving: trio.Event,
    ports: Callable[[], set[int]],
    hypercorn: Config,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Wait for SIGTERM or SIGINT, drain, stop the engine, set ``stop_serving`` (Hypercorn's
    shutdown trigger), then bound what follows (see the module's docstring).

    Cancel it once Hypercorn has returned. ``ports``: the ports the server listens on
    (whose connections phase 3 shuts down); ``hypercorn``: its config, whose ``graceful_timeout``
    (read when the trigger fires) a second signal shortens.
    """
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()

        async def next_signal() -> None:
            await signals.__anext__()

        await next_signal()
        drain.begin()
        _say(f"draining: {drain.in_flight} requests may run up to {drain.timeout:g} s; a second signal ends now")
        hurried = False

        async def hurry() -> None:
            nonlocal hurried
            await next_signal()
            hurried = True

        with trio.move_on_after(drain.timeout) as waited:
            await _first_of(drain.wait_idle, hurry)
        if waited.cancelled_caught or hurried:
            _say(f"shutting down: ending {drain.in_flight} open requests with a final chunk")
        else:
            _say("shutting down: every request has finished")
        await stop_engine()
        if hurried:
            hypercorn.graceful_timeout = min(hypercorn.graceful_timeout, HURRIED_GRACE_SECONDS)
        stop_serving.set()
        with trio.move_on_after(hypercorn.graceful_timeout + 0.5):
            await next_signal()
        count = shut_down_connections(ports())
        _say(f"shut down {count} connections whose clients did not take their last bytes")
        with trio.move_on_after(LAST_RESORT_SECONDS):
            await next_signal()
        _say("still not stopped; exiting now")
        os._exit(1)


def shut_down_connections(ports: set[int]) -> int:
    """``shutdown(SHUT_RDWR)`` every accepted TCP connection of this process to one of ``ports``.

    A task blocked sending to such a socket wakes with a broken pipe (a send
    Hypercorn shields from cancellation included). The descriptors stay open: their
    owners close them. Linux (``/proc/self/fd``) or ``/dev/fd``; returns how many.
    """
    folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    count = 0
    for name in os.listdir(folder):
        try:
            dup = os.dup(int(name))
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
        try:
            sock = socket.socket(fileno=dup)  # family and type read from the descriptor
        except OSError:  # not a socket
            os.close(dup)
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.getsockname()[1] not in ports:
                    continue
                sock.getpeername()  # a listener has no peer: OSError
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:
                continue
    return count
