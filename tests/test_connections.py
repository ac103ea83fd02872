"""Connections against a real ``trillm serve``, tried with raw sockets as a hostile client would.

Each test pins one way connections were left open for good (``api/asgi_guard.py``,
``docs/upstream.md``), or a burst of them lost (the listen backlog).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from functools import partial

import attrs
import httpx
import pytest
import trio
from hypercorn.trio import serve as hypercorn_serve

from trillm.api.app import create_app
from trillm.api.cli import hypercorn_config
from trillm.api.settings import ServerConfig
from trillm.bench.server_probe import wait_healthy
from trillm.engine.processes import free_port

from tests.helpers import all_tasks, make_engine, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
KEEP_ALIVE = 5.0  # the default: short ones close connections whose request is late to be read (docs/upstream.md)
BODY_TIMEOUT = 2.0


def _raise_file_limit(wanted: int) -> None:
    """Room for the flood's sockets here and in the server (which inherits the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


@attrs.frozen
class Served:
    port: int
    url: str
    proc: subprocess.Popen


def serve(*flags: str) -> Iterator[Served]:
    """``trillm serve`` on a free port with ``flags``; it must exit 0 on SIGINT afterwards."""
    _raise_file_limit(4096)
    port = free_port()
    env = {**os.environ, "TRILLM_NUM_PAGES": "256"}
    cmd = [sys.executable, "-m", "trillm.api.cli", "serve", "--port", str(port), "--dtype", "float32", *flags]
    proc = subprocess.Popen(cmd, env=env)
    scheme = "https" if "--ssl-certfile" in flags else "http"
    try:
        if scheme == "http":
            wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=180)
        yield Served(port, f"{scheme}://127.0.0.1:{port}", proc)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve("--body-timeout", str(BODY_TIMEOUT))


@attrs.frozen
class Reply:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


class Conn:
    """One raw HTTP/1.1 connection: send bytes as they are, read replies, see when the server closes."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    @classmethod
    async def open(cls, served: Served) -> Conn:
        return cls(await trio.open_tcp_stream("127.0.0.1", served.port))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _more(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise EOFError("the server closed the connection")
        self.buffer += data

    async def reply(self, timeout: float = 30) -> Reply:
        with trio.fail_after(timeout):
            while b"\r\n\r\n" not in self.buffer:
                await self._more()
            head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            status_line, *lines = head.split(b"\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in lines)}
            if headers.get(b"transfer-encoding") == b"chunked":
                while b"0\r\n\r\n" not in self.buffer:
                    await self._more()
                body, self.buffer = self.buffer.split(b"0\r\n\r\n", 1)
            else:
                length = int(headers.get(b"content-length", b"0"))
                while len(self.buffer) < length:
                    await self._more()
                body, self.buffer = self.buffer[:length], self.buffer[length:]
        return Reply(int(status_line.split()[1]), headers, body)

    async def closed_within(self, seconds: float) -> bool:
        """True once the server has closed its end, False if it is still open after ``seconds``."""
        with trio.move_on_after(seconds):
            while True:
                try:
                    await self._more()
                except (EOFError, trio.BrokenResourceError):
                    return True
        return False

    async def aclose(self) -> None:
        await self.stream.aclose()


def get(path: str, *extra: str) -> bytes:
    return "\r\n".join([f"GET {path} HTTP/1.1", "Host: x", *extra, "", ""]).encode()


def post(path: str, body: bytes, *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json", f"Content-Length: {len(body)}"]
    return "\r\n".join([*head, *extra, "", ""]).encode() + body


def completion(max_tokens: int, stream: bool = False) -> bytes:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": stream}
    return json.dumps({**body, "ignore_eos": True}).encode()


async def metric(served: Served, name: str) -> float:
    conn = await Conn.open(served)
    await conn.send(get("/metrics", "Connection: close"))
    text = (await conn.reply()).body.decode()
    await conn.aclose()
    for line in text.splitlines():
        if line.startswith(f"trillm:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} missing")


async def assert_idle(served: Served) -> None:
    """No request left running and every page free or evictable, within a few seconds."""
    with trio.fail_after(20):
        while await metric(served, "num_requests_running") or await metric(served, "num_requests_waiting"):
            await trio.sleep(0.2)
    total = await metric(served, "kv_cache_total_pages")
    assert await metric(served, "kv_cache_free_pages") + await metric(served, "kv_cache_evictable_pages") == total


async def test_connection_close_from_the_client_is_honoured(served):
    conn = await Conn.open(served)
    await conn.send(get("/health", "Connection: close"))
    reply = await conn.reply()
    assert reply.status == 200 and reply.headers[b"connection"] == b"close"
    assert await conn.closed_within(2)


async def test_idle_keep_alive_connection_is_closed_after_the_timeout(served):
    conn = await Conn.open(served)
    for _ in range(2):  # reused: keep-alive works, then the idle timer runs again
        await conn.send(get("/health"))
        assert (await conn.reply()).status == 200
    start = trio.current_time()
    assert await conn.closed_within(KEEP_ALIVE + 3)
    assert trio.current_time() - start >= KEEP_ALIVE * 0.8


async def test_stalled_body_gets_408_and_the_connection_closes(served):
    """A generation request whose body stops half-way is cut after ``--body-timeout``."""
    conn = await Conn.open(served)
    body = completion(4)
    await conn.send(post("/v1/completions", body)[: -len(body) // 2])
    start = trio.current_time()
    reply = await conn.reply(timeout=BODY_TIMEOUT + 10)
    assert reply.status == 408 and reply.headers[b"connection"] == b"close"
    assert trio.current_time() - start >= BODY_TIMEOUT * 0.8
    assert json.loads(reply.body)["error"]["code"] == "request_timeout"
    assert await conn.closed_within(2)


async def test_stalled_body_on_a_route_that_ignores_it_closes_the_connection(served):
    conn = await Conn.open(served)
    await conn.send(post("/health", b'{"x": 1}')[:-3])
    reply = await conn.reply()
    assert reply.status == 405 and reply.headers[b"connection"] == b"close"
    assert await conn.closed_within(2)


@pytest.mark.parametrize(("method", "path", "status"), [("POST", "/nope", 404), ("POST", "/health", 405)])
async def test_reply_sent_before_its_body_arrived_then_next_request_on_the_same_socket(served, method, path, status):
    """Regression: the next request on such a keep-alive connection was never answered."""
    conn = await Conn.open(served)
    await conn.send(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n".encode())
    await trio.sleep(0.2)
    await conn.send(b"{}")
    reply = await conn.reply()
    assert reply.status == status and b"connection" not in reply.headers
    await conn.send(get("/health"))
    assert (await conn.reply(timeout=5)).status == 200
    await conn.aclose()


async def test_too_large_body_gets_413_and_a_closed_connection_not_a_hang(served):
    """8 MiB are not worth reading to keep a connection: the 413 says ``Connection: close``."""
    conn = await Conn.open(served)
    await conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9000000\r\n\r\n{")
    reply = await conn.reply()
    assert reply.status == 413 and reply.headers[b"connection"] == b"close"
    assert json.loads(reply.body)["error"]["code"] == "request_too_large"
    assert await conn.closed_within(2)


async def test_flood_of_idle_connections_does_not_stop_normal_traffic(served):
    idle = [await Conn.open(served) for _ in range(500)]
    try:
        conn = await Conn.open(served)
        await conn.send(get("/health"))
        assert (await conn.reply(timeout=10)).status == 200
        await conn.send(post("/v1/completions", completion(4)))
        reply = await conn.reply(timeout=60)
        assert reply.status == 200 and json.loads(reply.body)["usage"]["completion_tokens"] == 4
        await conn.aclose()
        # The keep-alive timer closes every one of them: nothing piles up towards EMFILE.
        closed = [False] * len(idle)

        async def watch(i: int) -> None:
            closed[i] = await idle[i].closed_within(KEEP_ALIVE + 10)

        async with trio.open_nursery() as nursery:
            for i in range(len(idle)):
                nursery.start_soon(watch, i)
        assert all(closed)
    finally:
        for c in idle:
            await c.aclose()


def test_listen_backlog_is_2048_not_hypercorns_100(served):
    """The kernel's queue of connections not yet accepted (``ss`` shows it as a listener's Send-Q)."""
    try:
        out = subprocess.run(["ss", "-Hltn", f"sport = :{served.port}"], capture_output=True, text=True, check=True)
    except FileNotFoundError:
        pytest.skip("no ss command")
    with open("/proc/sys/net/core/somaxconn") as f:
        expected = min(2048, int(f.read()))
    assert [int(line.split()[2]) for line in out.stdout.splitlines()] == [expected]


async def test_burst_of_connections_after_a_storm_of_cancelled_streams_is_all_answered(served):
    """Every one of 300 new connections gets a reply (200, or 503 when the queue is full), none is dropped."""

    async def cancelled_stream(delay: float) -> None:
        conn = await Conn.open(served)
        await conn.send(post("/v1/completions", completion(200, stream=True)))
        with trio.fail_after(60):
            while b"\r\n\r\n" not in conn.buffer:  # admitted: the stream has begun
                await conn._more()
        await trio.sleep(delay)
        await conn.aclose()

    async with trio.open_nursery() as nursery:
        for i in range(100):
            nursery.start_soon(cancelled_stream, i / 200)

    statuses: list[int | str] = []

    async def one(i: int) -> None:
        request = post("/v1/completions", completion(1)) if i % 10 == 0 else get("/health", "Connection: close")
        try:
            conn = await Conn.open(served)
            await conn.send(request)
            statuses.append((await conn.reply(timeout=120)).status)
            await conn.aclose()
        except (OSError, EOFError, trio.BrokenResourceError) as exc:
            statuses.append(f"{i}: {type(exc).__name__}")

    async with trio.open_nursery() as nursery:
        for i in range(300):
            nursery.start_soon(one, i)
    assert len(statuses) == 300 and set(statuses) <= {200, 503}, [s for s in statuses if s not in (200, 503)]
    assert statuses.count(200) >= 270  # every /health
    await assert_idle(served)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1, made by the ``openssl`` command."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    cmd = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
    cmd += ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert]
    try:
        subprocess.run(cmd, check=True, capture_output=True)
    except FileNotFoundError:
        pytest.skip("no openssl command")
    return cert, key


async def test_tls_http2_root_path_and_access_log(model_parts, certificate, tmp_path):
    """The Hypercorn settings a deployment needs, as ``trillm serve`` passes them: https, h2, a path prefix, a log.

    In this process (around the session's model) rather than a second ``trillm serve``, to save a model load."""
    cert, key = certificate
    log = tmp_path / "access.log"
    settings = ServerConfig(port=0, ssl_certfile=cert, ssl_keyfile=key, root_path="/llm", access_log=str(log))
    engine = make_engine(model_parts)
    app = create_app(engine=engine, server=settings)
    shutdown = trio.Event()
    tls = ssl.create_default_context(cafile=cert)
    before = all_tasks()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(hypercorn_serve, app, hypercorn_config(settings), shutdown_trigger=shutdown.wait)
        )
        url = binds[0]
        assert url.startswith("https://")
        async with httpx.AsyncClient(base_url=url + "/llm", verify=tls, http2=True, timeout=60) as http:
            health = await http.get("/health")
            assert health.status_code == 200 and health.http_version == "HTTP/2"
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
            reply = await http.post("/v1/completions", json=body)
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
            assert (await http.get("/v1/models")).json()["data"][0]["id"] == MODEL
            # A proxy that strips the prefix, as vLLM's deployments expect, is served too.
            assert (await http.get(url + "/v1/models")).json()["data"][0]["id"] == MODEL
        with pytest.raises(httpx.TransportError):  # https only
            async with httpx.AsyncClient() as plain:
                await plain.get(url.replace("https://", "http://") + "/llm/health", timeout=5)
        await wait_idle(engine)
        shutdown.set()
    assert not engine.is_running and not all_tasks() - before
    lines = log.read_text().splitlines()
    assert any('"GET /llm/health 2" 200' in line for line in lines), lines
    assert any('"POST /llm/v1/completions 2" 200' in line for line in lines), lines
