"""Structured outputs end to end: every constrained output matches its schema, whatever
the sampling, ``n``, streaming, preemption or cancellation; bad constraints are 400s."""

from __future__ import annotations

import gc
import json
import re

import httpx
import jsonschema
import pydantic
import pytest
import trio

from trillm.engine.structured import GrammarSpec, Matcher

from tests.helpers import wait_idle
from tests.server import MODEL, client, in_thread, running_server

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "Describe a person as JSON."}]

# Strings and arrays are bounded so that every greedy or sampled output can finish.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": PERSON,
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["person", "address"],
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
            "mood": {"type": "string", "enum": ["happy", "sad"]},
        },
        "required": ["colors", "mood"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": 10, "maximum": 20},
            "flag": {"type": "boolean"},
        },
        "required": ["score", "count", "flag"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 16}, "note": {"type": "string", "maxLength": 16}},
        "required": ["title"],
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
}


def json_schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def live_matchers(engine) -> int:
    """Grammar states still alive once ``engine`` is idle and no step is in flight (the
    overlap scheduler may have launched one more step for a sequence that just ended)."""
    await wait_idle(engine)
    with trio.fail_after(10):
        while engine.loop.in_flight:
            await trio.sleep(0.01)
    gc.collect()
    return sum(type(o) is Matcher for o in gc.get_objects())


def check_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
async def test_outputs_match_each_schema_greedy_and_sampled(server, name):
    schema = SCHEMAS[name]

    def run():
        c = client(server)
        greedy = c.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=200, temperature=0, response_format=json_schema_format(schema)
        )
        sampled = c.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=200,
            temperature=1.0,
            n=2,
            seed=7,
            top_p=0.95,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            extra_body={"top_k": 40, "repetition_penalty": 1.1},
            response_format=json_schema_format(schema),
        )
        return greedy, sampled

    greedy, sampled = await in_thread(run)
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.finish_reason == "stop", choice
        check_valid(choice.message.content, schema)
    assert await live_matchers(server.engine) == 0


async def test_streaming_json_object_and_completions_endpoint(server):
    def run():
        c = client(server)
        chunks = list(
            c.chat.completions.create(
                model=MODEL,
                messages=ASK,
                max_tokens=120,
                temperature=0.7,
                seed=3,
                stream=True,
                response_format={"type": "json_object"},
                logprobs=True,
                top_logprobs=5,
            )
        )
        done = c.completions.create(
            model=MODEL,
            prompt="A JSON object describing a cat:",
            max_tokens=120,
            temperature=0,
            extra_body={"response_format": {"type": "json_object"}},
        )
        return chunks, done

    chunks, done = await in_thread(run)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text), dict)
    # Forbidden alternatives carry OpenAI's floor, never -inf (which JSON cannot hold).
    tops = [
        t.logprob
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
        for t in e.top_logprobs
    ]
    assert tops and all(-9999.0 <= lp <= 0 for lp in tops) and min(tops) == -9999.0
    assert done.choices[0].finish_reason == "stop" and isinstance(json.loads(done.choices[0].text), dict)


async def test_regex_choice_and_grammar_extensions(server):
    grammar = 'root ::= "The answer is " [0-9] [0-9]? "."'

    def run():
        c = client(server)
        ask = [{"role": "user", "content": "Pick one."}]
        out = {}
        for key, body in {
            "regex": {"guided_regex": r"[A-Z][a-z]{2,8} [0-9]{3}"},
            "choice": {"structured_outputs": {"choice": ["yes", "no", 'maybe "so"']}},
            "grammar": {"guided_grammar": grammar},
            "choice_legacy": {"guided_choice": ["alpha", "beta"]},
        }.items():
            out[key] = c.chat.completions.create(
                model=MODEL, messages=ask, max_tokens=40, temperature=1.0, n=3, seed=1, extra_body=body
            )
        return out

    out = await in_thread(run)
    for choice in out["regex"].choices:
        assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{3}", choice.message.content) and choice.finish_reason == "stop"
    assert {c.message.content for c in out["choice"].choices} <= {"yes", "no", 'maybe "so"'}
    assert {c.message.content for c in out["choice_legacy"].choices} <= {"alpha", "beta"}
    for choice in out["grammar"].choices:
        assert re.fullmatch(r"The answer is [0-9][0-9]?\.", choice.message.content)


async def test_sdk_parse_returns_a_parsed_object(server):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        population: int = pydantic.Field(ge=0, le=10**8)

    def run():
        return client(server).chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "A city as JSON."}],
            max_tokens=100,
            temperature=0,
            response_format=City,
        )

    completion = await in_thread(run)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and completion.choices[0].finish_reason == "stop"


async def test_bad_constraints_are_400s_naming_the_field(server):
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
            "response_format.json_schema.name",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for extra, param in cases:
            r = await http.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 5, **extra}
            )
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", (extra, err)
        # Other requests are unaffected.
        ok = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 5})
        assert ok.status_code == 200


async def test_a_repeated_schema_compiles_once(server):
    stats = server.engine.grammars.stats
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}

    def run():
        c = client(server)
        for _ in range(3):
            c.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=20, temperature=0, response_format=json_schema_format(schema)
            )

    before_compiled, before_hits = stats.compiled, stats.cache_hits
    await in_thread(run)
    assert stats.compiled == before_compiled + 1 and stats.cache_hits >= before_hits + 2


async def test_compile_past_the_time_limit_is_a_400(model_parts):
    async with running_server(model_parts, grammar_compile_timeout=1e-4) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            big = {
                "type": "object",
                "properties": {f"f{i}": {"type": "string", "pattern": "^[a-z]{3,9}@[a-z]+$"} for i in range(40)},
            }
            r = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": ASK, "response_format": json_schema_format(big)},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
            assert "did not compile within" in r.json()["error"]["message"]


async def test_preemption_and_overlap_off_keep_outputs_valid(model_parts):
    schema = SCHEMAS["array_enum"]
    for overrides in ({"num_pages": 12, "max_num_seqs": 8}, {"overlap_schedule": False}):
        async with running_server(model_parts, **overrides) as srv:

            async def one(results: list, i: int, srv=srv) -> None:
                def call():
                    return client(srv).chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"Colors for mood {i}, as JSON." * 3}],
                        max_tokens=60,
                        temperature=1.0,
                        seed=i,
                        response_format=json_schema_format(schema),
                    )

                results.append(await in_thread(call))

            results: list = []
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(one, results, i)
            for r in results:
                assert r.choices[0].finish_reason == "stop"
                check_valid(r.choices[0].message.content, schema)
            if "num_pages" in overrides:
                assert srv.engine.scheduler.num_preemptions > 0
            assert await live_matchers(srv.engine) == 0


async def test_cancel_mid_grammar_frees_pages_and_matchers(server):
    schema = {"type": "object", "properties": {"essay": {"type": "string"}}, "required": ["essay"]}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        body = {
            "model": MODEL,
            "messages": ASK,
            "max_tokens": 500,
            "stream": True,
            "response_format": json_schema_format(schema),
        }
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 5:
                    break
    await wait_idle(server.engine)
    assert await live_matchers(server.engine) == 0


async def test_client_gone_while_compiling_leaves_nothing(server):
    big = {
        "type": "object",
        "properties": {f"g{i}": {"type": "string", "pattern": "^[a-z]{2,7}[0-9]+$"} for i in range(30)},
    }
    await server.engine.compile_grammar(GrammarSpec.json_object())  # the vocabulary is read: only the compile is left
    compiled = server.engine.grammars.stats.compiled
    async with httpx.AsyncClient(base_url=server.url, timeout=0.05) as http:
        with pytest.raises(httpx.TimeoutException):
            await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": ASK, "response_format": json_schema_format(big)},
            )
    await wait_idle(server.engine)
    with trio.fail_after(30):  # the abandoned compile finishes on its own and is cached
        while server.engine.grammars.stats.compiled == compiled:
            await trio.sleep(0.05)
    assert server.engine.stats().num_open_requests == 0 and await live_matchers(server.engine) == 0
    # And the server is fine.
    out = await in_thread(lambda: client(server).chat.completions.create(model=MODEL, messages=ASK, max_tokens=3))
    assert out.choices[0].finish_reason in ("stop", "length")
