# ruff: noqa: E501  (request bodies read best on one line)
"""``POST /v1/messages`` end to end with the real ``anthropic`` SDK on the default model: replies
and streams that agree with chat, stop sequences, prefills, the cache counts, a tool round trip,
structured output, thinking blocks, Anthropic-shaped errors, ``x-api-key`` and cancellation.
The body mapping and the event writer alone: ``test_anthropic_request.py``."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from trillm.api.settings import ServerConfig

from tests.helpers import wait_idle
from tests.server import MODEL, client, in_thread, running_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the SDK dropped sampling arguments: sent as extra fields, as older SDKs sent them
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]


def sdk(server, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def _stream(c: anthropic.Anthropic, **kwargs):
    """Every raw event, and the SDK's own reassembly of them."""
    with c.messages.stream(**kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_message()


@pytest.mark.e2e
async def test_replies_and_streams_agree_with_chat(server):
    def run():
        c = sdk(server)
        whole = c.messages.create(model=MODEL, max_tokens=60, messages=QUESTION, extra_body=GREEDY)
        chat = client(server).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=60, temperature=0)
        events, final = _stream(c, model=MODEL, max_tokens=60, messages=QUESTION, extra_body=GREEDY)
        again = c.messages.create(model=MODEL, max_tokens=60, messages=QUESTION, extra_body=GREEDY)
        counted = c.messages.count_tokens(model=MODEL, messages=QUESTION)
        system = c.messages.create(
            model=MODEL,
            max_tokens=20,
            system=[{"type": "text", "text": "You are a pirate."}],
            messages=QUESTION,
            extra_body=GREEDY,
        )
        counted_system = c.messages.count_tokens(model=MODEL, system="You are a pirate.", messages=QUESTION)
        cut = c.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, extra_body=GREEDY)
        body = {"model": MODEL, "max_tokens": 60, "messages": QUESTION, "stream": True, "temperature": 0}
        raw = httpx.post(server.url + "/v1/messages", json=body, timeout=60).text
        return whole, chat, events, final, again, counted, system, counted_system, cut, raw

    whole, chat, events, final, again, counted, system, counted_system, cut, raw = await in_thread(run)
    names = [line.removeprefix("event: ") for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"
    for line in raw.splitlines():  # each event's data names it again
        if line.startswith("data: "):
            assert json.loads(line.removeprefix("data: "))["type"] in names
    assert (
        whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    )
    [block] = whole.content
    assert block.type == "text" and block.text == chat.choices[0].message.content and "Paris" in block.text
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
    assert whole.usage.input_tokens == chat.usage.prompt_tokens == counted.input_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    # The stream: message_start, (ping, which the SDK drops,) one text block's start / deltas / stop,
    # message_delta, message_stop.
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[3:-3]) == {"content_block_delta", "text"}  # the SDK adds a `text` event per delta
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == block.text
    assert (
        final.content[0].text == block.text
        and final.stop_reason == "end_turn"
        and final.usage.output_tokens == whole.usage.output_tokens
    )
    # Anthropic counts cached prompt tokens apart: the same question again reads most of it from the cache.
    assert again.usage.cache_read_input_tokens > 0 and again.usage.cache_creation_input_tokens == 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens
    assert again.content[0].text == block.text
    assert (
        system.usage.input_tokens + system.usage.cache_read_input_tokens
        == counted_system.input_tokens
        != counted.input_tokens
    )
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


@pytest.mark.e2e
async def test_stop_sequences_prefill_tools_and_structured_output(server):
    def run():
        c = sdk(server)
        plain = c.messages.create(model=MODEL, max_tokens=60, messages=QUESTION, extra_body=GREEDY)
        stopped = c.messages.create(
            model=MODEL, max_tokens=60, messages=QUESTION, stop_sequences=["zzz", "Paris"], extra_body=GREEDY
        )
        events, streamed_stop = _stream(
            c, model=MODEL, max_tokens=60, messages=QUESTION, stop_sequences=["Paris"], extra_body=GREEDY
        )
        prefilled = c.messages.create(
            model=MODEL,
            max_tokens=30,
            messages=[*QUESTION, {"role": "assistant", "content": "The capital of France is"}],
            extra_body=GREEDY,
        )
        call = c.messages.create(
            model=MODEL,
            max_tokens=80,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=TOOLS,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body=GREEDY,
        )
        tool_events, streamed_call = _stream(
            c,
            model=MODEL,
            max_tokens=80,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            extra_body=GREEDY,
        )
        use = next(b for b in call.content if b.type == "tool_use")
        answer = c.messages.create(
            model=MODEL,
            max_tokens=60,
            tools=TOOLS,
            tool_choice={"type": "none"},
            messages=[
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": call.content},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny and 21 degrees celsius."}
                    ],
                },
            ],
            extra_body=GREEDY,
        )
        counted = c.messages.count_tokens(
            model=MODEL, tools=TOOLS, messages=[{"role": "user", "content": "What is the weather in Paris?"}]
        )
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
            "required": ["city", "country"],
            "additionalProperties": False,
        }
        structured = c.messages.create(
            model=MODEL,
            max_tokens=80,
            messages=QUESTION,
            output_config={"format": {"type": "json_schema", "schema": schema}},
            extra_body=GREEDY,
        )
        return (
            plain,
            stopped,
            events,
            streamed_stop,
            prefilled,
            call,
            tool_events,
            streamed_call,
            answer,
            counted,
            structured,
            schema,
        )

    (
        plain,
        stopped,
        events,
        streamed_stop,
        prefilled,
        call,
        tool_events,
        streamed_call,
        answer,
        counted,
        structured,
        schema,
    ) = await in_thread(run)
    text = plain.content[0].text
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert stopped.content[0].text == text[: text.index("Paris")]
    assert streamed_stop.stop_reason == "stop_sequence" and streamed_stop.stop_sequence == "Paris"
    assert streamed_stop.content[0].text == stopped.content[0].text
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "stop_sequence" and delta.delta.stop_sequence == "Paris"
    # A prefill: the reply continues the assistant's text (and leaves it out).
    assert prefilled.content[0].text and not prefilled.content[0].text.startswith("The capital")
    assert "Paris" in prefilled.content[0].text
    # A forced call: a tool_use block whose input matches the schema, stop_reason tool_use.
    assert call.stop_reason == "tool_use" and [b.type for b in call.content] == ["tool_use"]
    use = call.content[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    assert streamed_call.stop_reason == "tool_use" and streamed_call.content[0].type == "tool_use"
    jsonschema.validate(streamed_call.content[0].input, WEATHER)
    partial = "".join(
        e.delta.partial_json
        for e in tool_events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == streamed_call.content[0].input
    starts = [e.content_block for e in tool_events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["tool_use"] and starts[0].input == {} and starts[0].name == "get_weather"
    # The result goes back as a tool_result block; with tool_choice none the model answers in text.
    assert answer.stop_reason == "end_turn" and answer.content[0].type == "text" and answer.content[0].text
    assert counted.input_tokens > call.usage.input_tokens - 5  # the tools are in the prompt either way
    jsonschema.validate(json.loads(structured.content[0].text), schema)


@pytest.mark.e2e
async def test_errors_have_anthropics_shape_and_keys_go_in_x_api_key(model_parts):
    async with running_server(model_parts, server=ServerConfig(api_key=("sk-secret",))) as srv:

        def run():
            good, bad = sdk(srv, "sk-secret"), sdk(srv, "wrong")
            caught = {}
            calls = {
                "key": lambda: bad.messages.create(model=MODEL, max_tokens=5, messages=QUESTION),
                "model": lambda: good.messages.create(model="nope", max_tokens=5, messages=QUESTION),
                "image": lambda: good.messages.create(
                    model=MODEL,
                    max_tokens=5,
                    messages=[
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "image",
                                    "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                                }
                            ],
                        }
                    ],
                ),
                "server_tool": lambda: good.messages.create(
                    model=MODEL,
                    max_tokens=5,
                    messages=QUESTION,
                    tools=[{"type": "web_search_20250305", "name": "web_search"}],
                ),
                "no_max_tokens": lambda: good.post(
                    "/v1/messages", cast_to=object, body={"model": MODEL, "messages": QUESTION}
                ),
                "temperature": lambda: good.messages.create(
                    model=MODEL, max_tokens=5, messages=QUESTION, extra_body={"temperature": 1.5}
                ),
                "context": lambda: good.messages.create(model=MODEL, max_tokens=10**6, messages=QUESTION),
                "budget": lambda: good.messages.create(
                    model=MODEL, max_tokens=2000, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 4000}
                ),
            }
            for name, call in calls.items():
                try:
                    call()
                except anthropic.APIStatusError as exc:
                    caught[name] = exc
            ok = good.messages.create(model=MODEL, max_tokens=5, messages=QUESTION)
            bearer = httpx.post(
                srv.url + "/v1/messages",
                json={"model": MODEL, "max_tokens": 5, "messages": QUESTION},
                headers={"Authorization": "Bearer sk-secret", "anthropic-version": "2023-06-01"},
            )
            unknown = httpx.post(srv.url + "/v1/messages/nothing", json={}, headers={"x-api-key": "sk-secret"})
            return caught, ok, bearer, unknown

        caught, ok, bearer, unknown = await in_thread(run)
    assert ok.content and bearer.status_code == 200 and bearer.json()["type"] == "message"
    expected = {
        "key": (401, "authentication_error"),
        "model": (404, "not_found_error"),
        "image": (400, "invalid_request_error"),
        "server_tool": (400, "invalid_request_error"),
        "no_max_tokens": (400, "invalid_request_error"),
        "temperature": (400, "invalid_request_error"),
        "context": (400, "invalid_request_error"),
        "budget": (400, "invalid_request_error"),
    }
    for name, (status, kind) in expected.items():
        exc = caught[name]
        assert exc.status_code == status, name
        assert exc.body["type"] == "error" and exc.body["error"]["type"] == kind and exc.body["error"]["message"], name
    assert "'image' blocks are not supported" in caught["image"].body["error"]["message"]
    assert "messages[0].content[0]" in caught["image"].body["error"]["message"]
    assert "web_search_20250305" in caught["server_tool"].body["error"]["message"]
    assert "max_tokens" in caught["no_max_tokens"].body["error"]["message"]
    assert "budget_tokens" in caught["budget"].body["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


@pytest.mark.e2e
async def test_thinking_blocks_and_a_dropped_stream_frees_its_pages(model_parts):
    """deepseek_r1 makes a reply without ``</think>`` all thinking: one thinking block."""
    async with running_server(model_parts, reasoning_parser="deepseek_r1") as srv:

        def run():
            c = sdk(srv)
            # (the model stops on its own long before max_tokens)
            kwargs = {
                "model": MODEL,
                "max_tokens": 1100,
                "messages": QUESTION,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "extra_body": GREEDY,
            }
            whole = c.messages.create(**kwargs)
            events, final = _stream(c, **kwargs)
            off = c.messages.create(**{**kwargs, "thinking": {"type": "disabled"}})
            return whole, events, final, off

        whole, events, final, off = await in_thread(run)
        [thinking] = whole.content
        assert thinking.type == "thinking" and thinking.thinking and whole.stop_reason == "end_turn"
        streamed = "".join(
            e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
        )
        assert streamed == thinking.thinking and [b.type for b in final.content] == ["thinking"]
        assert [b.type for b in off.content] == ["text"] and off.content[
            0
        ].text == thinking.thinking  # no split: the same text

        before = srv.engine.stats().num_aborted
        body = {
            "model": MODEL,
            "max_tokens": 1500,
            "stream": True,
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "thinking": {"type": "disabled"},
        }
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            async with http.stream("POST", "/v1/messages", json=body) as stream:
                deltas = 0
                async for line in stream.aiter_lines():
                    deltas += line == "event: content_block_delta"
                    if deltas == 5:
                        break
        await wait_idle(srv.engine, timeout=10)
        assert srv.engine.stats().num_aborted == before + 1
