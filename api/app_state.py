"""What every route shares: one ``AppState`` per app, kept in ``app.extensions``.

The route modules (``error_handlers``, ``generation_routes``, ``info_routes``) are blueprints
that read it with ``app_state()``, so a handler can be served by any app that holds a state,
without ``create_app`` (tests/test_routes_alone.py).
"""

from __future__ import annotations

import math
import time
from typing import Any

import attrs
from pydantic import BaseModel
from quart import Response, current_app, request

from trillm.api import anthropic_api, chat, expect_continue, request_body, responses_api
from trillm.api import body as body_decoding
from trillm.api.drain import Drain
from trillm.api.embeddings import Embedder
from trillm.api.endpoint import GenerationEndpoint, ServerContext
from trillm.api.engine_host import EngineHost
from trillm.api.errors import ApiError, shown
from trillm.api.input_limits import Preparer
from trillm.api.json_text import dumps
from trillm.api.metrics import PrometheusObserver, metrics_registry
from trillm.api.rerank import Scorer
from trillm.api.settings import ServerConfig
from trillm.engine import Engine, ReplicaSet, pooling_for

VERSION = "0.1.0"
MAX_BODY_BYTES = 8 * 1024 * 1024
EXTENSION = "trillm"  # app.extensions[EXTENSION] is the app's AppState


@attrs.define(eq=False)
class AppState:
    """The engine, the HTTP settings and what the routes derive from them, built once per app."""

    engine: Engine | ReplicaSet
    server: ServerConfig
    model_name: str  # the id clients must send as ``model``
    host: EngineHost
    drain: Drain  # `trillm serve` runs the drain
    registry: Any  # the Prometheus registry ``/metrics`` renders
    observer: PrometheusObserver  # its request timings and counters
    context: ServerContext
    chat_endpoint: GenerationEndpoint
    responses_endpoint: GenerationEndpoint
    messages_endpoint: GenerationEndpoint  # Anthropic's Messages API
    embedder: Embedder  # how /v1/embeddings pools this model
    scorer: Scorer  # how /v1/rerank and /v1/score ask this model
    preparer: Preparer = attrs.Factory(Preparer)  # templating and tokenizing: worker threads, a few at a time
    created: int = attrs.Factory(lambda: int(time.time()))

    @classmethod
    def build(cls, engine: Engine | ReplicaSet, server: ServerConfig) -> AppState:
        model_name = server.served_model_name or engine.config.model
        registry, observer = metrics_registry(engine, model_name)
        return cls(
            engine=engine,
            server=server,
            model_name=model_name,
            host=EngineHost(engine, observer),
            drain=Drain(server.shutdown_timeout),
            registry=registry,
            observer=observer,
            context=ServerContext(tool_call_parser=server.tool_call_parser, reasoning_parser=server.reasoning_parser),
            chat_endpoint=chat.endpoint(server.reasoning_parser),
            responses_endpoint=responses_api.endpoint(server.reasoning_parser),
            messages_endpoint=anthropic_api.endpoint(server.reasoning_parser),
            embedder=Embedder(pooling_for(engine.config), engine.model.shape.hidden_size),
            scorer=Scorer.for_model(
                server.rerank_prompt, engine.config.model, engine.tokenizer, engine.model.classifier
            ),
        )

    @property
    def ping_interval(self) -> float:
        return self.server.sse_ping_interval or math.inf

    async def json_body(self, schema: type[BaseModel] | None = None) -> Any:
        """The decoded body (``api/body.py``: finite numbers, valid Unicode, a bad value named as
        ``schema`` names fields); gzip/deflate decoded first (``api/request_body.py``); a large one
        off the event loop."""
        coding = request_body.codings(request.headers.get("Content-Encoding"))
        if (request.content_length or 0) <= MAX_BODY_BYTES:  # else Quart's 413, the body never asked for
            await expect_continue.send_continue(request.scope)  # past the front door: now the body may come
        data: bytes
        if coding:
            data = await request_body.decode_body(request.body, coding[0], MAX_BODY_BYTES, request.body_timeout)
        else:
            data = await request.get_data(cache=False, as_text=False, parse_form_data=False)
        if len(data) <= body_decoding.LARGE_BODY:
            return body_decoding.decode(data, schema)
        return await self.preparer.run(lambda: body_decoding.decode(data, schema))

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(
                f"The model `{shown(name)}` does not exist or you do not have access to it "
                f"(this server serves `{self.model_name}`).",
                404,
                param="model",
                code="model_not_found",
                type="invalid_request_error",
            )

    def check_optional_model(self, body: Any) -> None:
        if isinstance(body, dict) and body.get("model") is not None:
            self.check_model(body["model"])

    def check_serving(self) -> None:
        if not self.engine.is_running:
            raise ApiError("the engine is not serving (starting or shutting down)", 503, code="engine_unavailable")

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "trillm",
            "max_model_len": self.engine.max_model_len,
        }


def app_state() -> AppState:
    """The state of the app serving the current request."""
    state: AppState = current_app.extensions[EXTENSION]
    return state


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(body), status=status, headers=headers, mimetype="application/json")
