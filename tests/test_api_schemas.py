"""The request declarations without a server: param paths, strict types, defaults, and that
/openapi.json and docs/api.md are derived from the same declarations the parser enforces."""

from __future__ import annotations

import jsonschema
import pytest

from trillm.api.errors import ApiError
from trillm.api.openapi import openapi_document
from trillm.api.schemas import PUBLISHED
from trillm.api.schemas.chat import parse_chat_request
from trillm.api.schemas.completion import parse_completion_request
from trillm.api.schemas.docs import DOCS, field_names, render

MODEL = "m"
Q = [{"role": "user", "content": "hi"}]


def _error(parse, body) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(body)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            {"model": MODEL, "messages": [*Q, {"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[1].content",
            "a string or an array of objects with 'type' and 'text'",
        ),
        ({"model": MODEL, "messages": [*Q, "hi"]}, "messages[1]", "an object with 'role'"),
        ({"model": MODEL, "messages": [{"content": "hi"}]}, "messages[0].role", "is required"),
        (
            {"model": MODEL, "messages": Q, "stream": True, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
            "a boolean",
        ),
        ({"model": MODEL, "messages": Q, "response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"model": MODEL, "messages": Q, "tools": [{"type": "function"}]}, "tools[0].function", "is required"),
        ({"model": MODEL, "messages": Q, "temperature": 5}, "temperature", "a number in [0.0, 2.0], got 5"),
        ({"model": MODEL, "messages": Q, "top_k": 0}, "top_k", "an integer >= -1, not 0"),
        ({"model": MODEL, "messages": Q, "logit_bias": {"7": 101}}, "logit_bias", "numbers in [-100.0, 100.0]"),
        (
            {"model": MODEL, "messages": Q, "max_tokens": 5, "max_completion_tokens": 6},
            "max_completion_tokens",
            "disagrees with max_tokens",
        ),
        ({"model": MODEL, "messages": Q, "prompt": "x"}, "messages", "exactly one of"),
        # regression: a 1 MB stop string was accepted (each is searched for in every output)
        ({"model": MODEL, "messages": Q, "stop": "x" * 1025}, "stop", "at most 1024 characters"),
        ({"model": MODEL, "messages": Q, "stop": ["ok", "x" * 1025]}, "stop", "strings of at most 1024 characters"),
    ],
)
def test_errors_name_the_path_and_what_the_field_accepts(body, param, words):
    err = _error(parse_chat_request, body)
    assert err.param == param and words in err.message and err.message.startswith(f"'{param}': ")


def test_regression_huge_values_are_not_echoed_whole():
    digits = int("9" * 4000)
    err = _error(parse_chat_request, {"model": MODEL, "messages": Q, "max_tokens": 5, "max_completion_tokens": digits})
    assert "(4000 characters)" in err.message and len(err.message) < 200


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "1"),
        ("max_tokens", 1.5),
        ("max_tokens", 1.0),
        ("max_tokens", True),
        ("n", True),
        ("temperature", "0.5"),
        ("temperature", False),
        ("stream", 1),
        ("stream", "true"),
        ("seed", 1.0),
        ("stop", 5),
        ("stop_token_ids", [True]),
        ("logit_bias", {"1": True}),
        ("ignore_eos", 0),
    ],
)
def test_types_are_strict(field, value):
    assert _error(parse_chat_request, {"model": MODEL, "messages": Q, field: value}).param == field


def test_null_means_default_and_unknown_fields_are_ignored():
    req = parse_chat_request(
        {
            "model": MODEL,
            "messages": Q,
            "temperature": None,
            "max_tokens": None,
            "top_k": None,
            "stop": None,
            "user": "u",
            "future": {"x": 1},
            "tool_choice": "none",
        }
    )
    assert req.common.params.temperature == 1.0 and req.common.params.top_k == -1
    assert req.common.params.max_tokens is None and not req.common.max_tokens_given  # until EOS or the context


def test_max_tokens_defaults_and_the_servers_cap():
    """Chat has no default limit, completions 16 (OpenAI's); ``--default-max-tokens`` caps defaults only."""
    chat = parse_chat_request({"model": MODEL, "messages": Q}).common
    legacy = parse_completion_request({"model": MODEL, "prompt": "x"}).common
    assert chat.params.max_tokens is None and legacy.params.max_tokens == 16
    assert chat.capped(None) is chat and chat.capped(100).params.max_tokens == 100
    assert legacy.capped(100).params.max_tokens == 16 and legacy.capped(5).params.max_tokens == 5
    given = parse_chat_request({"model": MODEL, "messages": Q, "max_tokens": 50}).common
    assert given.capped(5).params.max_tokens == 50  # the client's own limit is honoured
    modern = parse_completion_request({"model": MODEL, "prompt": "x", "max_completion_tokens": 40}).common
    assert modern.capped(5).params.max_tokens == 40


def test_completion_echo_logprobs_and_max_tokens_zero():
    scored = parse_completion_request({"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0})
    assert scored.echo_only and scored.common.params.prompt_logprobs == 1 and scored.common.params.max_tokens == 1
    plain = parse_completion_request({"model": MODEL, "prompt": "x", "logprobs": 1})
    assert plain.common.params.prompt_logprobs is None and not plain.echo_only
    err = _error(parse_completion_request, {"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert err.param == "max_tokens" and "echo" in err.message
    assert _error(parse_chat_request, {"model": MODEL, "messages": Q, "max_tokens": 0}).param == "max_tokens"


def test_max_tokens_semantics():
    assert parse_chat_request({"model": MODEL, "messages": Q, "max_tokens": 9}).common.max_tokens_given
    modern = parse_chat_request({"model": MODEL, "messages": Q, "max_completion_tokens": 7}).common
    assert modern.params.max_tokens == 7 and modern.max_tokens_given
    both = parse_chat_request({"model": MODEL, "messages": Q, "max_tokens": 7, "max_completion_tokens": 7}).common
    assert both.params.max_tokens == 7


def test_messages_for_the_template():
    req = parse_chat_request(
        {
            "model": MODEL,
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": "q", "name": "ignored"},
            ],
        }
    )
    assert req.messages == ({"role": "system", "content": "ab"}, {"role": "user", "content": "q"})
    assert req.prompt is None


def test_shared_fields_reach_sampling_params():
    req = parse_chat_request(
        {
            "model": MODEL,
            "prompt": "x",
            "stop": ["a", ""],
            "stop_token_ids": [3],
            "logit_bias": {"5": -2},
            "seed": 4,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 3,
        }
    )
    p = req.common.params
    assert (p.stop, p.stop_token_ids, p.logit_bias, p.seed, p.logprobs) == (("a",), (3,), ((5, -2.0),), 4, 3)
    assert req.common.include_usage and req.common.stream and req.common.n == 2
    assert parse_chat_request({"model": MODEL, "prompt": "x"}).common.params.logprobs is None


def test_completion_prompts_in_four_forms():
    forms = {"x": ("x",), ("a", "b"): ("a", "b"), (1, 2): ((1, 2),), ((1,), (2, 3)): ((1,), (2, 3))}
    for given, prompts in forms.items():
        body = {
            "model": MODEL,
            "prompt": given if isinstance(given, str) else [list(p) if isinstance(p, tuple) else p for p in given],
        }
        assert parse_completion_request(body).prompts == prompts
    req = parse_completion_request({"model": MODEL, "prompt": "x", "logprobs": 2, "echo": False})
    assert req.common.params.logprobs == 2 and not req.echo


def test_openapi_request_schemas_are_the_declarations():
    schemas = openapi_document("0", MODEL)["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert set(chat["properties"]) == set(PUBLISHED["ChatCompletionRequest"].model_fields)
    assert chat["properties"]["model"]["enum"] == [MODEL] and chat["required"] == ["model"]
    assert schemas["CompletionRequest"]["required"] == ["model", "prompt"]
    assert schemas["DetokenizeRequest"]["required"] == ["tokens"]
    resolver = {"components": {"schemas": schemas}}
    validator = jsonschema.Draft202012Validator({**chat, **resolver})
    good = {"model": MODEL, "messages": Q, "temperature": None, "stop": ["x"], "extra": 1}
    assert validator.is_valid(good)
    parse_chat_request(good)
    for bad in (
        {"model": MODEL, "messages": Q, "top_k": 0},
        {"model": MODEL, "messages": Q, "n": 33},
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
    ):
        assert not validator.is_valid(bad)
        _error(parse_chat_request, bad)


def test_docs_tables_are_generated_from_the_declarations():
    text = DOCS.read_text()
    assert render(text) == text, "stale field tables: run python -m trillm.api.schemas.docs"
    for name, model in PUBLISHED.items():
        section = text.split(f"<!-- fields: {name} -->\n", 1)[1].split("<!-- end fields -->", 1)[0]
        for field in field_names(name):
            info = model.model_fields[field]
            default = "required" if info.is_required() else "—" if info.default is None else None
            row = next(line for line in section.splitlines() if line.startswith(f"| `{field}` |"))
            assert (default or str(info.default).lower()) in row, (name, field, row)
