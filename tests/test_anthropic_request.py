# ruff: noqa: E501  (request bodies read best on one line)
"""``POST /v1/messages`` without a server: blocks mapped onto chat messages, tools and choices, the
400s, Anthropic's error shape, and chat's stream deltas turned into Anthropic's events."""

from __future__ import annotations

import json

import pytest

from trillm.api.anthropic_output import MessageEvents, error_body, error_status
from trillm.api.chat import ChatChunks
from trillm.api.errors import ApiError
from trillm.api.reasoning import ChoiceSplitter
from trillm.api.schemas.anthropic import count_tokens_request, parse_messages_request
from trillm.api.submission import ChoiceProgress
from trillm.engine import RequestOutput, SamplingParams

from tests.server import MODEL

TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def _parse(**body):
    return parse_messages_request({"model": MODEL, "max_tokens": 10, **body})


def _error(**body) -> ApiError:
    with pytest.raises(ApiError) as info:
        _parse(**body)
    return info.value


def test_blocks_become_chat_messages():
    req = _parse(
        system=[
            {"type": "text", "text": "Be brief."},
            {"type": "text", "text": "Use metric units.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "user", "content": [{"type": "text", "text": "And quickly."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Lyon"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no data"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Thanks!"},
                ],
            },
        ],
        tools=[TOOL],
        temperature=0.5,
        top_k=5,
        stop_sequences=["END"],
    )
    assert req.messages == (
        {"role": "system", "content": "Be brief.\n\nUse metric units."},
        {"role": "user", "content": "Weather in Paris?\n\nAnd quickly."},  # consecutive turns join
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Lyon"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no data"},
        {"role": "user", "content": "Thanks!"},
    )
    params = req.common.params
    assert (params.temperature, params.top_k, params.max_tokens, params.stop) == (0.5, 5, 10, ("END",))
    assert req.stop_sequences == ("END",) and req.prefill == "" and req.common.max_tokens_given
    assert req.tools is not None and req.tools.choice == "auto" and req.tools.parallel
    assert [f.name for f in req.tools.functions] == ["get_weather"]


def test_a_last_assistant_turn_is_a_prefill():
    req = _parse(
        messages=[
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": [{"type": "text", "text": "The colour is"}]},
        ]
    )
    assert req.prefill == "The colour is" and req.messages == ({"role": "user", "content": "Name a colour."},)
    assert _error(messages=[{"role": "assistant", "content": "Hello"}]).param == "messages"
    counted = count_tokens_request(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]}
    )
    assert counted.prefill == "Hel"


def test_tool_choices_and_thinking():
    any_one = _parse(
        messages=[{"role": "user", "content": "hi"}],
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert any_one.tools.choice == "required" and not any_one.tools.parallel
    named = _parse(
        messages=[{"role": "user", "content": "hi"}], tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert named.tools.choice == "get_weather"
    assert (
        _parse(messages=[{"role": "user", "content": "hi"}], tools=[TOOL], tool_choice={"type": "none"}).tools is None
    )
    on = _parse(
        max_tokens=2000,
        messages=[{"role": "user", "content": "hi"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    off = _parse(messages=[{"role": "user", "content": "hi"}], thinking={"type": "disabled"})
    plain = _parse(messages=[{"role": "user", "content": "hi"}])
    assert on.chat_template_kwargs == {"enable_thinking": True} and off.chat_template_kwargs == {
        "enable_thinking": False
    }
    assert plain.chat_template_kwargs is None
    structured = _parse(
        messages=[{"role": "user", "content": "hi"}],
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
    )
    assert structured.common.grammar is not None and structured.common.grammar[1] == "output_config.format"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
            "'image' blocks",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document", "source": {}}]}
                        ],
                    }
                ]
            },
            "messages[0].content[0].content[0]",
            "'document' blocks",
        ),
        (
            {"system": [{"type": "search_result"}], "messages": [{"role": "user", "content": "hi"}]},
            "system[0]",
            "'search_result' blocks",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "bash_20250124", "name": "bash"}]},
            "tools[0]",
            "server tool 'bash_20250124'",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "tool_choice": {"type": "tool"}},
            "tool_choice",
            "needs the tool's `name`",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [TOOL],
                "tool_choice": {"type": "tool", "name": "other"},
            },
            "tool_choice",
            "names no function",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled"}},
            "thinking.budget_tokens",
            "needs `budget_tokens`",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 100}},
            "thinking.budget_tokens",
            "",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 1.5}, "temperature", ""),
        ({"messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x"] * 17}, "stop_sequences", ""),
        ({"messages": [{"role": "user", "content": "hi"}], "mcp_servers": [{"url": "x"}]}, "mcp_servers", "MCP"),
        ({"messages": []}, "messages", ""),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role", ""),
        ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content", "must not be empty"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "must not be empty"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
            "messages[0].content",
            "must not be empty",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                ]
            },
            "messages[0].content",
            "belong to assistant turns",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]},
                    {"role": "user", "content": "go on"},
                ]
            },
            "messages[1].content",
            "belong to user turns",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(body, param, words):
    error = _error(**body)
    assert error.status == 400 and error.param == param and words in error.message
    shaped = error_body(error)
    assert (
        shaped["type"] == "error"
        and shaped["error"]["type"] == "invalid_request_error"
        and param in shaped["error"]["message"]
    )
    with pytest.raises(ApiError) as missing:
        parse_messages_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert missing.value.param == "max_tokens"


def test_errors_take_anthropics_types_and_status_codes():
    cases = {
        401: (401, "authentication_error"),
        403: (403, "permission_error"),
        404: (404, "not_found_error"),
        413: (413, "request_too_large"),
        429: (429, "rate_limit_error"),
        500: (500, "api_error"),
        503: (529, "overloaded_error"),
    }
    for status, (shown_status, kind) in cases.items():
        error = ApiError("nope", status)
        assert (error_status(error), error_body(error)["error"]["type"]) == (shown_status, kind)


def _out(text: str, finish: str | None = None, n: int = 1, stop: str | None = None) -> RequestOutput:
    return RequestOutput("r", 0, text, (1,) * len(text), finish, 12, n, num_cached_tokens=4, stop_string=stop)


def _decode(raw: list[bytes]) -> list[dict]:
    events = []
    for chunk in raw:
        name, data = chunk.decode().strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events.append(payload)
    return events


def test_stream_events_from_chat_deltas():
    chunks = ChatChunks(None, SamplingParams(), 1, ChoiceSplitter("qwen3"))  # type: ignore[arg-type]
    writer = MessageEvents(chunks, MODEL, 12, ("END",))
    raw = [*writer.opening()]
    for out in [
        _out("<think>Hmm, "),
        _out("let me see.</think>", n=2),
        _out("The answer", n=3),
        _out(" is 4.", "stop", 4, stop="END"),
    ]:
        raw += writer.pieces(out)
    progress = ChoiceProgress(1)
    progress.record(_out("", "stop", 4))
    raw += writer.end(progress)
    events = _decode(raw)
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert start["usage"] == {
        "input_tokens": 8,
        "output_tokens": 0,
        "cache_read_input_tokens": 4,
        "cache_creation_input_tokens": 0,
    }
    assert events[2]["content_block"]["type"] == "thinking" and events[6]["content_block"] == {
        "type": "text",
        "text": "",
    }
    assert (
        "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
        == "Hmm, let me see."
    )
    assert (
        "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == "The answer is 4."
    )
    assert [e["index"] for e in events if e["type"].startswith("content_block")] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert (
        events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
        and events[-2]["usage"]["output_tokens"] == 4
    )


def test_stream_ends_refusals_and_aborts_as_error_events():
    chunks = ChatChunks(None, SamplingParams(), 1)  # type: ignore[arg-type]
    refused = _decode(list(MessageEvents(chunks, MODEL, 12, ()).refused(ApiError("the server is overloaded", 503))))
    assert refused == [{"type": "error", "error": {"type": "overloaded_error", "message": "the server is overloaded"}}]
    writer = MessageEvents(ChatChunks(None, SamplingParams(), 1), MODEL, 12, ())  # type: ignore[arg-type]
    raw = [*writer.pieces(_out("Hello")), *writer.pieces(_out("", "abort", 2))]
    progress = ChoiceProgress(1)
    progress.record(_out("", "abort", 2))
    events = _decode([*raw, *writer.end(progress)])
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    assert events[-2] == {"type": "content_block_stop", "index": 0}  # the open block closed first
    # A cut at the deadline: the open text ends and the reply stops at max_tokens.
    writer = MessageEvents(ChatChunks(None, SamplingParams(), 1), MODEL, 12, ())  # type: ignore[arg-type]
    raw = [*writer.pieces(_out("Hello")), *writer.cut([0])]
    progress = ChoiceProgress(1)
    progress.record(_out("Hello"))
    events = _decode([*raw, *writer.end(progress)])
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-1] == {"type": "message_stop"}
