"""A real Hypercorn server on 127.0.0.1 (port 0) around a real engine, for end-to-end tests."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import openai
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from trillm.api.app import create_app
from trillm.api.settings import ServerConfig
from trillm.engine.engine import Engine

from tests.helpers import all_tasks, make_engine, wait_idle


@attrs.frozen
class Server:
    url: str  # http://127.0.0.1:PORT
    port: int
    engine: Engine
    app: Any = None  # the QuartTrio app: its AppState is ``app.extensions["trillm"]``

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


@asynccontextmanager
async def running_server(
    model_parts,
    request_timeout: float | None = None,
    reasoning_parser: str | None = None,
    server: ServerConfig | None = None,
    send_buffer: int | None = None,
    **engine_overrides,
) -> AsyncIterator[Server]:
    """Serve until the block ends; then the engine must be idle and everything stops.

    ``server``: the HTTP settings (default: ``request_timeout`` and ``reasoning_parser`` alone).
    ``send_buffer``: the kernel's send buffer of each connection, in bytes (the default grows to
    megabytes on loopback, so a client that stops reading would block the server's sends late)."""
    engine = make_engine(model_parts, **engine_overrides)
    settings = server or ServerConfig(request_timeout=request_timeout, reasoning_parser=reasoning_parser)
    app = create_app(engine=engine, server=settings)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    if send_buffer is not None:  # accepted connections inherit the listener's buffer sizes
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        listener.bind(("127.0.0.1", 0))
        config.bind = [f"fd://{listener.detach()}"]  # Hypercorn owns (and closes) it
    config.accesslog = None
    config.graceful_timeout = 2
    shutdown = trio.Event()
    before = all_tasks()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config, shutdown_trigger=shutdown.wait))
        url = binds[0]
        yield Server(url, int(url.rsplit(":", 1)[1]), engine, app)
        await wait_idle(engine)
        shutdown.set()
    assert not engine.is_running
    leaked = all_tasks() - before
    assert not leaked, f"tasks outlived the server: {[t.name for t in leaked]}"


MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


async def in_thread(fn, *args, **kwargs):
    """The sync openai client runs in a thread so the server keeps the event loop."""
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))
