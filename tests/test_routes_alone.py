"""A route module is served without ``create_app``: a bare app holding an ``AppState`` and
one blueprint answers through a real, running engine."""

from __future__ import annotations

from quart_trio import QuartTrio

from trillm.api.app_state import EXTENSION, AppState
from trillm.api.error_handlers import errors
from trillm.api.generation_routes import generation_routes
from trillm.api.settings import ServerConfig


def bare_app(engine, *blueprints) -> QuartTrio:
    app = QuartTrio(__name__)
    app.extensions[EXTENSION] = AppState.build(engine, ServerConfig())
    for blueprint in blueprints:
        app.register_blueprint(blueprint)
    return app


async def test_the_generation_routes_alone_complete_through_a_real_engine(engine):
    app = bare_app(engine, generation_routes, errors)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        body = {"model": engine.config.model, "prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0}
        reply = await client.post("/v1/completions", json={**body, "ignore_eos": True})
        assert reply.status_code == 200, await reply.get_data(as_text=True)
        answer = await reply.get_json()
        assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["text"]
        assert answer["model"] == engine.config.model
        # The error handlers' blueprint shapes a refusal; the info routes are not part of this app.
        wrong = await client.post("/v1/completions", json={**body, "model": "another-model"})
        assert wrong.status_code == 404
        assert (await wrong.get_json())["error"]["code"] == "model_not_found"
        assert (await client.get("/v1/models")).status_code == 404
