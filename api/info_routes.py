"""The routes that generate nothing: tokenizing, the model list, health, metrics, the OpenAPI
document, the version, and flushing the prefix cache."""

from __future__ import annotations

from quart import Blueprint, Response

from trillm.api import tokenize
from trillm.api.app_state import VERSION, app_state, json_response
from trillm.api.errors import ApiError
from trillm.api.metrics import render
from trillm.api.openapi import openapi_document
from trillm.api.schemas import DetokenizeBody, TokenizeBody

info_routes = Blueprint("info", __name__)


@info_routes.post("/tokenize")
async def tokenize_endpoint() -> Response:
    state = app_state()
    body = await state.json_body(TokenizeBody)
    served = await state.serve(body)
    state.check_optional_model(body, served)
    return json_response(await state.preparer.run(lambda: tokenize.tokenize(served.engine, body)))


@info_routes.post("/detokenize")
async def detokenize_endpoint() -> Response:
    state = app_state()
    body = await state.json_body(DetokenizeBody)
    served = await state.serve(body)
    state.check_optional_model(body, served)
    return json_response(await state.preparer.run(lambda: tokenize.detokenize(served.engine, body)))


@info_routes.get("/tokenizer_info")
async def tokenizer_info() -> Response:
    return json_response(tokenize.tokenizer_info(app_state().engine))


@info_routes.post("/flush_cache")
async def flush_cache() -> Response:
    """Every loaded model's unheld cached pages."""
    return json_response({"flushed_pages": sum(s.engine.flush_cache() for s in app_state().models.loaded)})


@info_routes.get("/v1/models")
async def models() -> Response:
    """Every model served here, loaded or not (``loaded``)."""
    state = app_state()
    return json_response({"object": "list", "data": [state.model_card(name) for name in state.models.entries]})


@info_routes.get("/v1/models/<path:model_id>")  # ids may hold slashes (``org/name``)
async def model(model_id: str) -> Response:
    return json_response(app_state().model_card(model_id))


@info_routes.post("/models/load")
async def load_model() -> Response:
    """An admin route (behind the API key): load a model now; its card."""
    state = app_state()
    name = _admin_model(await state.json_body())
    await state.models.serve(name)
    return json_response(state.model_card(name))


@info_routes.post("/models/unload")
async def unload_model() -> Response:
    """An admin route (behind the API key): unload a model now (its streams end); its card.
    ``"park": false`` lets its weights go even where ``--park-models`` would keep them."""
    state = app_state()
    body = await state.json_body()
    name = _admin_model(body)
    park = body.get("park", True)
    if not isinstance(park, bool):
        raise ApiError("`park` must be true or false", param="park")
    entry = state.models.entry(name)
    if entry.config is None:
        raise ApiError(f"`{name}` is the server's own model (--model): it is never unloaded", param="model")
    await state.models.unload(entry, park=park)
    if not park:
        state.models.drop_parked(entry)
    return json_response(state.model_card(name))


def _admin_model(body: object) -> str:
    name = body.get("model") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise ApiError('the body must be {"model": NAME}', param="model")
    return name


@info_routes.get("/health")
async def health() -> Response:
    state = app_state()
    if (draining := state.drain.health()) is not None:
        return json_response(draining, 503, state.drain.error().headers)
    if state.engine.is_running:
        return json_response({"status": "ok"})
    return json_response(ApiError("the engine is not serving", 503).body(), 503)


@info_routes.get("/metrics")
async def metrics() -> Response:
    return Response(render(app_state().registry), mimetype="text/plain; version=0.0.4")


@info_routes.get("/openapi.json")
async def openapi() -> Response:
    return json_response(openapi_document(VERSION, app_state().model_name))


@info_routes.get("/version")
async def version() -> Response:
    return json_response({"version": VERSION})
