"""The reply shapes ``/openapi.json`` publishes (what the handlers build), one schema per reply
object: chat, completions, Responses, Messages, embeddings, rerank, score, tokenize and the
admin and info replies. schemathesis checks every reply against them (``tests/test_schemathesis.py``)."""

from __future__ import annotations

from typing import Any


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


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
        "parked": {"type": "boolean"},  # unloaded, its weights kept in host memory (--park-models)
        "memory_bytes": {"type": "integer"},  # its weights and KV pool, while loaded
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


def _chat_choice(key: str) -> dict[str, Any]:
    """A chat choice: its ``message`` (a reply) or its ``delta`` (a streamed chunk)."""
    return {
        "type": "object",
        "properties": {
            "index": {"type": "integer"},
            "finish_reason": _FINISH,
            "logprobs": _CHAT_LOGPROBS,
            key: {"type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}},
        },
    }


RESPONSE_SCHEMAS: dict[str, Any] = {
    "ChatCompletion": _envelope("chat.completion", _chat_choice("message")),
    "ChatCompletionChunk": _envelope("chat.completion.chunk", _chat_choice("delta")),
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
