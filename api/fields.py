"""Validation of the request fields that chat and completions share.

Unknown fields are accepted and ignored (benchmark clients send extras); a
known field with a bad value is always a 400 naming the field and its range.
Fields we do not support yet are rejected when they ask for something, never
silently ignored.
"""

from __future__ import annotations

from typing import Any

import attrs

from api.errors import ApiError
from engine.sampling_params import SamplingParams

MAX_STOP_STRINGS = 4
DEFAULT_MAX_TOKENS = 16
MAX_N = 32


@attrs.frozen
class CommonFields:
    model: str
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int


def bad(param: str, message: str) -> ApiError:
    return ApiError(f"'{param}': {message}", param=param)


def number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"must be a number, got {type(value).__name__}")
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise bad(name, f"must be in {bracket}{lo}, {hi}], got {value}")
    return float(value)


def integer(body: dict[str, Any], name: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"must be an integer, got {type(value).__name__}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        limits = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(name, f"must be {limits}, got {value}")
    return value


def optional_integer(body: dict[str, Any], name: str, lo: int | None = None) -> int | None:
    return None if body.get(name) is None else integer(body, name, 0, lo)


def boolean(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"must be a boolean, got {type(value).__name__}")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop", "must be a string or a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    return tuple(s for s in stop if s)


def _stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise bad("stop_token_ids", "must be a list of non-negative token ids")
    return tuple(ids)


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad("logit_bias", "must be an object mapping token ids to numbers")
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad("logit_bias", f"keys must be token ids, got {key!r}") from None
        if token < 0:
            raise bad("logit_bias", f"token ids must be >= 0, got {token}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad("logit_bias", f"biases must be numbers in [-100, 100], got {value!r} for {key}")
        out.append((token, float(value)))
    return tuple(out)


def _max_tokens(body: dict[str, Any]) -> int:
    max_tokens = optional_integer(body, "max_tokens", 1)
    max_completion = optional_integer(body, "max_completion_tokens", 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad("max_completion_tokens", f"disagrees with max_tokens ({max_completion} != {max_tokens})")
    chosen = max_tokens if max_tokens is not None else max_completion
    return chosen if chosen is not None else DEFAULT_MAX_TOKENS


def _seed(body: dict[str, Any]) -> int | None:
    value = optional_integer(body, "seed")
    if value is not None and not -(2**63) <= value < 2**64:
        raise bad("seed", "must fit in 64 bits")
    return value


def _top_k(body: dict[str, Any]) -> int:
    top_k = integer(body, "top_k", -1)
    if top_k == 0 or top_k < -1:
        raise bad("top_k", f"must be -1 (off) or >= 1, got {top_k}")
    return top_k


def reject_unsupported(body: dict[str, Any]) -> None:
    """Fields of the OpenAI API that we do not implement yet: a clear 400, never ignored."""
    if body.get("tools"):
        raise bad("tools", "tool calling is not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("response_format", "only {'type': 'text'} is supported")


def parse_common(body: Any) -> CommonFields:
    """The model name, sampling parameters and streaming options of any generation request."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required and must be a string")
    stream = boolean(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options", "is only allowed when 'stream' is true")
        if not isinstance(options, dict):
            raise bad("stream_options", "must be an object")
        include_usage = boolean(options, "include_usage", False)
    reject_unsupported(body)
    params = SamplingParams(
        max_tokens=_max_tokens(body),
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_k=_top_k(body),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        min_p=number(body, "min_p", 0.0, 0.0, 1.0),
        ignore_eos=boolean(body, "ignore_eos", False),
        min_tokens=integer(body, "min_tokens", 0, lo=0),
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
        logit_bias=_logit_bias(body),
        seed=_seed(body),
    )
    return CommonFields(model, params, stream, include_usage, integer(body, "n", 1, 1, MAX_N))
