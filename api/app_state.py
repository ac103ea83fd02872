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
from trillm.api.endpoint import GenerationEndpoint, ServerContext
from trillm.api.engine_host import EngineHost
from trillm.api.errors import ApiError, shown
from trillm.api.input_limits import Preparer
from trillm.api.json_text import dumps
from trillm.api.metrics import metrics_registry
from trillm.api.model_set import ModelSet, Served
from trillm.api.settings import ServerConfig
from trillm.engine import Engine, ReplicaSet

VERSION = "0.1.0"
MAX_BODY_BYTES = 8 * 1024 * 1024
EXTENSION = "trillm"  # app.extensions[EXTENSION] is the app's AppState


@attrs.define(eq=False)
class AppState:
    """The engine, the HTTP settings and what the routes derive from them, built once per app."""

    engine: Engine | ReplicaSet  # the primary model's (``--model``), loaded before the server starts
    server: ServerConfig
    model_name: str  # the id clients send as ``model`` for the primary
    host: EngineHost
    models: ModelSet  # the primary and every other model served beside it
    drain: Drain  # `trillm serve` runs the drain
    registry: Any  # the Prometheus registry ``/metrics`` renders
    context: ServerContext
    chat_endpoint: GenerationEndpoint
    responses_endpoint: GenerationEndpoint
    messages_endpoint: GenerationEndpoint  # Anthropic's Messages API
    preparer: Preparer = attrs.Factory(Preparer)  # templating and tokenizing: worker threads, a few at a time
    created: int = attrs.Factory(lambda: int(time.time()))

    @classmethod
    def build(cls, engine: Engine | ReplicaSet, server: ServerConfig) -> AppState:
        model_name = server.served_model_name or engine.config.model
        found: list[ModelSet] = []  # the scrape reads the set once it exists
        registry, metrics = metrics_registry(lambda: found[0].loaded_engines() if found else [(model_name, engine)])
        primary = Served.around(model_name, engine, server, metrics)
        found.append(ModelSet(primary, server, metrics))
        return cls(
            engine=engine,
            server=server,
            model_name=model_name,
            host=primary.host,
            models=found[0],
            drain=Drain(server.shutdown_timeout),
            registry=registry,
            context=ServerContext(tool_call_parser=server.tool_call_parser, reasoning_parser=server.reasoning_parser),
            chat_endpoint=chat.endpoint(server.reasoning_parser),
            responses_endpoint=responses_api.endpoint(server.reasoning_parser),
            messages_endpoint=anthropic_api.endpoint(server.reasoning_parser),
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

    async def serve(self, body: Any, deadline: float = math.inf) -> Served:
        """The model a request body names, loaded first if need be: its ``model`` where that names
        a served model, else the primary (whose checks then refuse the name, as 404 or 400)."""
        name = body.get("model") if isinstance(body, dict) else None
        if isinstance(name, str) and name in self.models.entries:
            return await self.models.serve(name, deadline)
        return self.models.primary

    def check_model(self, name: str, served: Served | None = None) -> None:
        """A 404 ``model_not_found`` unless ``name`` is ``served``'s (the primary's by default)."""
        if name != (served or self.models.primary).name:
            self.models.entry(name)  # names another model, or none: 404 with the served names
            raise ApiError(f"the model `{shown(name)}` was not the one loaded for this request", 500)

    def check_optional_model(self, body: Any, served: Served | None = None) -> None:
        if isinstance(body, dict) and body.get("model") is not None:
            self.check_model(body["model"], served)

    async def stop_engines(self) -> None:
        """Every model's engine: the others', then the primary's (streams end, pages freed)."""
        await self.models.stop()
        await self.host.stop()

    def check_serving(self, served: Served | None = None) -> None:
        if not (served or self.models.primary).engine.is_running:
            raise ApiError("the engine is not serving (starting or shutting down)", 503, code="engine_unavailable")

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        """The card ``/v1/models`` lists for ``name`` (the primary's by default)."""
        return self.models.card(self.models.entry(name or self.model_name), self.created)


def app_state() -> AppState:
    """The state of the app serving the current request."""
    state: AppState = current_app.extensions[EXTENSION]
    return state


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(body), status=status, headers=headers, mimetype="application/json")
