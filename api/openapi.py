"""``GET /openapi.json``: an OpenAPI 3.1 description whose request schemas pydantic derives from
the same declarations that validate requests, plus the response shapes the handlers build
(``reply_schemas.py``)."""

from __future__ import annotations

import copy
import functools
from typing import Any

from pydantic.json_schema import models_json_schema

from trillm.api.reply_schemas import RESPONSE_SCHEMAS
from trillm.api.schemas import PUBLISHED


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


@functools.cache
def _request_schemas() -> dict[str, Any]:
    models = [(model, "validation") for model in PUBLISHED.values()]
    refs, top = models_json_schema(models, ref_template="#/components/schemas/{model}")  # type: ignore[arg-type]
    schemas = top["$defs"]
    for name, model in PUBLISHED.items():  # published under their API names; nothing else refers to them
        schemas[name] = schemas.pop(refs[(model, "validation")]["$ref"].rsplit("/", 1)[1])  # type: ignore[index]
    return schemas


def request_schemas(model_name: str) -> dict[str, Any]:
    """Request bodies and the objects nested in them; ``model`` is declared as the one served id."""
    schemas = copy.deepcopy(_request_schemas())
    for name in (
        "ChatCompletionRequest",
        "CompletionRequest",
        "ResponsesRequest",
        "MessagesRequest",
        "CountTokensRequest",
        "EmbeddingRequest",
        "RerankRequest",
        "ScoreRequest",
    ):
        schemas[name]["properties"]["model"]["enum"] = [model_name]
    return schemas


_ERRORS = {
    str(code): {"description": text, "content": {"application/json": {"schema": _ref("Error")}}}
    for code, text in [
        (400, "invalid request"),
        (404, "unknown model, or a path not served"),
        (413, "body too large"),
        (503, "overloaded or not serving"),
        (504, "past the request deadline"),
    ]
}


def _json(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


# Anthropic's routes answer errors in its shape, a 503 as its 529.
_ANTHROPIC_ERRORS = {
    str(529 if code == 503 else code): {**error, "content": {"application/json": {"schema": _ref("AnthropicError")}}}
    for code, error in ((int(c), e) for c, e in _ERRORS.items())
}


def _post(request: str, reply: str, summary: str, stream_chunk: str | None = None) -> dict[str, Any]:
    ok = _json(reply, "the reply")
    if stream_chunk:
        events = f"with stream: true, `data: <{stream_chunk}>` events, then `data: [DONE]`"
        if stream_chunk == "typed":
            events = "with stream: true, `event: <type>` + `data: {type, ...}` events (docs/api.md)"
        ok["content"]["text/event-stream"] = {"schema": {**_SSE_EVENT, "description": events}}
    errors = _ANTHROPIC_ERRORS if request in ("MessagesRequest", "CountTokensRequest") else _ERRORS
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {"200": ok, **errors},
        }
    }


# One Server-Sent Event as a client parses it (what schemathesis checks each event against).
_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def _admin(summary: str) -> dict[str, Any]:
    body = {"type": "object", "required": ["model"], "properties": {"model": {"type": "string"}}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": _json("Model", "the model's card"), **_ERRORS},
        }
    }


def _get(reply: str, summary: str, errors: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "get": {"summary": summary, "responses": {"200": _json(reply, "the reply"), **{c: _ERRORS[c] for c in errors}}}
    }


def openapi_document(version: str, model_name: str) -> dict[str, Any]:
    requests = request_schemas(model_name)
    assert not requests.keys() & RESPONSE_SCHEMAS.keys(), "a request object named like a response"
    return {
        "openapi": "3.1.0",
        "info": {"title": "trillm", "version": version, "description": "OpenAI-compatible LLM inference server"},
        "paths": {
            "/v1/chat/completions": _post(
                "ChatCompletionRequest", "ChatCompletion", "chat completion", "ChatCompletionChunk"
            ),
            "/v1/completions": _post("CompletionRequest", "Completion", "text completion (legacy)", "Completion"),
            "/v1/responses": _post("ResponsesRequest", "Response", "a response (Responses API, stateless)", "typed"),
            "/v1/embeddings": _post("EmbeddingRequest", "EmbeddingList", "each input's pooled embedding"),
            "/v1/rerank": _post("RerankRequest", "RerankReply", "documents ranked by relevance to a query"),
            "/v1/score": _post("ScoreRequest", "ScoreReply", "each text pair's relevance"),
            "/v1/messages": _post("MessagesRequest", "MessageReply", "a message (Anthropic's Messages API)", "typed"),
            "/v1/messages/count_tokens": _post(
                "CountTokensRequest", "TokenCount", "a Messages call's prompt tokens, counted"
            ),
            "/tokenize": _post("TokenizeRequest", "Tokens", "text or messages to token ids"),
            "/detokenize": _post("DetokenizeRequest", "Text", "token ids to text"),
            "/v1/models": _get("ModelList", "the served model"),
            "/v1/models/{model}": {
                "get": {
                    "summary": "the served model's card (`client.models.retrieve`); any other id is a 404",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "enum": [model_name]},
                        }
                    ],
                    "responses": {"200": _json("Model", "the reply"), "404": _ERRORS["404"]},
                }
            },
            "/models/load": _admin("load a model now (an admin route: behind the API key)"),
            "/models/unload": _admin("unload a model now; its streams end (an admin route: behind the API key)"),
            "/flush_cache": {
                "post": {
                    "summary": "drop every cached KV page no request holds",
                    "responses": {"200": _json("Flushed", "how many pages were freed")},
                }
            },
            "/health": _get("Status", "200 while serving", ("503",)),
            "/version": _get("Version", "server version"),
            "/tokenizer_info": _get("TokenizerInfo", "the tokenizer's configuration, as vLLM's `/tokenizer_info`"),
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "Prometheus text format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "this document",
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
        "components": {"schemas": {**requests, **RESPONSE_SCHEMAS}},
    }
