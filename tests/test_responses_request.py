# ruff: noqa: E501  (request bodies read best on one line)
"""``POST /v1/responses`` without a server: the body mapped onto a chat request, the 400s,
and chat's stream deltas turned into typed events (``ResponseEvents``)."""

from __future__ import annotations

import json

import pytest

from trillm.api.errors import ApiError
from trillm.api.responses_output import ResponseEvents
from trillm.api.schemas.responses import parse_responses_request
from trillm.api.submission import ChoiceProgress

from tests.server import MODEL

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def _error(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_responses_request({"model": MODEL, "input": "hi", **body})
    return info.value


def test_input_items_become_chat_messages():
    req = parse_responses_request(
        {
            "model": MODEL,
            "instructions": "Be brief.",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Weather in "},
                        {"type": "input_text", "text": "Paris?"},
                    ],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city": "Paris"}',
                    "status": "completed",
                },
                {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "not json"},
                {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "hmm"}],
                },
                {"role": "developer", "content": "Answer in French."},
            ],
            "max_output_tokens": 7,
            "temperature": 0,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "store": True,
            "metadata": {"k": "v"},
        }
    )
    assert req.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "system", "content": "Answer in French."},
    )
    params = req.common.params
    assert (params.max_tokens, params.temperature, req.common.max_tokens_given) == (7, 0.0, True)
    assert req.tools is not None and req.tools.choice == "get_weather" and req.tools.max_calls == 1
    assert req.echo["tool_choice"] == {"type": "function", "name": "get_weather"} and req.echo["metadata"] == {"k": "v"}
    plain = parse_responses_request({"model": MODEL, "input": "hi"})
    assert plain.messages == ({"role": "user", "content": "hi"},) and plain.common.params.max_tokens is None
    assert plain.common.grammar is None and plain.tools is None and plain.echo["text"] == {"format": {"type": "text"}}
    assert parse_responses_request({"model": MODEL, "input": "hi", "tools": TOOLS, "tool_choice": "none"}).tools is None


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
        ({"conversation": "conv_1"}, "conversation", "stateless"),
        ({"background": True}, "background", "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function"),
        (
            {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
            "tool_choice",
            "names no function",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
        (
            {"text": {"format": {"type": "json_schema", "name": "bad name!", "schema": {}}}},
            "text.format.name",
            "matching",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "function_call_output"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
            "must be",
        ),
        ({"input": []}, "input", "non-empty"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "nothing for the prompt"),
        ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"metadata": {"k": 1}}, "metadata", "strings"),
    ],
)
def test_bad_requests_name_the_field(body, param, words):
    error = _error(body)
    assert error.status == 400 and error.param == param and words in error.message, error.message


class _Engine:
    """The one thing the event writer asks of the engine: its tokenizer (for reasoning_tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


def _call(index: int, head: bool) -> dict:
    """Chat's tool_calls deltas: a call's head (id and name), then its arguments."""
    if head:
        function = {"name": "get_weather", "arguments": ""}
        return {"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function", "function": function}]}
    return {"tool_calls": [{"index": index, "function": {"arguments": '{"city": "Paris"}'}}]}


class _Deltas:
    """Chat's stream deltas, given in advance (``ResponseEvents`` reads only ``pieces`` and ``cut``)."""

    def __init__(self, choices):
        self.choices = choices

    def pieces(self, out):
        return self.choices.pop(0)

    def cut(self, index):
        return {"index": index, "delta": {}, "finish_reason": "length"}


def _decode(events) -> list[dict]:
    payloads = []
    for raw in events:
        name, data = raw.decode().rstrip("\n").split("\n")
        payloads.append(json.loads(data[len("data: ") :]))
        assert name == "event: " + payloads[-1]["type"]
    return payloads


def test_chat_deltas_become_items_one_at_a_time(tokenizer):
    """Thinking, text, two calls (hermes-style deltas), then the finish: each item opened, filled
    and closed in order; an aborted stream ends in response.failed; a refusal still opens the stream."""
    deltas = [
        {"reasoning_content": "Let me "},
        {"reasoning_content": "think."},
        {"content": "Checking."},
        _call(0, True),
        _call(0, False),
        _call(1, True),
        _call(1, False),
    ]
    choices = [[{"index": 0, "delta": d, "finish_reason": None}] for d in deltas] + [
        [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]
    ]
    req = parse_responses_request({"model": MODEL, "input": "hi", "tools": TOOLS})
    writer = ResponseEvents(_Engine(tokenizer), _Deltas(choices), req, MODEL, 5)
    events = list(writer.opening())
    for _ in range(len(choices)):
        events += writer.pieces(None)
    progress = ChoiceProgress(1)
    progress.generated[0] = 30
    payloads = _decode([*events, *writer.end(progress)])
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    added = [p["item"]["type"] for p in payloads if p["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    opened, closed = [], []
    for p in payloads:  # never two items open at once
        if p["type"] == "response.output_item.added":
            assert len(opened) == len(closed)
            opened.append(p["output_index"])
        if p["type"] == "response.output_item.done":
            closed.append(p["output_index"])
    assert opened == closed == [0, 1, 2, 3]
    final = payloads[-1]
    assert final["type"] == "response.completed"
    output = final["response"]["output"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert output[1]["content"][0]["text"] == "Checking."
    assert [(o["call_id"], o["arguments"]) for o in output[2:]] == [
        ("call_0", '{"city": "Paris"}'),
        ("call_1", '{"city": "Paris"}'),
    ]
    assert all(o["status"] == "completed" for o in output)
    usage = final["response"]["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (5, 30, 35)
    assert usage["output_tokens_details"]["reasoning_tokens"] == len(
        tokenizer("Let me think.", add_special_tokens=False)["input_ids"]
    )

    aborted = ResponseEvents(
        _Engine(tokenizer),
        _Deltas([[{"index": 0, "delta": {"content": "Par"}, "finish_reason": "abort"}]]),
        req,
        MODEL,
        5,
    )
    payloads = _decode([*aborted.opening(), *aborted.pieces(None), *aborted.end(ChoiceProgress(1))])
    assert payloads[-1]["type"] == "response.failed" and payloads[-1]["response"]["error"]["code"] == "server_error"
    assert payloads[-2]["item"]["status"] == "incomplete"

    refused = ResponseEvents(_Engine(tokenizer), _Deltas([]), req, MODEL, 5)
    payloads = _decode(refused.refused(ApiError("queue full", 503, code="server_overloaded")))
    assert [p["type"] for p in payloads] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert payloads[2]["code"] == "server_overloaded" and payloads[3]["response"]["status"] == "failed"
