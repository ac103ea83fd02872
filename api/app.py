"""The Quart-Trio app: routes, error shapes, and the engine's lifetime.

``create_app()`` loads the model synchronously (so Hypercorn's startup timeout
never races a first-time download); the engine's actors start in the app's
startup hook inside the app's nursery and stop in its shutdown hook.
"""

from __future__ import annotations

import json
import time
from typing import Any

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trillm.api import chat, completions, responses_api, tokenize
from trillm.api.drain import Drain
from trillm.api.endpoint import GenerationEndpoint, ServerContext
from trillm.api.errors import ApiError, from_engine, not_found
from trillm.api.metrics import metrics_registry, render
from trillm.api.openapi import openapi_document
from trillm.api.settings import ServerConfig, config_from_env, server_config_from_env
from trillm.api.submission import check_prompt, with_grammar
from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine
from trillm.engine.errors import EngineNotRunning, EngineOverloaded, RequestRejected
from trillm.engine.scheduling.telemetry import EngineObserver

VERSION = "0.1.0"
MAX_BODY_BYTES = 8 * 1024 * 1024


class EngineHost:
    """Runs the engine in its own cancel scope so it can be stopped before the server."""

    def __init__(self, engine: Engine, observer: EngineObserver) -> None:
        self.engine = engine
        self.observer = observer
        self._scope: trio.CancelScope | None = None
        self._stopped = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with trio.CancelScope() as self._scope:
                await self.engine.run(observer=self.observer, task_status=task_status)
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """End every open stream (finish_reason "abort"), free all pages, wait for the actors."""
        if self._scope is not None:
            self._scope.cancel()
            await self._stopped.wait()


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status=status, headers=headers, mimetype="application/json")


def create_app(
    engine: Engine | None = None, config: EngineConfig | None = None, server: ServerConfig | None = None
) -> QuartTrio:
    """The app around ``engine`` (loaded from ``config`` or ``TRILLM_*`` if not given), with the
    HTTP settings ``server`` (``TRILLM_*`` if not given)."""
    if engine is None:
        engine = Engine.load(config or config_from_env())
    if server is None:
        server = server_config_from_env()
    request_timeout = server.timeout_seconds
    default_max_tokens = server.default_max_tokens
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = None
    model_name = server.served_model_name or engine.config.model
    registry, observer = metrics_registry(engine, model_name)
    host = EngineHost(engine, observer)
    app.extensions["trillm_host"] = host
    drain = app.extensions["trillm_drain"] = Drain(server.shutdown_timeout)  # `trillm serve` runs the drain
    app.extensions["trillm_model_name"] = model_name
    created = int(time.time())
    context = ServerContext(tool_call_parser=server.tool_call_parser)
    chat_endpoint = chat.endpoint(server.reasoning_parser)
    responses_api_endpoint = responses_api.endpoint(server.reasoning_parser)

    @app.before_serving
    async def start_engine() -> None:
        await app.nursery.start(host.run)

    @app.after_serving
    async def stop_engine() -> None:
        await host.stop()

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> Response:
        return _json(exc.body(), exc.status, exc.headers)

    @app.errorhandler(RequestRejected)
    @app.errorhandler(EngineOverloaded)
    @app.errorhandler(EngineNotRunning)
    async def engine_error(exc: Exception) -> Response:
        error = from_engine(exc)
        assert error is not None
        return _json(error.body(), error.status, error.headers)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        if status == 404:  # no route: an OpenAI API not served here, or an unknown URL
            error = not_found(request.method, request.path)
            return _json(error.body(), error.status)
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
        message = exc.description or exc.name
        if status == 413:
            message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
        return _json(ApiError(message, status, code=code).body(), status)

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        app.logger.exception("unexpected error")
        return _json(ApiError(f"internal error: {type(exc).__name__}", 500).body(), 500)

    async def json_body() -> Any:
        data = await request.get_data(cache=False)
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, 5,000-digit numbers, deep nesting
            raise ApiError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(
                f"The model `{name}` does not exist or you do not have access to it "
                f"(this server serves `{model_name}`).",
                404,
                param="model",
                code="model_not_found",
                type="invalid_request_error",
            )

    def check_serving() -> None:
        if not engine.is_running:
            raise ApiError("the engine is not serving (starting or shutting down)", 503, code="engine_unavailable")

    def sse_response(events: Any) -> Response:
        response = Response(
            events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        response.timeout = None  # Quart's 60 s response timeout would cut long streams
        return response

    async def generation(endpoint: GenerationEndpoint) -> Response:
        """The one path of both generation endpoints: validate, check limits, then reply or stream."""
        body = await json_body()
        drain.check()  # read the body first, so the connection stays usable for the client's next request
        req = endpoint.parse(body)
        req = attrs.evolve(req, common=req.common.capped(default_max_tokens))
        check_model(req.common.model)
        check_serving()
        req = endpoint.bind(engine, req, context)
        prompts = endpoint.prompt_ids(engine, req)
        for ids in prompts:
            check_prompt(engine, ids, endpoint.prompt_param(req), req.common)
        if req.common.grammar is not None:
            req = await with_grammar(engine, req)
        deadline = trio.current_time() + request_timeout
        if not req.common.stream:
            return _json(await endpoint.complete(engine, model_name, req, prompts, deadline))
        # Before the stream starts, so a full queue is a real 503 rather than an error event in a 200 stream.
        engine.check_capacity(len(prompts) * req.common.n)
        return sse_response(endpoint.events(engine, model_name, req, prompts, deadline))

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generation(chat_endpoint)

    @app.post("/v1/completions")
    async def completions_endpoint() -> Response:
        return await generation(completions.ENDPOINT)

    @app.post("/v1/responses")
    async def responses_endpoint() -> Response:
        return await generation(responses_api_endpoint)

    def check_optional_model(body: Any) -> None:
        if isinstance(body, dict) and body.get("model") is not None:
            check_model(body["model"])

    @app.post("/tokenize")
    async def tokenize_endpoint() -> Response:
        body = await json_body()
        check_optional_model(body)
        return _json(tokenize.tokenize(engine, body))

    @app.post("/detokenize")
    async def detokenize_endpoint() -> Response:
        body = await json_body()
        check_optional_model(body)
        return _json(tokenize.detokenize(engine, body))

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        return _json({"flushed_pages": engine.flush_cache()})

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "trillm",
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/<path:model_id>")  # ids may hold slashes (``org/name``)
    async def model(model_id: str) -> Response:
        check_model(model_id)
        return _json(model_card())

    @app.get("/health")
    async def health() -> Response:
        if (draining := drain.health()) is not None:
            return _json(draining, 503, drain.error().headers)
        if engine.is_running:
            return _json({"status": "ok"})
        return _json(ApiError("the engine is not serving", 503).body(), 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(registry), mimetype="text/plain; version=0.0.4")

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return _json(openapi_document(VERSION, model_name))

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": VERSION})

    return app
