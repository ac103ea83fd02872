# ruff: noqa: E501  (request bodies read best on one line)
"""``POST /v1/responses`` end to end: round trips through the real server with the real ``openai``
client on the default model (plain, streamed, structured, tool calls, errors, cancellation).
The request mapping and the event writer alone: ``test_responses_request.py``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.helpers import wait_idle
from tests.server import MODEL, client, in_thread, running_server

QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "maximum": 99999999}},
    "required": ["name", "population"],
}


class City(BaseModel):
    name: str = Field(max_length=20)
    population: int = Field(le=99999999)  # bounded, or a small model may write digits until cut


@pytest.mark.e2e
async def test_plain_text_and_instructions_and_messages(server):
    def run():
        c = client(server)
        plain = c.responses.create(model=MODEL, input=QUESTION, temperature=0)  # no max: until the model stops
        chat = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=200
        )
        listed = c.responses.create(
            model=MODEL,
            instructions="You are a geography teacher.",
            input=[
                {"role": "user", "content": "Name a river in France."},
                {"role": "assistant", "content": "The Seine."},
                {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
            ],
            max_output_tokens=30,
            temperature=0,
            metadata={"run": "test"},
        )
        return plain, chat, listed

    plain, chat, listed = await in_thread(run)
    assert plain.id.startswith("resp_") and plain.object == "response" and plain.status == "completed"
    assert plain.output_text == chat.choices[0].message.content and "Paris" in plain.output_text
    [item] = plain.output
    assert (
        item.type == "message"
        and item.id.startswith("msg_")
        and item.role == "assistant"
        and item.status == "completed"
    )
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert (
        plain.usage.input_tokens == chat.usage.prompt_tokens
        and plain.usage.output_tokens == chat.usage.completion_tokens
    )
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens
    assert (
        plain.store is False and plain.incomplete_details is None and plain.tools == [] and plain.tool_choice == "auto"
    )
    assert (
        listed.output_text
        and listed.instructions == "You are a geography teacher."
        and listed.metadata == {"run": "test"}
    )
    assert (
        listed.usage.input_tokens > plain.usage.input_tokens + 10
    )  # the instructions and the history reached the prompt


def _events(server, **kwargs):
    def run():
        c = client(server)
        whole = c.responses.create(**kwargs)
        streamed = list(c.responses.create(stream=True, **kwargs))
        with c.responses.stream(**kwargs) as helper:
            final = helper.get_final_response()
        return whole, streamed, final

    return in_thread(run)


@pytest.mark.e2e
async def test_stream_events_in_order_reassemble_the_text(server):
    whole, events, final = await _events(server, model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0)
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(deltas) > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-4].text == final.output_text
    done = events[-1].response
    assert done.status == "completed" and done.output[0].id == item_id and done.output_text == text
    assert done.usage.output_tokens == whole.usage.output_tokens and done.id == events[0].response.id


@pytest.mark.e2e
async def test_raw_stream_has_sse_event_lines_and_incomplete_ends(server):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 3, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        whole = (await http.post("/v1/responses", json=body)).json()
        async with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in stream.aiter_lines() if line]
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert whole["output"][0]["status"] == "incomplete" and whole["usage"]["output_tokens"] == 3
    names = [line[len("event: ") :] for line in lines[0::2]]
    payloads = [json.loads(line[len("data: ") :]) for line in lines[1::2]]
    assert [p["type"] for p in payloads] == names and "[DONE]" not in "".join(lines)
    assert names[-1] == "response.incomplete" and payloads[-1]["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert payloads[-2]["item"]["status"] == "incomplete"
    assert payloads[-1]["response"]["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]


@pytest.mark.e2e
async def test_structured_output_and_parse(server):
    def run():
        c = client(server)
        fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
        raw = c.responses.create(
            model=MODEL, input="Describe Paris as JSON.", text={"format": fmt}, max_output_tokens=60, temperature=0
        )
        parsed = c.responses.parse(
            model=MODEL, input="Describe Paris as JSON.", text_format=City, max_output_tokens=60, temperature=0
        )
        any_json = c.responses.create(
            model=MODEL,
            input="Describe Paris as JSON.",
            text={"format": {"type": "json_object"}},
            max_output_tokens=60,
            temperature=0,
        )
        return raw, parsed, any_json

    raw, parsed, any_json = await in_thread(run)
    jsonschema.validate(json.loads(raw.output_text), CITY)
    assert raw.status == "completed" and raw.text.format.type == "json_schema"
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name
    assert isinstance(json.loads(any_json.output_text), dict)


@pytest.mark.e2e
async def test_function_call_then_output_round_trip(server):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]

    def run():
        c = client(server)
        first = c.responses.create(
            model=MODEL,
            input=ask,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=200,
            temperature=0,
        )
        history = ask + list(first.output)  # the SDK's own output objects, sent back as they are
        history += [
            {"type": "function_call_output", "call_id": item.call_id, "output": json.dumps({"temperature": 18})}
            for item in first.output
            if item.type == "function_call"
        ]
        final = c.responses.create(
            model=MODEL, input=history, tools=TOOLS, tool_choice="none", max_output_tokens=40, temperature=0
        )
        streamed = list(
            c.responses.create(
                model=MODEL,
                input=ask,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                max_output_tokens=200,
                temperature=0,
                stream=True,
            )
        )
        return first, final, streamed

    first, final, streamed = await in_thread(run)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed" and first.output_text == ""
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
        assert call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert final.output_text and not [item for item in final.output if item.type == "function_call"]
    assert first.tools[0].name == "get_weather" and first.tool_choice == "required"

    kinds = [e.type for e in streamed]
    assert kinds[2] == "response.output_item.added" and streamed[2].item.type == "function_call"
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    args = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    assert args == "".join(c.arguments for c in calls)


@pytest.mark.e2e
async def test_bad_requests_are_400s_naming_the_field(server):
    cases = [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
        ({"tools": TOOLS, "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for extra, param in cases:
            r = await http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        r = await http.post("/v1/responses", json={"model": "other", "input": QUESTION})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await http.get("/v1/responses/resp_123")
        assert r.status_code == 404 and r.json()["error"]["code"] == "unsupported_endpoint"
        stored = await http.post(
            "/v1/responses", json={"model": MODEL, "input": QUESTION, "store": True, "max_output_tokens": 2}
        )
        assert stored.status_code == 200 and stored.json()["store"] is False


@pytest.mark.e2e
async def test_a_stream_dropped_midway_frees_its_pages(server):
    body = {"model": MODEL, "input": "Write a long story about a dragon.", "max_output_tokens": 1500, "stream": True}
    before = server.engine.stats().num_aborted
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        async with http.stream("POST", "/v1/responses", json=body) as stream:
            deltas = 0
            async for line in stream.aiter_lines():
                deltas += line == "event: response.output_text.delta"
                if deltas == 5:
                    break
    await wait_idle(server.engine, timeout=10)
    assert server.engine.stats().num_aborted == before + 1


@pytest.mark.e2e
async def test_thinking_is_a_reasoning_item(model_parts):
    """deepseek_r1 makes a reply without ``</think>`` all thinking: a reasoning item, then an empty message."""
    async with running_server(model_parts, reasoning_parser="deepseek_r1") as srv:
        whole, events, final = await _events(srv, model=MODEL, input=QUESTION, max_output_tokens=60, temperature=0)
        thinking, message = whole.output
        assert thinking.type == "reasoning" and thinking.id.startswith("rs_") and thinking.content[0].text
        assert message.type == "message" and whole.output_text == "" and message.status == "completed"
        assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= whole.usage.output_tokens
        streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert streamed == thinking.content[0].text
        assert [item.type for item in final.output] == ["reasoning", "message"]
        assert events[-1].type == "response.completed" and whole.status == "completed"
