"""``trillm`` command line: ``serve`` (embedded Hypercorn) and ``bench``.

Every ``serve`` flag comes from a setting's declaration (``EngineConfig`` and
``ServerConfig``), so flags, variables, ``--help`` and the README agree.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from trillm.api.settings import ServerConfig, config_from_env, server_config_from_env
from trillm.engine.config import EngineConfig
from trillm.engine.settings import add_arguments, overrides_from

if TYPE_CHECKING:
    from hypercorn.config import Config


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API",
        description="Serve a model over the OpenAI API. Each flag may be given instead as the "
        "environment variable named in its help; flags win.",
    )
    add_arguments(p, EngineConfig)
    add_arguments(p, ServerConfig)


def hypercorn_config(server: ServerConfig) -> Config:
    """Hypercorn's settings from ours: bind, backlog, keep-alive, TLS, HTTP/2, root path, access log.

    Hypercorn's own ``read_timeout`` stays off: it limits every read, so it would cut a long
    stream whose client sends nothing while it reads; ``--body-timeout`` is Quart's instead.
    """
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"{server.host}:{server.port}"]
    config.backlog = server.backlog
    config.keep_alive_timeout = server.keep_alive_timeout
    config.certfile = server.ssl_certfile
    config.keyfile = server.ssl_keyfile
    config.alpn_protocols = ["h2", "http/1.1"] if server.http2 else ["http/1.1"]
    config.root_path = server.root_path
    config.accesslog = server.access_log
    config.graceful_timeout = 5
    return config


async def serve(app: Any, server: ServerConfig) -> None:
    """Serve until SIGINT/SIGTERM; then end open streams with a final chunk and exit.

    The engine is stopped before Hypercorn, so every stream gets its last
    chunk and ``[DONE]`` before the connections close.
    """
    from hypercorn.trio import serve as hypercorn_serve

    config = hypercorn_config(server)

    async def shutdown_trigger() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        print("[trillm] shutting down: ending open streams", file=sys.stderr, flush=True)
        await app.extensions["trillm_host"].stop()

    scheme = "https" if config.ssl_enabled else "http"
    print(
        f"[trillm] serving {app.extensions['trillm_model_name']} on {scheme}://{server.host}:{server.port}",
        file=sys.stderr,
        flush=True,
    )
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trillm")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    from trillm.bench.run import add_parser as add_bench_parser

    add_bench_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    if args.command == "serve":
        from trillm.api.app import create_app

        engine_config = config_from_env(**overrides_from(args, EngineConfig))
        server_config = server_config_from_env(**overrides_from(args, ServerConfig))
        app = create_app(config=engine_config, server=server_config)
        trio.run(partial(serve, app, server_config))
    elif args.command == "bench":
        from trillm.bench.run import run_bench

        run_bench(args)


if __name__ == "__main__":
    main()
