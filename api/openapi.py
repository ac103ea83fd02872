"""``GET /openapi.json``: an OpenAPI 3.1 description whose request schemas pydantic derives from
the same declarations that validate requests, plus the response shapes the handlers build.

Longer than our ~400-line guide, as one idea: the one document, whose reply schemas sit beside
the paths that answer with them (schemathesis checks every reply against them)."""

from __future__ import annotations

import copy
import functools
from typing import Any

from pydantic.json_schema import models_json_schema

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


_USAGE: dict[str, Any] = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        **{k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}},
    },
}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "abort", "error", None]}
_TOP: dict[str, Any] = {
    "type": "object",
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number"},
        "bytes": {"type": "array", "items": {"type": "integer"}},
    },
}
_CHAT_LOGPROBS = {
    "type": ["object", "null"],
    "properties": {
        "content": {
            "type": "array",
            "items": {**_TOP, "properties": {**_TOP["properties"], "top_logprobs": {"type": "array", "items": _TOP}}},
        }
    },
}
_LEGACY_LOGPROBS = {
    "type": ["object", "null"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        # null for an echoed prompt's first token, which nothing before it scores
        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
        "top_logprobs": {
            "type": "array",
            "items": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
        },
        "text_offset": {"type": "array", "items": {"type": "integer"}},
    },
}

_MODEL: dict[str, Any] = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": {"type": "integer"},
        "owned_by": {"type": "string"},
        "max_model_len": {"type": "integer"},
        "loaded": {"type": "boolean"},
        "load_error": {"type": "string"},
    },
}


def _envelope(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": {"anyOf": [_USAGE, {"type": "null"}]},
        },
    }


RESPONSE_SCHEMAS: dict[str, Any] = {
    "ChatCompletion": _envelope(
        "chat.completion",
        {
            "type": "object",
            "properties": {
                "index": {"type": "integer"},
                "finish_reason": _FINISH,
                "logprobs": _CHAT_LOGPROBS,
                "message": {
                    "type": "object",
                    "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
                },
            },
        },
    ),
    "ChatCompletionChunk": _envelope(
        "chat.completion.chunk",
        {
            "type": "object",
            "properties": {
                "index": {"type": "integer"},
                "finish_reason": _FINISH,
                "logprobs": _CHAT_LOGPROBS,
                "delta": {
                    "type": "object",
                    "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}},
                },
            },
        },
    ),
    "Completion": _envelope(
        "text_completion",
        {
            "type": "object",
            "properties": {
                "index": {"type": "integer"},
                "text": {"type": "string"},
                "finish_reason": _FINISH,
                "logprobs": _LEGACY_LOGPROBS,
            },
        },
    ),
    "Response": {
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "created_at": {"type": "integer"},
            "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
            "model": {"type": "string"},
            "output": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "id", "status"],
                    "properties": {
                        "type": {"enum": ["message", "function_call", "reasoning"]},
                        "id": {"type": "string"},
                        "status": {"enum": ["completed", "incomplete", "in_progress"]},
                        "content": {"type": "array", "items": {"type": "object"}},
                        "call_id": {"type": "string"},
                        "name": {"type": "string"},
                        "arguments": {"type": "string"},
                    },
                },
            },
            "usage": {
                "type": ["object", "null"],
                "properties": {
                    k: {"type": "integer", "minimum": 0} for k in ("input_tokens", "output_tokens", "total_tokens")
                },
            },
        },
    },
    "MessageReply": {
        "type": "object",
        "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "message"},
            "role": {"const": "assistant"},
            "model": {"type": "string"},
            "content": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"enum": ["text", "thinking", "tool_use"]}},
                },
            },
            "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", None]},
            "stop_sequence": {"type": ["string", "null"]},
            "usage": {
                "type": "object",
                "required": ["input_tokens", "output_tokens"],
                "properties": {
                    k: {"type": "integer", "minimum": 0}
                    for k in ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
                },
            },
        },
    },
    "EmbeddingList": {
        "type": "object",
        "required": ["object", "data", "model", "usage"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["object", "index", "embedding"],
                    "properties": {
                        "object": {"const": "embedding"},
                        "index": {"type": "integer"},
                        "embedding": {"type": ["array", "string"], "items": {"type": "number"}},
                    },
                },
            },
            "model": {"type": "string"},
            "usage": {
                "type": "object",
                "properties": {k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "total_tokens")},
            },
        },
    },
    "RerankReply": {
        "type": "object",
        "required": ["id", "model", "results", "usage"],
        "properties": {
            "id": {"type": "string"},
            "model": {"type": "string"},
            "results": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "relevance_score"],
                    "properties": {
                        "index": {"type": "integer"},
                        "relevance_score": {"type": "number", "minimum": 0, "maximum": 1},
                        "document": {"type": "object", "properties": {"text": {"type": "string"}}},
                    },
                },
            },
            "usage": {"type": "object"},
        },
    },
    "ScoreReply": {
        "type": "object",
        "required": ["id", "object", "model", "data", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "list"},
            "model": {"type": "string"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "object", "score"],
                    "properties": {
                        "index": {"type": "integer"},
                        "object": {"const": "score"},
                        "score": {"type": "number", "minimum": 0, "maximum": 1},
                    },
                },
            },
            "usage": {"type": "object"},
        },
    },
    "TokenCount": {
        "type": "object",
        "required": ["input_tokens"],
        "properties": {"input_tokens": {"type": "integer", "minimum": 0}},
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            },
        },
    },
    "Tokens": {
        "type": "object",
        "required": ["tokens", "count", "max_model_len"],
        "properties": {
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "count": {"type": "integer"},
            "max_model_len": {"type": "integer"},
        },
    },
    "Text": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    "Model": _MODEL,
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}},
    },
    "Status": {"type": "object", "properties": {"status": {"type": "string"}}},
    "Flushed": {"type": "object", "required": ["flushed_pages"], "properties": {"flushed_pages": {"type": "integer"}}},
    "Version": {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}},
    "TokenizerInfo": {
        "type": "object",
        "required": ["tokenizer_class"],
        "properties": {"tokenizer_class": {"type": "string"}, "chat_template": {"type": "string"}},
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
}

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
