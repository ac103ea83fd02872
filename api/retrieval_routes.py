"""The routes retrieval apps call beside generation: ``/v1/embeddings``, ``/v1/rerank`` (with
its ``/rerank`` and ``/v2/rerank`` aliases, as vLLM and llama.cpp serve it) and ``/v1/score``.
Each validates and tokenizes in a worker thread, then runs every input as one batch through
the engine (``api/embeddings.py``, ``api/rerank.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import trio
from quart import Blueprint, Response

from trillm.api import embeddings, rerank
from trillm.api.app_state import app_state, json_response
from trillm.api.model_set import Served
from trillm.api.schemas.embeddings import EmbeddingsBody, parse_embeddings_request
from trillm.api.schemas.rerank import RerankBody, ScoreBody, parse_rerank_request, parse_score_request

retrieval_routes = Blueprint("retrieval", __name__)


@retrieval_routes.post("/v1/embeddings")
async def embeddings_endpoint() -> Response:
    """Each input's pooled last hidden states."""
    state = app_state()
    body = await state.json_body(EmbeddingsBody)
    state.drain.check()
    deadline = trio.current_time() + state.server.timeout_seconds
    served = await state.serve(body, deadline)
    engine, embedder = served.engine, served.embedder

    def prepare() -> tuple[EmbeddingsBody, list[list[int]]]:
        parsed = parse_embeddings_request(body)
        state.check_model(parsed.model, served)
        state.check_serving(served)
        embedder.check_dimensions(parsed.dimensions)
        return parsed, embeddings.prompt_ids(engine, parsed)

    parsed, prompts = await state.preparer.run(prepare)
    embeddings.check_prompts(engine, prompts)
    reply = await embeddings.embed(engine, embedder, served.name, parsed, prompts, deadline)
    served.observer.embedded(len(prompts))
    return json_response(reply)


async def _relevance(
    schema: type[Any], parse: Callable[[Any], Any], pairs_of: Callable[[Any], list[tuple[str, str]]], param: str
) -> tuple[Any, Served, list[float], int]:
    """Rerank's and score's one path: the body parsed, its (query, document) pairs scored by the
    model it names; ``param``: the field a pair over the context is blamed on."""
    state = app_state()
    body = await state.json_body(schema)
    state.drain.check()
    deadline = trio.current_time() + state.server.timeout_seconds
    served = await state.serve(body, deadline)

    def prepare() -> tuple[Any, list[list[int]]]:
        parsed = parse(body)
        state.check_model(parsed.model, served)
        state.check_serving(served)
        return parsed, rerank.prompts(served.engine, served.scorer, pairs_of(parsed), parsed.instruction, param)

    parsed, prompts = await state.preparer.run(prepare)
    values, tokens = await rerank.scores(served.engine, served.scorer, prompts, parsed.priority, deadline)
    return parsed, served, values, tokens


@retrieval_routes.post("/v1/rerank")
@retrieval_routes.post("/v2/rerank")
@retrieval_routes.post("/rerank")
async def rerank_endpoint() -> Response:
    """The documents ordered by their relevance to the query (Cohere's and Jina's shape)."""
    parsed, served, values, tokens = await _relevance(
        RerankBody, parse_rerank_request, lambda p: [(p.query, d) for d in p.texts()], "documents"
    )
    reply = rerank.rerank_reply(served.name, parsed.texts(), values, tokens, parsed.top_n, parsed.return_documents)
    return json_response(reply)


@retrieval_routes.post("/v1/score")
@retrieval_routes.post("/score")
async def score_endpoint() -> Response:
    """Each (text_1, text_2) pair's relevance, in order (vLLM's shape)."""
    _, served, values, tokens = await _relevance(ScoreBody, parse_score_request, lambda p: p.pairs(), "text_2")
    return json_response(rerank.score_reply(served.name, values, tokens, int(time.time())))
