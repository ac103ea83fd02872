"""The Quart-Trio app: routes, error shapes, and the engine's lifetime.

``create_app()`` loads the model synchronously (so Hypercorn's startup timeout
never races a first-time download); the engine's actors start in the app's
startup hook inside the app's nursery and stop in its shutdown hook.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from typing import Any

import attrs
import trio
from pydantic import BaseModel
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from trillm.api import auth, chat, completions, expect_continue, front_door, request_body, responses_api, tokenize
from trillm.api import body as body_decoding
from trillm.api.asgi_guard import ConnectionGuard
from trillm.api.drain import Drain
from trillm.api.endpoint import GenerationEndpoint, ServerContext
from trillm.api.errors import ApiError, from_engine, not_found, shown
from trillm.api.input_limits import Preparer, check_counts
from trillm.api.json_text import dumps
from trillm.api.metrics import metrics_registry, render
from trillm.api.openapi import openapi_document
from trillm.api.schemas import DetokenizeBody, TokenizeBody
from trillm.api.settings import ServerConfig, config_from_env, server_config_from_env
from trillm.api.submission import check_prompt, with_grammar
from trillm.engine import (
    Engine,
    EngineConfig,
    EngineNotRunning,
    EngineObserver,
    EngineOverloaded,
    ReplicaSet,
    RequestRejected,
)

VERSION = "0.1.0"
MAX_BODY_BYTES = 8 * 1024 * 1024


class EngineHost:
    """Runs the engine in its own cancel scope so it can be stopped before the server."""

    def __init__(self, engine: Engine | ReplicaSet, observer: EngineObserver) -> None:
        self.engine = engine
        self.observer = observer
        self._scope: trio.CancelScope | None = None
        self._stopped = trio.Event()
        self.failed = trio.Event()  # the engine stopped by itself (a tensor-parallel rank died)
        self.failure: Exception | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine; if it fails, record why and set ``failed`` (``trillm serve`` then exits
        non-zero; under another ASGI server, requests get 503 from here on)."""
        try:
            with trio.CancelScope() as self._scope:
                await self.engine.run(observer=self.observer, task_status=task_status)
        except Exception as exc:
            while isinstance(exc, ExceptionGroup) and exc.exceptions:  # the engine's nursery wraps it
                exc = exc.exceptions[0]
            self.failure = exc
            logging.getLogger("trillm.engine").critical("the engine stopped: %s", exc)
            self.failed.set()
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """End every open stream (finish_reason "abort"), free all pages, wait for the actors."""
        if self._scope is not None:
            self._scope.cancel()
            await self._stopped.wait()


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(body), status=status, headers=headers, mimetype="application/json")


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
    request_timeout = server.timeout_seconds
    default_max_tokens = server.default_max_tokens
    ping_interval = server.sse_ping_interval or math.inf
    expect_continue.install()  # Hypercorn's 100 Continue only once a handler reads the body
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = server.body_timeout or None  # Quart's 408 for a body that stops arriving
    # Connections closed and recycled as they should be (Quart-Trio cut Hypercorn short): asgi_guard.py.
    app.asgi_app = ConnectionGuard(app.asgi_app)  # type: ignore[method-assign]
    model_name = server.served_model_name or engine.config.model
    registry, observer = metrics_registry(engine, model_name)
    host = EngineHost(engine, observer)
    app.extensions["trillm_host"] = host
    drain = app.extensions["trillm_drain"] = Drain(server.shutdown_timeout)  # `trillm serve` runs the drain
    app.extensions["trillm_model_name"] = model_name
    keys = auth.load_keys(server)
    auth.warn_if_open(keys, server)
    app.extensions["trillm_limiter"] = front_door.install(app, server, keys)
    created = int(time.time())
    context = ServerContext(tool_call_parser=server.tool_call_parser, reasoning_parser=server.reasoning_parser)
    chat_endpoint = chat.endpoint(server.reasoning_parser)
    responses_api_endpoint = responses_api.endpoint(server.reasoning_parser)
    preparer = Preparer()  # templating and tokenizing: worker threads, a few at a time

    @app.before_serving
    async def start_engine() -> None:
        # The model, tokenizer and modules live as long as the server: out of the cyclic GC's reach, so a
        # full collection (set off by one large body's objects) walks only what requests made, not ~400,000
        # long-lived objects, which held the GIL for a second on a 2-core machine.
        # Collected first: what is frozen is never collected, and garbage frozen with it (an engine an
        # earlier app in this process left in a cycle: its whole KV pool) would stay for good.
        gc.collect()
        gc.freeze()
        await app.nursery.start(host.run)

    @app.after_serving
    async def stop_engine() -> None:
        try:
            await host.stop()
        finally:  # even when the stop is cancelled: frozen, this engine could never be collected
            gc.unfreeze()

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
        codes = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}
        code = codes.get(status)
        message = exc.description or exc.name
        if status == 413:
            message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
        headers = {}
        if isinstance(exc, MethodNotAllowed) and exc.valid_methods:  # RFC 9110: a 405 says what is allowed
            headers["Allow"] = ", ".join(sorted(exc.valid_methods))
        return _json(ApiError(message, status, code=code).body(), status, headers)

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        app.logger.exception("unexpected error")
        return _json(ApiError(f"internal error: {type(exc).__name__}", 500).body(), 500)

    async def json_body(schema: type[BaseModel] | None = None) -> Any:
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
        return await preparer.run(lambda: body_decoding.decode(data, schema))

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(
                f"The model `{shown(name)}` does not exist or you do not have access to it "
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

    def prepare(endpoint: GenerationEndpoint, body: Any) -> tuple[Any, list[list[int]]]:
        """Validate, template and tokenize; in a worker thread (a big input costs seconds of CPU)."""
        check_counts(body, engine.max_model_len)  # 100,000 messages: refused before validating them
        req = endpoint.parse(body)
        req = attrs.evolve(req, common=req.common.capped(default_max_tokens))
        check_model(req.common.model)
        check_serving()
        req = endpoint.bind(engine, req, context)
        engine.check_params(req.common.params)
        return req, endpoint.prompt_ids(engine, req)

    async def generation(endpoint: GenerationEndpoint) -> Response:
        """The one path of every generation endpoint: validate, check limits, then reply or stream."""
        body = await json_body(endpoint.schema)
        drain.check()  # after reading the body, so the connection stays usable for the client's next request
        req, prompts = await preparer.run(lambda: prepare(endpoint, body))
        for ids in prompts:
            check_prompt(engine, ids, endpoint.prompt_param(req), req.common)
        if req.common.grammar is not None:
            req = await with_grammar(engine, req)
        deadline = trio.current_time() + request_timeout
        if not req.common.stream:
            return _json(await endpoint.complete(engine, model_name, req, prompts, deadline))
        # Before the stream starts, so a full queue is a real 503 rather than an error event in a 200 stream.
        engine.check_capacity(len(prompts) * req.common.n)
        return sse_response(endpoint.events(engine, model_name, req, prompts, deadline, ping_interval))

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
        body = await json_body(TokenizeBody)
        check_optional_model(body)
        return _json(await preparer.run(lambda: tokenize.tokenize(engine, body)))

    @app.post("/detokenize")
    async def detokenize_endpoint() -> Response:
        body = await json_body(DetokenizeBody)
        check_optional_model(body)
        return _json(await preparer.run(lambda: tokenize.detokenize(engine, body)))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return _json(tokenize.tokenizer_info(engine))

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
