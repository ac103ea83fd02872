"""The body of ``POST /v1/chat/completions``: parsed and validated into one value.

Unknown fields are accepted and ignored (benchmark clients send extras);
a known field with a bad value is always a 400 naming the field and its range.
Fields we do not support yet are rejected when they ask for something, never
silently ignored.
"""

from __future__ import annotations

from typing import Any

import attrs

from api.errors import ApiError

ROLES = {"system", "user", "assistant", "developer"}


@attrs.frozen
class ChatRequest:
    model: str
    messages: tuple[dict[str, str], ...] | None
    prompt: str | None
    max_tokens: int | None
    temperature: float
    top_k: int
    top_p: float
    stream: bool
    include_usage: bool
    ignore_eos: bool
    min_p: float = 0.0
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None


def _bad(param: str, message: str) -> ApiError:
    return ApiError(f"'{param}': {message}", param=param)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"must be a number, got {type(value).__name__}")
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise _bad(name, f"must be in {bracket}{lo}, {hi}], got {value}")
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {type(value).__name__}")
    return value


def _boolean(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"must be a boolean, got {type(value).__name__}")
    return value


def _content(index: int, content: Any) -> str:
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(param, f"only text parts are supported, got a part of type {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(param, "must be a string or a list of text parts")


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list):
        raise _bad("messages", "must be a list of message objects")
    if not value:
        raise _bad("messages", "must contain at least one message")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}]", "must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {sorted(ROLES)}, got {role!r}")
        if "content" not in message or message["content"] is None:
            raise _bad(f"messages[{i}].content", "is required")
        out.append({"role": "system" if role == "developer" else role, "content": _content(i, message["content"])})
    return tuple(out)


MAX_STOP_STRINGS = 4


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", "must be a string or a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    return tuple(s for s in stop if s)


def _stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise _bad("stop_token_ids", "must be a list of non-negative token ids")
    return tuple(ids)


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise _bad("logit_bias", "must be an object mapping token ids to numbers")
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise _bad("logit_bias", f"keys must be token ids, got {key!r}") from None
        if token < 0:
            raise _bad("logit_bias", f"token ids must be >= 0, got {token}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise _bad("logit_bias", f"biases must be numbers in [-100, 100], got {value!r} for {key}")
        out.append((token, float(value)))
    return tuple(out)


def _reject_unsupported(body: dict[str, Any]) -> None:
    """Fields that exist in the OpenAI API but are not implemented yet: a clear 400, never ignored."""
    n = _integer(body, "n", 1)
    if n is not None and n < 1:
        raise _bad("n", f"must be >= 1, got {n}")
    if n != 1:
        raise _bad("n", "only n=1 is supported so far")
    if _boolean(body, "logprobs", False):
        raise _bad("logprobs", "logprobs are not supported yet")
    if _integer(body, "top_logprobs", 0):
        raise _bad("top_logprobs", "logprobs are not supported yet")
    if body.get("tools"):
        raise _bad("tools", "tool calling is not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad("response_format", "only {'type': 'text'} is supported")


def parse_chat_request(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "is required and must be a string")
    messages = prompt = None
    if body.get("messages") is not None:
        messages = _messages(body["messages"])
    if body.get("prompt") is not None:
        if not isinstance(body["prompt"], str):
            raise _bad("prompt", "must be a string")
        prompt = body["prompt"]
    if (messages is None) == (prompt is None):
        raise _bad("messages", "give exactly one of 'messages' or 'prompt'")
    max_tokens = _integer(body, "max_tokens", None)
    max_completion = _integer(body, "max_completion_tokens", None)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise _bad("max_completion_tokens", f"disagrees with max_tokens ({max_completion} != {max_tokens})")
    max_tokens = max_tokens if max_tokens is not None else max_completion
    param = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise _bad(param, f"must be >= 1, got {max_tokens}")
    top_k = _integer(body, "top_k", -1)
    assert top_k is not None
    if top_k == 0 or top_k < -1:
        raise _bad("top_k", f"must be -1 (off) or >= 1, got {top_k}")
    stream = _boolean(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise _bad("stream_options", "is only allowed when 'stream' is true")
        if not isinstance(options, dict):
            raise _bad("stream_options", "must be an object")
        include_usage = _boolean(options, "include_usage", False)
    _reject_unsupported(body)
    return ChatRequest(
        model=model,
        messages=messages,
        prompt=prompt,
        max_tokens=max_tokens if max_tokens is not None else 16,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_k=top_k,
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=_boolean(body, "ignore_eos", False),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        min_tokens=_min_tokens(body),
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        logit_bias=_logit_bias(body),
        seed=_seed(body),
    )


def _min_tokens(body: dict[str, Any]) -> int:
    value = _integer(body, "min_tokens", 0)
    assert value is not None
    if value < 0:
        raise _bad("min_tokens", f"must be >= 0, got {value}")
    return value


def _seed(body: dict[str, Any]) -> int | None:
    value = _integer(body, "seed", None)
    if value is not None and not -(2**63) <= value < 2**64:
        raise _bad("seed", "must fit in 64 bits")
    return value
