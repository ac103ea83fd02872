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
from typing import Any

import trio

from trillm.api.settings import ServerConfig, config_from_env, server_config_from_env
from trillm.engine.config import EngineConfig
from trillm.engine.settings import add_arguments, overrides_from


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API",
        description="Serve a model over the OpenAI API. Each flag may be given instead as the "
        "environment variable named in its help; flags win.",
    )
    add_arguments(p, EngineConfig)
    add_arguments(p, ServerConfig)


async def serve(app: Any, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM; then end open streams with a final chunk and exit.

    The engine is stopped before Hypercorn, so every stream gets its last
    chunk and ``[DONE]`` before the connections close.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.graceful_timeout = 5

    async def shutdown_trigger() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        print("[trillm] shutting down: ending open streams", file=sys.stderr, flush=True)
        await app.extensions["trillm_host"].stop()

    print(
        f"[trillm] serving {app.extensions['trillm_model_name']} on http://{host}:{port}", file=sys.stderr, flush=True
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
        trio.run(partial(serve, app, server_config.host, server_config.port))
    elif args.command == "bench":
        from trillm.bench.run import run_bench

        run_bench(args)


if __name__ == "__main__":
    main()
