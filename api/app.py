"""The Quart-Trio app: the routes' blueprints around one ``AppState``, and the engine's lifetime.

``create_app()`` loads the model synchronously (so Hypercorn's startup timeout
never races a first-time download); the engine's actors start in the app's
startup hook inside the app's nursery and stop in its shutdown hook. The routes
live in ``error_handlers``, ``generation_routes`` and ``info_routes``.
"""

from __future__ import annotations

import gc

from quart_trio import QuartTrio

from trillm.api import auth, expect_continue, front_door
from trillm.api.app_state import EXTENSION, MAX_BODY_BYTES, VERSION, AppState
from trillm.api.asgi_guard import ConnectionGuard
from trillm.api.engine_host import EngineHost
from trillm.api.error_handlers import errors
from trillm.api.generation_routes import generation_routes
from trillm.api.info_routes import info_routes
from trillm.api.retrieval_routes import retrieval_routes
from trillm.api.settings import ServerConfig, config_from_env, server_config_from_env
from trillm.engine import Engine, EngineConfig, ReplicaSet

__all__ = ["MAX_BODY_BYTES", "VERSION", "EngineHost", "create_app"]


def create_app(
    engine: Engine | ReplicaSet | None = None, config: EngineConfig | None = None, server: ServerConfig | None = None
) -> QuartTrio:
    """The app around ``engine`` (loaded from ``config`` or ``TRILLM_*`` if not given), with the
    HTTP settings ``server`` (``TRILLM_*`` if not given)."""
    if engine is None:
        config = config or config_from_env()
        engine = ReplicaSet(config) if config.dp > 1 else Engine.load(config)
    if server is None:
        server = server_config_from_env()
    expect_continue.install()  # Hypercorn's 100 Continue only once a handler reads the body
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = server.body_timeout or None  # Quart's 408 for a body that stops arriving
    # Connections closed and recycled as they should be (Quart-Trio cut Hypercorn short): asgi_guard.py.
    app.asgi_app = ConnectionGuard(app.asgi_app)  # type: ignore[method-assign]
    state = app.extensions[EXTENSION] = AppState.build(engine, server)
    keys = auth.load_keys(server)
    auth.warn_if_open(keys, server)
    app.extensions["trillm_limiter"] = front_door.install(app, server, keys)
    for blueprint in (errors, generation_routes, retrieval_routes, info_routes):
        app.register_blueprint(blueprint)

    @app.before_serving
    async def start_engine() -> None:
        # The model, tokenizer and modules live as long as the server: out of the cyclic GC's reach, so a
        # full collection (set off by one large body's objects) walks only what requests made, not ~400,000
        # long-lived objects, which held the GIL for a second on a 2-core machine.
        # Collected first: what is frozen is never collected, and garbage frozen with it (an engine an
        # earlier app in this process left in a cycle: its whole KV pool) would stay for good.
        gc.collect()
        gc.freeze()
        await app.nursery.start(state.host.run)
        await state.models.run(app.nursery)  # --preload, --model-ttl; the other models load on demand

    @app.after_serving
    async def stop_engine() -> None:
        try:
            await state.stop_engines()
        finally:  # even when the stop is cancelled: frozen, this engine could never be collected
            gc.unfreeze()

    return app
