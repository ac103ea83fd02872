"""The generation routes (chat, completions, responses, messages): one path for all, which
validates, checks limits, then replies or streams (``GenerationEndpoint`` holds what differs)."""

from __future__ import annotations

from typing import Any

import attrs
import trio
from quart import Blueprint, Response

from trillm.api import anthropic_api, chat, completions
from trillm.api.app_state import AppState, app_state, json_response
from trillm.api.endpoint import GenerationEndpoint
from trillm.api.input_limits import check_counts
from trillm.api.model_set import Served
from trillm.api.schemas.anthropic import CountTokensBody, count_tokens_request
from trillm.api.submission import check_prompt, with_grammar

generation_routes = Blueprint("generation", __name__)


def sse_response(events: Any) -> Response:
    response = Response(
        events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    response.timeout = None  # Quart's 60 s response timeout would cut long streams
    return response


def prepare(state: AppState, served: Served, endpoint: GenerationEndpoint, body: Any) -> tuple[Any, list[list[int]]]:
    """Validate, template and tokenize for ``served``; in a worker thread (a big input costs seconds of CPU)."""
    engine = served.engine
    check_counts(body, engine.max_model_len)  # 100,000 messages: refused before validating them
    req = endpoint.parse(body)
    req = attrs.evolve(req, common=req.common.capped(state.server.default_max_tokens))
    state.check_model(req.common.model, served)
    state.check_serving(served)
    req = endpoint.bind(engine, req, state.context)
    engine.check_params(req.common.params)
    return req, endpoint.prompt_ids(engine, req)


async def generation(endpoint: GenerationEndpoint) -> Response:
    """The one path of every generation endpoint: validate, check limits, then reply or stream."""
    state = app_state()
    body = await state.json_body(endpoint.schema)
    state.drain.check()  # after reading the body, so the connection stays usable for the client's next request
    deadline = trio.current_time() + state.server.timeout_seconds
    served = await state.serve(body, deadline)  # the model the body names (loading it if need be)
    engine = served.engine
    req, prompts = await state.preparer.run(lambda: prepare(state, served, endpoint, body))
    prompts = [req.common.truncated(ids, engine.max_model_len) for ids in prompts]
    for ids in prompts:
        check_prompt(engine, ids, endpoint.prompt_param(req), req.common)
    if req.common.grammar is not None:
        req = await with_grammar(engine, req)
    if not req.common.stream:
        return json_response(await endpoint.complete(engine, served.name, req, prompts, deadline))
    # Before the stream starts, so a full queue is a real 503 rather than an error event in a 200 stream.
    engine.check_capacity(len(prompts) * req.common.n)
    return sse_response(endpoint.events(engine, served.name, req, prompts, deadline, state.ping_interval))


@generation_routes.post("/v1/chat/completions")
async def chat_completions() -> Response:
    return await generation(app_state().chat_endpoint)


@generation_routes.post("/v1/completions")
async def completions_endpoint() -> Response:
    return await generation(completions.ENDPOINT)


@generation_routes.post("/v1/responses")
async def responses_endpoint() -> Response:
    return await generation(app_state().responses_endpoint)


@generation_routes.post("/v1/messages")
async def messages_endpoint() -> Response:
    """Anthropic's Messages API (its errors in Anthropic's shape: ``error_handlers.py``)."""
    return await generation(app_state().messages_endpoint)


@generation_routes.post("/v1/messages/count_tokens")
async def count_tokens_endpoint() -> Response:
    """The prompt a Messages call would have, counted: ``{"input_tokens": N}``."""
    state = app_state()
    body = await state.json_body(CountTokensBody)
    served = await state.serve(body)
    engine = served.engine

    def count() -> int:
        check_counts(body, engine.max_model_len)
        parsed = count_tokens_request(body)
        state.check_model(parsed.common.model, served)
        [ids] = anthropic_api.prompt_ids(engine, chat.bind(engine, parsed, state.context))
        return len(ids)

    return json_response({"input_tokens": await state.preparer.run(count)})
