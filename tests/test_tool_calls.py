# ruff: noqa: E501  (call texts and tool definitions read best on one line)
"""Tool calls: the formats' grammars and parsers, and round trips through the real server
with the real ``openai`` client on the default model (generic format: its template knows no tools)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from trillm.api.tools.formats import FORMATS, detect
from trillm.api.tools.spec import Function, ToolSet
from trillm.api.tools.stream import ToolStream

from tests.server import MODEL, client, in_thread

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"type": "integer", "maximum": 999}},
                "required": ["a", "b"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _reassemble(chunks) -> tuple[str, list[dict]]:
    content, calls = "", {}
    for ch in chunks:
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] = (tc.function.name if tc.function else None) or entry["name"]
            entry["arguments"] += (tc.function.arguments if tc.function else None) or ""
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(
    ("name", "text", "content", "calls"),
    [
        (
            "hermes",
            'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
            "Sure.",
            [("add", {"a": 1, "b": 2})],
        ),
        ("hermes", "No call here.", "No call here.", []),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]',
            None,
            [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})],
        ),
        (
            "llama3_json",
            '<|python_tag|>{"name": "add", "parameters": {"a": 5, "b": 6}}',
            None,
            [("add", {"a": 5, "b": 6})],
        ),
        (
            "generic",
            '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}',
            None,
            [("add", {"a": 1, "b": 2})],
        ),
        ("generic", '{"response": "Hello!"}', "Hello!", []),
        (
            "generic",
            '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "ad',
            None,
            [("add", {"a": 1, "b": 2})],
        ),
    ],
)
def test_parsers_split_content_and_calls(name, text, content, calls):
    parsed = FORMATS[name].parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert all(c.id.startswith("call_") for c in parsed.calls)


@pytest.mark.parametrize("name", ["hermes", "mistral", "llama3_json"])
def test_streaming_holds_back_markup_and_matches_the_parser(name):
    fmt = FORMATS[name]
    call = {
        "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    }[name]
    text = "Let me add. " + call
    stream = ToolStream(fmt)
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3])] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Let me add. " and fmt.trigger[:2] not in content
    args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", ()))
    assert json.loads(args) == {"a": 1, "b": 2}


def test_templates_choose_their_format():
    assert detect(None).name == "generic"
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}").name == "generic"
    assert detect("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert detect("{% if tools %}[TOOL_CALLS]{% endif %}").name == "mistral"
    assert detect("{% if tools %}<|python_tag|>{% endif %}").name == "llama3_json"


@pytest.mark.parametrize("name", sorted(FORMATS))
async def test_every_format_grammar_compiles(engine, name):
    fn = Function("get_weather", "", WEATHER)
    for choice in ("auto", "required", "get_weather"):
        spec = FORMATS[name].grammar(ToolSet((fn,), choice, True))
        assert engine.grammars.compile_now(spec).compiled is not None


@pytest.mark.e2e
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_round_trip_call_then_tool_result_then_answer(server, choice):
    def run():
        c = client(server)
        first = c.chat.completions.create(  # one call keeps it short; parallel calls: the auto test
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=0,
        )
        message = first.choices[0].message
        history = ASK + [message.model_dump(exclude_none=True)]
        history += [
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}
            for call in message.tool_calls or ()
        ]
        final = c.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
        )
        return first, final

    first, final = await in_thread(run)
    choice0 = first.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    calls = choice0.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len(calls) == 1
    for call in calls:
        spec = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")


@pytest.mark.e2e
async def test_streamed_calls_reassemble_to_the_non_streamed_ones(server):
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )

    def run():
        c = client(server)
        return c.chat.completions.create(**kwargs), list(c.chat.completions.create(stream=True, **kwargs))

    whole, chunks = await in_thread(run)
    content, streamed = _reassemble(chunks)
    assert content == "" and chunks[-1].choices[0].finish_reason == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in streamed] == expected
    assert all(c["id"].startswith("call_") for c in streamed)


@pytest.mark.e2e
async def test_parallel_off_and_auto_and_bad_tool_requests(server):
    def run():
        c = client(server)
        single = c.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=0,
        )
        auto = c.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0.7, seed=1
        )
        return single, auto

    single, auto = await in_thread(run)
    assert len(single.choices[0].message.tool_calls) == 1
    message = auto.choices[0].message
    assert message.tool_calls or message.content  # auto: a call or an answer, never raw JSON markup
    assert not (message.content or "").startswith('{"')
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for extra, param in cases:
            r = await http.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 5, **extra}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


@pytest.mark.e2e
async def test_content_parts_on_every_role_and_legacy_functions(server):
    parts = lambda text: [{"type": "text", "text": text}]  # noqa: E731
    messages = [
        {"role": "system", "content": parts("Be brief.")},
        {"role": "user", "content": parts("Add 2 and 3.")},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": parts("5")},
    ]

    def run():
        c = client(server)
        answer = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
        legacy = c.chat.completions.create(
            model=MODEL,
            messages=ASK,
            functions=[TOOLS[0]["function"]],
            function_call={"name": "get_weather"},
            max_tokens=200,
            temperature=0,
        )
        return answer, legacy

    answer, legacy = await in_thread(run)
    assert answer.choices[0].message.content
    legacy_choice = legacy.choices[0]
    assert legacy_choice.finish_reason == "function_call" and legacy_choice.message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(legacy_choice.message.function_call.arguments), WEATHER)
