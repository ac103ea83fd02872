"""``trillm`` command line: ``serve`` (embedded Hypercorn) and ``bench``.

Every ``serve`` flag comes from a setting's declaration (``EngineConfig`` and
``ServerConfig``), so flags, variables, ``--help`` and the README agree.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from functools import partial
from typing import Any

import trio

from trillm.api.drain import shutdown_on_signals
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
    """Serve until SIGINT/SIGTERM; then drain (``trillm.api.drain``): refuse new work, let running
    requests finish up to ``--shutdown-timeout``, end the rest with a final chunk, and return.

    The engine is stopped before Hypercorn, so every stream gets its last
    chunk and ``[DONE]`` before the connections close.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.graceful_timeout = 5

    drain = app.extensions["trillm_drain"]
    stop_serving = trio.Event()
    ports: set[int] = set()
    print(
        f"[trillm] serving {app.extensions['trillm_model_name']} on http://{host}:{port}", file=sys.stderr, flush=True
    )
    async with trio.open_nursery() as nursery:
        stop_engine = app.extensions["trillm_host"].stop
        await nursery.start(partial(shutdown_on_signals, drain, stop_engine, stop_serving, lambda: ports, config))

        async def run_hypercorn(task_status: trio.TaskStatus[list[str]]) -> None:
            trigger = stop_serving.wait
            await hypercorn_serve(
                drain.track(app), config, shutdown_trigger=trigger, task_status=task_status, mode="asgi"
            )
            nursery.cancel_scope.cancel()  # Hypercorn has returned: the shutdown task is done

        binds = await nursery.start(run_hypercorn)
        ports.update(int(bind.rsplit(":", 1)[1]) for bind in binds)


def exit_now() -> None:
    """Exit 0 once the server has stopped, skipping the interpreter's teardown: every request has
    ended and every connection is closed, and tearing down the loaded model took seconds (C
    destructors) that a deploy waits for and nothing gains from."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
        exit_now()
    elif args.command == "bench":
        from trillm.bench.run import run_bench

        run_bench(args)


if __name__ == "__main__":
    main()
