"""Validation of the request fields that chat and completions share.

Unknown fields are accepted and ignored (benchmark clients send extras); a
known field with a bad value is always a 400 naming the field and its range.
Fields we do not support yet are rejected when they ask for something, never
silently ignored.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from trillm.api.errors import ApiError
from trillm.engine.sampling_params import SamplingParams

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
    max_tokens_given: bool  # False: the default, clamped to the context instead of rejected


@attrs.frozen
class Field:
    """One request field: its JSON schema (for /openapi.json) beside the parser that enforces it."""

    name: str
    schema: dict[str, Any]
    parse: Callable[[dict[str, Any]], Any]


def number_field(name: str, default: float, lo: float, hi: float, doc: str, lo_open: bool = False) -> Field:
    bound = {"exclusiveMinimum": lo} if lo_open else {"minimum": lo}
    schema = {"type": ["number", "null"], **bound, "maximum": hi, "default": default, "description": doc}
    return Field(name, schema, lambda body: number(body, name, default, lo, hi, lo_open))


def integer_field(name: str, default: int | None, lo: int | None, hi: int | None, doc: str) -> Field:
    schema: dict[str, Any] = {"type": ["integer", "null"], "description": doc}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    if default is not None:
        schema["default"] = default
        return Field(name, schema, lambda body: integer(body, name, default, lo, hi))
    return Field(name, schema, lambda body: optional_integer(body, name, lo, hi))


def boolean_field(name: str, default: bool, doc: str) -> Field:
    schema = {"type": ["boolean", "null"], "default": default, "description": doc}
    return Field(name, schema, lambda body: boolean(body, name, default))


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


def optional_integer(body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    return None if body.get(name) is None else integer(body, name, 0, lo, hi)


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


STOP = Field("stop", {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_STRINGS},
                                   {"type": "null"}],
                         "description": "up to 4 stop strings; the stop text is not returned"}, _stop)
STOP_TOKEN_IDS = Field("stop_token_ids", {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0},
                                          "description": "token ids that end generation"}, _stop_token_ids)
LOGIT_BIAS = Field("logit_bias", {"type": ["object", "null"], "additionalProperties": {"type": "number", "minimum": -100,
                                                                                     "maximum": 100},
                                  "description": "token id (as a string) -> bias added to its logit"}, _logit_bias)
TOP_K = Field("top_k", {"type": ["integer", "null"], "minimum": -1, "not": {"const": 0}, "default": -1,
                        "description": "-1 (off) or >= 1"}, _top_k)
SEED = Field("seed", {"type": ["integer", "null"], "minimum": -(2**63), "maximum": 2**64 - 1,
                      "description": "per-request generator seed"}, _seed)
STREAM_OPTIONS = Field("stream_options", {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}},
                                          "description": "only with stream: true"}, lambda body: None)

# The fields every generation request shares, in the order they are documented.
COMMON_FIELDS: tuple[Field, ...] = (
    integer_field("max_tokens", None, 1, None, f"most tokens to generate (default {DEFAULT_MAX_TOKENS})"),
    integer_field("max_completion_tokens", None, 1, None, "modern name of max_tokens; must agree with it"),
    number_field("temperature", 1.0, 0.0, 2.0, "0 is greedy"),
    TOP_K,
    number_field("top_p", 1.0, 0.0, 1.0, "nucleus mass", lo_open=True),
    number_field("min_p", 0.0, 0.0, 1.0, "drop tokens below min_p x the top probability"),
    boolean_field("ignore_eos", False, "keep generating past end-of-sequence tokens"),
    integer_field("min_tokens", 0, 0, None, "no EOS or stop token before this many tokens"),
    STOP,
    STOP_TOKEN_IDS,
    number_field("presence_penalty", 0.0, -2.0, 2.0, "OpenAI presence penalty over generated tokens"),
    number_field("frequency_penalty", 0.0, -2.0, 2.0, "OpenAI frequency penalty over generated tokens"),
    number_field("repetition_penalty", 1.0, 0.0, 10.0, "vLLM repetition penalty over prompt and output", lo_open=True),
    LOGIT_BIAS,
    SEED,
    integer_field("n", 1, 1, MAX_N, "choices per prompt"),
    boolean_field("stream", False, "stream Server-Sent Events"),
    STREAM_OPTIONS,
)


def parse_common(body: Any) -> CommonFields:
    """The model name, sampling parameters and streaming options of any generation request."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required and must be a string")
    v = {f.name: f.parse(body) for f in COMMON_FIELDS}
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not v["stream"]:
            raise bad("stream_options", "is only allowed when 'stream' is true")
        if not isinstance(options, dict):
            raise bad("stream_options", "must be an object")
        include_usage = boolean(options, "include_usage", False)
    reject_unsupported(body)
    # Every shared field named like a SamplingParams attribute goes straight into it.
    sampling = {f.name for f in attrs.fields(SamplingParams)} - {"max_tokens"}
    params = SamplingParams(max_tokens=_max_tokens(body), **{k: x for k, x in v.items() if k in sampling})
    given = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
    return CommonFields(model, params, v["stream"], include_usage, v["n"], given)
