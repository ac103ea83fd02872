"""Graceful drain of ``trillm serve`` on SIGTERM (``trillm.api.drain``).

Two quick tests of its parts in process (admission and counting; shutting down a
connection whose send is blocked); then ``trillm serve`` as a real process: start
it, open streams, signal it, and check what clients saw and how soon it ended.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import trio
import trio.testing

from trillm.api.drain import Drain, shut_down_connections
from trillm.api.errors import ApiError
from trillm.bench.server_probe import wait_healthy
from trillm.engine.processes import free_port

MODEL = "smollm2-135m-instruct"
GRACE = 5  # Hypercorn's graceful_timeout in ``trillm serve``


@contextmanager
def serving(shutdown_timeout: float) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    # One torch thread: on a small machine shared with other work, two OpenMP threads
    # that wait on each other made every step ~10x slower.
    env = {**os.environ, "TRILLM_NUM_PAGES": "256", "TRILLM_MAX_NUM_SEQS": "32", "TRILLM_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "trillm.api.cli", "serve", "--port", str(port), "--dtype", "float32"]
    proc = subprocess.Popen([*command, "--shutdown-timeout", str(shutdown_timeout)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=180)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_drain_refuses_after_it_begins_and_waits_only_for_requests_that_came_before():
    drain = Drain(timeout=30)
    drain.check()  # admitting
    assert drain.health() is None
    release = trio.Event()
    seen: list[str] = []

    async def app(scope, receive, send) -> None:
        seen.append(scope["path"])
        if scope["path"] == "/slow":
            await release.wait()

    tracked = drain.track(app)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tracked, {"type": "http", "path": "/slow"}, None, None)
        nursery.start_soon(tracked, {"type": "lifespan", "path": ""}, None, None)  # not a request: not counted
        await trio.testing.wait_all_tasks_blocked()
        assert drain.in_flight == 1
        drain.begin()
        with pytest.raises(ApiError) as refused:
            drain.check()
        assert refused.value.status == 503 and refused.value.code == "server_draining"
        assert refused.value.headers == {"Retry-After": "1", "Connection": "close"}
        assert drain.health() == {"status": "draining", **refused.value.body()}
        await tracked({"type": "http", "path": "/late"}, None, None)  # served (refused by the app), not waited for
        assert drain.in_flight == 1
        with trio.move_on_after(0.2) as waiting:
            await drain.wait_idle()
        assert waiting.cancelled_caught  # /slow is still running
        release.set()
        with trio.fail_after(5):
            await drain.wait_idle()
    assert drain.in_flight == 0 and sorted(seen) == ["", "/late", "/slow"]


async def test_shutting_down_a_connection_fails_a_send_blocked_on_a_client_that_does_not_read():
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listener.accept()
    other = trio.socket.socket()  # a connection to another port is left alone
    other_listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    await other.connect(other_listener.socket.getsockname())
    blocked = trio.Event()
    failed: list[BaseException] = []

    async def send_forever() -> None:
        try:
            while True:
                with trio.move_on_after(0.2) as timer:
                    await server.send_all(b"x" * 65536)
                if timer.cancelled_caught:  # the buffers are full: this send blocks
                    blocked.set()
                    with trio.CancelScope(shield=True):  # as Hypercorn sends
                        await server.send_all(b"x" * 65536)
        except trio.BrokenResourceError as exc:
            failed.append(exc)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_forever)
            await blocked.wait()
            assert shut_down_connections({port}) == 1  # the accepted socket; not the listener, not `other`
    assert failed
    other.getpeername()  # still connected
    for resource in (client, server, listener, other_listener):
        await resource.aclose()
    other.close()


class Stream(threading.Thread):
    """One streaming completion read in a thread: every ``data:`` line, and whether it began."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.body = {
            "model": MODEL,
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        self.events: list[str] = []
        self.began = threading.Event()
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url + "/v1/completions", json={**self.body, "stream": True}, timeout=120
            ) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.began.set()
        except BaseException as exc:  # reported by ``finish_reason``
            self.error = exc
            self.began.set()

    def finish_reason(self) -> str:
        """The finish_reason of the stream's last choice chunk; fails unless it ended with ``[DONE]``."""
        self.join(timeout=60)
        assert self.error is None, self.error
        assert self.events[-1] == "[DONE]", self.events[-3:]
        chunks = [json.loads(event) for event in self.events[:-1]]
        return [chunk for chunk in chunks if chunk["choices"]][-1]["choices"][0]["finish_reason"]

    def completion_tokens(self) -> int:
        """The usage chunk's count (the stream must have ended)."""
        return json.loads(self.events[-2])["usage"]["completion_tokens"]


def start_streams(url: str, count: int, max_tokens: int) -> list[Stream]:
    streams = [Stream(url, max_tokens) for _ in range(count)]
    for stream in streams:
        assert stream.began.wait(timeout=60), "a stream never began"
    return streams


def exit_code(proc: subprocess.Popen, within: float) -> int:
    return proc.wait(timeout=within)


def stuck_reader(url: str) -> socket.socket:
    """A client that sends 100 pipelined requests and reads nothing: the server's send blocks.

    Loopback buffers take ~3 MB before a send blocks, more than a stream writes in
    seconds here; 100 OpenAPI documents (~50 KB each) fill them at once. Hypercorn
    shields its sends from cancellation, so before the drain's bound such a
    client kept the process alive for good (the issue's slow-reading stream).
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 100)
    return sock


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_lets_running_streams_finish_refuses_new_requests_and_a_second_signal_ends_at_once():
    with serving(shutdown_timeout=120) as (proc, url):
        stuck = stuck_reader(url)
        long = start_streams(url, 1, max_tokens=2000)[0]  # keeps the drain going after the others
        streams = start_streams(url, 20, max_tokens=12)
        assert not any(stream.events[-1] == "[DONE]" for stream in streams), "too late: streams ended before the signal"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["status"] == "draining"
        assert health.json()["error"]["code"] == "server_draining"
        late = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503
        assert late.headers["Retry-After"] == "1"
        assert late.headers["Connection"] == "close"
        error = late.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("service_unavailable_error", None, "server_draining")
        # The running streams finish normally; the drain waits on for the long one.
        assert [stream.finish_reason() for stream in streams] == ["length"] * 20
        assert [stream.completion_tokens() for stream in streams] == [12] * 20
        time.sleep(0.5)
        assert proc.poll() is None and long.is_alive()
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # the second signal: end now, the stuck reader notwithstanding
        assert long.finish_reason() == "abort"
        assert exit_code(proc, within=20) == 0
        assert time.monotonic() - signalled < 5
        stuck.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_after_a_short_timeout_streams_end_with_a_final_chunk_and_a_stuck_reader_does_not_hold_the_exit():
    timeout = 1
    with serving(shutdown_timeout=timeout) as (proc, url):
        stuck = stuck_reader(url)
        streams = start_streams(url, 4, max_tokens=2000)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert [stream.finish_reason() for stream in streams] == ["abort"] * 4
        assert time.monotonic() - signalled < timeout + 4
        # the drain, Hypercorn's grace, then the stuck connection is shut down (at grace + 1 s)
        assert exit_code(proc, within=timeout + GRACE + 15) == 0
        assert time.monotonic() - signalled < timeout + GRACE + 4
        stuck.close()
