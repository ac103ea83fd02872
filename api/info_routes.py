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
    state.check_optional_model(body)
    return json_response(await state.preparer.run(lambda: tokenize.tokenize(state.engine, body)))


@info_routes.post("/detokenize")
async def detokenize_endpoint() -> Response:
    state = app_state()
    body = await state.json_body(DetokenizeBody)
    state.check_optional_model(body)
    return json_response(await state.preparer.run(lambda: tokenize.detokenize(state.engine, body)))


@info_routes.get("/tokenizer_info")
async def tokenizer_info() -> Response:
    return json_response(tokenize.tokenizer_info(app_state().engine))


@info_routes.post("/flush_cache")
async def flush_cache() -> Response:
    return json_response({"flushed_pages": app_state().engine.flush_cache()})


@info_routes.get("/v1/models")
async def models() -> Response:
    return json_response({"object": "list", "data": [app_state().model_card()]})


@info_routes.get("/v1/models/<path:model_id>")  # ids may hold slashes (``org/name``)
async def model(model_id: str) -> Response:
    state = app_state()
    state.check_model(model_id)
    return json_response(state.model_card())


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
