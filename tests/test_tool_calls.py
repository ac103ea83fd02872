# ruff: noqa: E501  (call texts and tool definitions read best on one line)
"""Tool calls: the formats' grammars and parsers, and round trips through the real server
with the real ``openai`` client on the default model (generic format: its template knows no tools),
and with the agent frameworks that found the issue's items 6-9 (instructor, the OpenAI Agents SDK,
LangChain)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import httpx
import jsonschema
import openai
import pytest
import trio
import xgrammar
from pydantic import BaseModel, Field

from trillm.api.tools.formats import FORMATS, detect
from trillm.api.tools.generic import Imitation, StringDecoder
from trillm.api.tools.prompt import plain_messages
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
# With tools offered, the default model answers this in text (greedy), longer than a small max_tokens.
ASK_TEXT = "What is the capital of France and what is it famous for?"


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
        # Cut by max_tokens (issue item 8): the text so far unwrapped; a call cut short is no content.
        ("generic", '{"response": "Paris is a city in Eu', "Paris is a city in Eu", []),
        ("generic", '{"response": "say \\"hi\\" \\u00e9\\u', 'say "hi" é', []),
        ("generic", '{"tool_calls": [{"name": "get', None, []),
        ("generic", '{"respo', None, []),
        ("hermes", 'Sure. <tool_call>\n{"name": "add", "argu', "Sure.", []),
        (
            "hermes",
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n{"na',
            None,
            [("add", {"a": 1, "b": 2})],
        ),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "a',
            None,
            [("add", {"a": 1, "b": 2})],
        ),
        ("llama3_json", 'Let me see. {"name": "add", "parameters": {"a"', "Let me see.", []),
    ],
)
def test_parsers_split_content_and_calls(name, text, content, calls):
    parsed = FORMATS[name].parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert all(c.id.startswith("call_") for c in parsed.calls)


@pytest.mark.parametrize("name", ["hermes", "mistral", "llama3_json", "harmony"])
def test_streaming_holds_back_markup_and_matches_the_parser(name):
    fmt = FORMATS[name]
    call = {
        "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
        "harmony": '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>',
    }[name]
    text = "Let me add. " + call
    stream = ToolStream(fmt)
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3])] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Let me add. " and fmt.trigger[:2] not in content
    args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", ()))
    assert json.loads(args) == {"a": 1, "b": 2}


def test_generic_text_and_calls_stream_as_they_are_written():
    """Issue item 7: under the generic format a text answer (and a call) was sent whole at the end."""
    answer = 'Hi "you" \\ caf\u00e9 \U0001f600 done'
    text = json.dumps({"response": answer})
    stream = ToolStream(FORMATS["generic"])
    fed = [stream.feed(text[i : i + 2]) for i in range(0, len(text), 2)]
    shown = [d["content"] for ds in fed for d in ds]
    assert len(shown) > 10 and "".join(shown) == answer  # decoded as it came, escapes whole
    assert not any(d for ds in fed[:6] for d in ds)  # nothing until the opening is written: `{"response": "`
    assert fed[7] and stream.finish() == []
    call = '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": "}"}}, {"name": "add", "arguments": {"a": 3}}]}'
    stream = ToolStream(FORMATS["generic"])
    fed = [stream.feed(call[i : i + 3]) for i in range(0, len(call), 3)]
    deltas = [d for ds in fed for d in ds] + stream.finish()
    assert sum(1 for ds in fed if ds) > 5 and not any("content" in d for d in deltas)  # as it came
    streamed = {}
    for d in deltas:
        [tc] = d["tool_calls"]
        entry = streamed.setdefault(tc["index"], {"name": None, "arguments": ""})
        entry["name"] = tc["function"].get("name") or entry["name"]
        entry["arguments"] += tc["function"]["arguments"]
        assert tc.get("id", "call_").startswith("call_")
    assert [(e["name"], json.loads(e["arguments"])) for e in streamed.values()] == [
        ("add", {"a": 1, "b": "}"}),
        ("add", {"a": 3}),
    ]
    assert len(stream.calls) == 2


def test_cut_stream_is_the_text_so_far_or_nothing_of_a_call():
    """Issue item 8, streamed: a cut answer ends as its text; a cut call sends no content."""
    stream = ToolStream(FORMATS["generic"])
    deltas = stream.feed('{"response": "Paris is') + stream.feed(" a ci") + stream.finish()
    assert "".join(d["content"] for d in deltas) == "Paris is a ci"
    for name, cut in [("generic", '{"tool_calls": [{"name": "get_wea'), ("hermes", 'Ok <tool_call>\n{"name": "get')]:
        stream = ToolStream(FORMATS[name])
        deltas = stream.feed(cut) + stream.finish()
        assert "".join(d.get("content", "") for d in deltas) in ("", "Ok ") and not stream.calls, name


def test_string_decoder_holds_partial_escapes():
    decoder = StringDecoder()
    pieces = [decoder.feed(p) for p in ["a\\", "n b\\u00", "e9 \\ud83d", "\\ude00", '!" tail']]
    assert pieces == ["a", "\n b", "é ", "😀", "!"] and decoder.done


def test_imitated_wrappers_are_unwrapped_without_tools():
    """Issue item 9: with no tools in the request, a reply imitating the generic JSON is unwrapped."""
    fmt = Imitation()
    wrapped = json.dumps({"tool_response": {"tool_call_id": "call_1", "name": "get_weather", "content": "18 degrees"}})
    assert fmt.parse(wrapped).content == "18 degrees"
    assert fmt.parse('{"response": "It is sunny."}').content == "It is sunny."
    assert fmt.parse("It is sunny.").content == "It is sunny." and fmt.parse('{"a": 1}').content == '{"a": 1}'
    stream = ToolStream(fmt)
    deltas = stream.feed('{"response": "It is') + stream.feed(' sunny."}') + stream.finish()
    assert [d["content"] for d in deltas] == ["It is", " sunny."]
    stream = ToolStream(fmt)
    deltas = stream.feed("Plain ") + stream.feed("text.") + stream.finish()
    assert [d["content"] for d in deltas] == ["Plain ", "text."]


def test_tool_turns_without_tools_render_as_text_not_the_generic_json():
    """Issue item 9: history was rendered as the generic JSON, which a tool-free turn then imitated."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    out = plain_messages(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
        ]
    )
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[1]["content"] == 'I called get_weather({"city": "Paris"}).'
    assert out[2]["content"] == "get_weather returned: 18 degrees"
    assert not any(k in m["content"] for m in out for k in ("tool_response", "tool_calls", '{"response"'))


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


# Schemas OpenAI accepts in `parameters` that a new root breaks: what pydantic writes for nested
# and recursive models ($defs), the older `definitions`, a pointer into properties, `#` itself.
NODE = {
    "type": "object",
    "properties": {
        "v": {"type": "integer"},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2},
    },
    "required": ["v", "kids"],
}
REF_SCHEMAS = {
    "defs": {
        "$defs": {"Node": NODE, "Pet": {"enum": ["cat", "dog"]}},
        "type": "object",
        "properties": {
            "root": {"$ref": "#/$defs/Node"},
            "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"const": "none"}]},
        },
        "required": ["root", "pet"],
    },
    "definitions": {
        "definitions": {
            "U": {"type": "object", "properties": {"n": {"type": "string", "maxLength": 5}}, "required": ["n"]}
        },
        "type": "object",
        "properties": {"u": {"$ref": "#/definitions/U"}},
        "required": ["u"],
    },
    "pointer": {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"$ref": "#/properties/a"}},
        "required": ["a", "b"],
    },
    "root": {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["v", "next"],
    },
}
REF_INSTANCES = {
    "defs": (
        {"root": {"v": 1, "kids": [{"v": 2, "kids": []}]}, "pet": "cat"},
        {"root": {"v": 1, "kids": [{"v": "x", "kids": []}]}, "pet": "cat"},
    ),
    "definitions": ({"u": {"n": "ab"}}, {"u": {"n": 3}}),
    "pointer": ({"a": "x", "b": "y"}, {"a": "x", "b": 1}),
    "root": ({"v": 1, "next": {"v": 2, "next": None}}, {"v": 1, "next": {"v": "2", "next": None}}),
}


@pytest.mark.parametrize("kind", sorted(REF_SCHEMAS))
def test_tool_parameters_with_refs_compile_and_constrain(kind):
    """Issue item 6: `$defs`/`$ref` in `parameters` were a 400 (`Cannot find field '$defs'`): the
    generic grammar put them under a new root. Each format's grammar compiles, and the generic one
    accepts a valid call and refuses one that breaks the referenced schema."""
    fn, other = Function("f", "", REF_SCHEMAS[kind]), Function("g", "", REF_SCHEMAS["defs"])
    good, bad = REF_INSTANCES[kind]
    jsonschema.validate(good, REF_SCHEMAS[kind])
    for fmt in FORMATS.values():
        for choice in ("auto", "required", "f"):
            spec = fmt.grammar(ToolSet((fn, other), choice, True))
            if spec.kind == "json_schema":
                grammar = xgrammar.Grammar.from_json_schema(spec.source, any_whitespace=False, strict_mode=True)
                call = lambda args: json.dumps({"tool_calls": [{"name": "f", "arguments": args}]})  # noqa: E731
                assert xgrammar.testing._is_grammar_accept_string(grammar, call(good)), (kind, choice)
                assert not xgrammar.testing._is_grammar_accept_string(grammar, call(bad)), (kind, choice)
            else:
                xgrammar.Grammar.from_structural_tag(spec.source)


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


# --- The agent frameworks that found issue items 6-9, against the real server. ---


class Address(BaseModel):
    city: str = Field(max_length=20)  # bounded, or a small model may write until cut


class User(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    address: Address  # a nested model: pydantic writes `$defs` and `$ref`


@pytest.mark.e2e
async def test_nested_model_tools_from_instructor_and_pydantic_function_tool(server):
    """Issue item 6: both sent `parameters` with `$defs`, refused with `Cannot find field '$defs'`."""
    import instructor

    ask = [{"role": "user", "content": "Alice is 30 and lives in Paris."}]

    def run():
        c = client(server)
        users = list(
            instructor.from_openai(c, mode=instructor.Mode.TOOLS).chat.completions.create_iterable(
                model=MODEL, messages=ask, response_model=User, max_retries=0, max_tokens=60, temperature=0
            )
        )
        tool = openai.pydantic_function_tool(User)
        parsed = c.chat.completions.parse(
            model=MODEL,
            messages=ask,
            tools=[tool],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
            temperature=0,
        )
        auto = c.chat.completions.create(model=MODEL, messages=ask, tools=[tool], max_tokens=5, temperature=0)
        return tool, users, parsed, auto

    tool, users, parsed, auto = await in_thread(run)
    assert "$defs" in tool["function"]["parameters"]
    assert users and all(isinstance(u, User) for u in users)  # instructor validated each against the model
    [call] = parsed.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, User)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")  # compiled: no 400


WEATHER_REPLY = json.dumps({"city": "Paris", "temperature_c": 18})


@pytest.mark.e2e
async def test_agents_sdk_final_output_is_clean_text_streamed_and_not(server):
    """Issue items 7-9 through the OpenAI Agents SDK (a chat model, a function tool): its
    final_output was the raw `{"response": "...` when max_tokens cut the answer, and streamed
    the answer came in one piece at the end. Also a round trip: a call, the tool's result, an
    answer with `tool_choice: "none"`."""
    import agents

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return WEATHER_REPLY

    class AnswerAfterOneCall(agents.RunHooks):
        """The tiny model would call tools until max_turns: after one call, it must answer."""

        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    def agent(tool_choice: str | None = None, max_tokens: int = 12):
        model = agents.OpenAIChatCompletionsModel(
            model=MODEL, openai_client=openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        )
        settings = agents.ModelSettings(temperature=0, max_tokens=max_tokens, tool_choice=tool_choice)
        # reset_tool_choice would turn the hook's "none" back into auto
        return agents.Agent(
            name="a", model=model, tools=[get_weather], model_settings=settings, reset_tool_choice=False
        )

    def run():
        # The SDK is asyncio inside: Runner.run_sync, and asyncio.run for its stream, run its own
        # loop in this worker thread (the server's Trio loop is not involved).
        import asyncio

        whole = agents.Runner.run_sync(agent(), ASK_TEXT, max_turns=1)
        weather = agents.Runner.run_sync(
            agent("required", 40), ASK[0]["content"], max_turns=3, hooks=AnswerAfterOneCall()
        )

        async def streamed():
            result = agents.Runner.run_streamed(agent(), ASK_TEXT, max_turns=1)
            deltas = [
                e.data.delta
                async for e in result.stream_events()
                if e.type == "raw_response_event" and e.data.type == "response.output_text.delta"
            ]
            return result.final_output, deltas

        return whole.final_output, weather.final_output, asyncio.run(streamed())

    whole, weather, (final, deltas) = await in_thread(run)
    assert calls  # the round trip's tool ran
    for output in (whole, weather, final):
        assert isinstance(output, str) and output.strip(), output
        assert not output.lstrip().startswith("{") and '"response"' not in output and "tool_" not in output, output
    assert (
        final == whole and len(deltas) > 1 and "".join(deltas) == final
    )  # streamed as written (a busy machine coalesces pieces), unwrapped


@pytest.mark.e2e
async def test_langchain_responses_tool_round_trip_answers_in_text(server):
    """Issue item 9: LangChain (use_responses_api) sent the tool result back without tools and the
    answer was the raw `{"tool_response": {...` the history had taught the model."""
    import langchain_openai
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return WEATHER_REPLY

    def run():
        llm = langchain_openai.ChatOpenAI(
            model=MODEL,
            base_url=server.base_url,
            api_key="unused",
            use_responses_api=True,
            temperature=0,
            max_tokens=40,
            max_retries=0,
        )
        ask = HumanMessage("What is the weather in Paris?")
        called = llm.bind_tools([get_weather], tool_choice="required").invoke([ask])
        results = [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in called.tool_calls]
        return called, llm.invoke([ask, called, *results])

    called, answer = await in_thread(run)
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"
    text = answer.text if isinstance(answer.text, str) else answer.text()
    assert text.strip() and not answer.tool_calls
    assert not text.lstrip().startswith("{") and "tool_response" not in text and "call_" not in text, text


@pytest.mark.e2e
async def test_text_answer_with_tools_streams_early_and_a_cut_reply_is_unwrapped(server):
    """Issue items 7-8 on the raw wire: with `tools` (generic format, `auto`) a text answer came as
    one delta after the last token; cut by max_tokens it was the raw `{"response": "...`."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": ASK_TEXT}],
        "tools": TOOLS,
        "temperature": 0,
    }
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        start, arrivals = trio.current_time(), []
        async with http.stream(
            "POST", "/v1/chat/completions", json={**body, "max_tokens": 40, "stream": True, "logprobs": True}
        ) as stream:
            async for line in stream.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append((trio.current_time() - start, json.loads(line[6:])["choices"][0]))
        cut = (await http.post("/v1/chat/completions", json={**body, "max_tokens": 40})).json()["choices"][0]
        call_cut = (
            await http.post("/v1/chat/completions", json={**body, "tool_choice": "required", "max_tokens": 6})
        ).json()
        responses_body = {
            "model": MODEL,
            "input": body["messages"],
            "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "temperature": 0,
            "max_output_tokens": 40,
            "stream": True,
        }
        async with http.stream("POST", "/v1/responses", json=responses_body) as stream:
            events = [json.loads(line[6:]) async for line in stream.aiter_lines() if line.startswith("data: {")]
    content = [(t, c["delta"]["content"]) for t, c in arrivals if c["delta"].get("content")]
    text = "".join(piece for _, piece in content)
    assert arrivals[-1][1]["finish_reason"] == "length" and len(content) > 10, arrivals
    # Each token's chunk carries its logprobs, the wrapper's too: the first words come within the
    # first few tokens (`{"response": "` is the opening), and in the first half of the decode time.
    tokens = [(t, len(c["logprobs"]["content"]), bool(c["delta"].get("content"))) for t, c in arrivals if c["logprobs"]]
    before = sum(n for _, n, shown in itertools.takewhile(lambda x: not x[2], tokens))
    first_token, first_content, last = tokens[0][0], content[0][0], arrivals[-1][0]
    assert before <= 8 and sum(n for _, n, _ in tokens) >= 30, tokens
    assert first_content - first_token < (last - first_token) / 2, (first_token, first_content, last)
    assert text and not text.startswith("{") and text == cut["message"]["content"] and cut["finish_reason"] == "length"
    [choice] = call_cut["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert not choice["message"].get("tool_calls")  # a call cut short is no call, and no raw JSON
    text_deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    # streamed as it comes (a verification's run of up to 8 tokens arrives as one delta: fewer than tokens)
    assert len(text_deltas) > 2 and events[-1]["type"] == "response.incomplete"
    assert "".join(text_deltas) == events[-1]["response"]["output"][-1]["content"][0]["text"] == text
