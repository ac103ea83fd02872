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
from typing import TYPE_CHECKING, Any

import trio

from trillm.api.drain import shutdown_on_signals
from trillm.api.settings import ServerConfig, config_from_env, server_config_from_env
from trillm.engine import EngineConfig, add_arguments, overrides_from

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


class StartupError(Exception):
    """``trillm serve`` cannot start; the message is the one line it prints."""


def bind_early(config: Config) -> None:
    """Open ``config``'s listening sockets now, before the model loads, and hand them to Hypercorn
    as ``fd://`` binds: a busy port or a bad address is one line at once, not a traceback after
    a minute of loading (``StartupError``)."""
    try:
        sockets = config.create_sockets()
    except OSError as exc:
        raise StartupError(f"cannot listen on {', '.join(config.bind)}: {exc.strerror or exc}") from None
    secure = [f"fd://{sock.detach()}" for sock in sockets.secure_sockets]
    insecure = [f"fd://{sock.detach()}" for sock in sockets.insecure_sockets]
    if config.ssl_enabled:
        config.bind, config.insecure_bind = secure, insecure
    else:
        config.bind = insecure


async def serve(app: Any, server: ServerConfig, config: Config | None = None) -> None:
    """Serve until SIGINT/SIGTERM; then drain (``trillm.api.drain``): refuse new work, let running
    requests finish up to ``--shutdown-timeout``, end the rest with a final chunk, and return.
    ``config``: Hypercorn's settings (``hypercorn_config(server)`` if not given; ``bind_early``'s).

    The engine is stopped before Hypercorn, so every stream gets its last
    chunk and ``[DONE]`` before the connections close. The "serving" line is printed once
    Hypercorn listens, with the address it listens on.
    """
    from hypercorn.trio import serve as hypercorn_serve

    from trillm.api.app_state import EXTENSION

    config = config or hypercorn_config(server)
    state = app.extensions[EXTENSION]
    drain = state.drain
    stop_serving = trio.Event()
    ports: set[int] = set()
    async with trio.open_nursery() as nursery:
        stop_engine = state.stop_engines
        await nursery.start(partial(shutdown_on_signals, drain, stop_engine, stop_serving, lambda: ports, config))

        async def run_hypercorn(task_status: trio.TaskStatus[list[str]]) -> None:
            trigger = stop_serving.wait
            await hypercorn_serve(
                drain.track(app), config, shutdown_trigger=trigger, task_status=task_status, mode="asgi"
            )
            nursery.cancel_scope.cancel()  # Hypercorn has returned: the shutdown task is done

        binds = await nursery.start(run_hypercorn)
        ports.update(int(bind.rsplit(":", 1)[1]) for bind in binds)
        model = state.model_name
        print(f"[trillm] serving {model} on {', '.join(binds)}", file=sys.stderr, flush=True)

        async def stop_when_the_engine_fails() -> None:
            await state.host.failed.wait()
            stop_serving.set()  # a dead engine serves nothing: the process ends, non-zero (``main``)

        nursery.start_soon(stop_when_the_engine_fails)


def fail_to_start(exc: Exception) -> None:
    """One line on stderr saying why ``trillm serve`` could not start or serve, then exit 1: the
    user's cure is in that line, and a traceback would bury it (it is logged at debug level)."""
    while isinstance(exc, ExceptionGroup) and exc.exceptions:  # Trio's nurseries wrap it
        exc = exc.exceptions[0]
    logging.getLogger("trillm").debug("start-up failed", exc_info=exc)
    known = isinstance(exc, StartupError | ValueError | OSError)  # refusals with their reason; else say what
    message = str(exc) if known and str(exc) else f"{type(exc).__name__}: {exc}"
    print(f"[trillm] cannot start: {' '.join(message.split())}", file=sys.stderr, flush=True)
    exit_now(1)


def exit_now(code: int = 0) -> None:
    """Exit once the server has stopped, skipping the interpreter's teardown: every request has
    ended and every connection is closed, and tearing down the loaded model took seconds (C
    destructors) that a deploy waits for and nothing gains from."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def several_models(argv: list[str]) -> list[str]:
    """``serve``'s ``--model`` given again is ``--extra-model`` (a model served beside the first);
    a first ``--model NAME=PATH`` serves PATH as NAME (``--served-model-name``)."""
    out: list[str] = []
    seen = 0
    items = iter(argv)
    for arg in items:
        flag, eq, value = arg.partition("=")
        if flag != "--model":
            out.append(arg)
            continue
        if not eq:
            value = next(items, "")
        seen += 1
        if seen > 1:
            out += ["--extra-model", value]
            continue
        name, sep, path = value.partition("=")
        if sep and name and "/" not in name:
            out += ["--model", path, "--served-model-name", name]
        else:
            out += ["--model", value]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trillm")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    from trillm.bench.options import add_parser as add_bench_parser

    add_bench_parser(sub)
    args = parser.parse_args(several_models(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    if args.command == "serve":
        from trillm.api.app import create_app
        from trillm.api.app_state import EXTENSION

        engine_config = config_from_env(**overrides_from(args, EngineConfig))
        if engine_config.node_rank > 0:  # another machine's tensor-parallel ranks: compute only
            from trillm.engine import serve_node

            serve_node(engine_config)
            exit_now()
        server_config = server_config_from_env(**overrides_from(args, ServerConfig))
        try:
            config = hypercorn_config(server_config)
            bind_early(config)
            app = create_app(config=engine_config, server=server_config)
            trio.run(partial(serve, app, server_config, config))
        except Exception as exc:
            fail_to_start(exc)
        failure = app.extensions[EXTENSION].host.failure
        if failure is not None:
            print(f"[trillm] the engine failed: {failure}; exiting with status 1", file=sys.stderr, flush=True)
        exit_now(1 if failure is not None else 0)
    elif args.command == "bench":
        from trillm.bench.run import run_bench

        run_bench(args)


if __name__ == "__main__":
    main()
