"""``POST /tokenize`` and ``POST /detokenize`` with vLLM-compatible bodies."""

from __future__ import annotations

from typing import Any

from trillm.api.chat_schema import parse_messages
from trillm.api.errors import ApiError
from trillm.api.fields import Field, bad, boolean
from trillm.engine.engine import Engine


_OPTIONAL_MODEL = Field("model", {"type": ["string", "null"], "description": "if given, the served model"}, lambda b: None)
TOKENIZE_FIELDS = (
    _OPTIONAL_MODEL,
    Field("prompt", {"type": ["string", "null"], "description": "text to tokenize"}, lambda b: None),
    Field("messages", {"type": ["array", "null"], "minItems": 1, "items": {"type": "object"},
                       "description": "chat messages; tokenized with the chat template"}, lambda b: None),
    Field("add_special_tokens", {"type": ["boolean", "null"], "default": True}, lambda b: None),
    Field("add_generation_prompt", {"type": ["boolean", "null"], "default": True}, lambda b: None),
)
DETOKENIZE_FIELDS = (
    _OPTIONAL_MODEL,
    Field("tokens", {"type": "array", "items": {"type": "integer", "minimum": 0}}, lambda b: None),
)


def tokenize(engine: Engine, body: Any) -> dict[str, Any]:
    """``{"prompt"}`` or ``{"messages"}`` (chat template applied) -> ``{tokens, count, max_model_len}``."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    tok = engine.tokenizer
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise bad("messages", "give exactly one of 'messages' or 'prompt'")
        messages = list(parse_messages(body["messages"]))
        text = tok.apply_chat_template(
            messages, add_generation_prompt=boolean(body, "add_generation_prompt", True), tokenize=False
        )
        tokens = tok(text, add_special_tokens=False)["input_ids"]
    elif isinstance(body.get("prompt"), str):
        tokens = tok(body["prompt"], add_special_tokens=boolean(body, "add_special_tokens", True))["input_ids"]
    else:
        raise bad("prompt", "give 'prompt' (a string) or 'messages'")
    return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}


def detokenize(engine: Engine, body: Any) -> dict[str, Any]:
    """``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    tokens = body.get("tokens")
    vocab = engine.model.shape.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("tokens", "must be a list of token ids")
    if any(not 0 <= t < vocab for t in tokens):
        raise bad("tokens", f"token ids must be in [0, {vocab - 1}]")
    return {"prompt": engine.tokenizer.decode(tokens)}
