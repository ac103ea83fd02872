"""Structured outputs end to end: every constrained output matches its schema, whatever
the sampling, ``n``, streaming, preemption or cancellation; bad constraints are 400s."""

from __future__ import annotations

import gc
import json
import os
import re

import httpx
import jsonschema
import pydantic
import pytest
import trio

from trillm.engine.structured import GrammarLimits, GrammarSpec, Matcher

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


def ref_chain(n: int, tag: str = "") -> dict:
    """A schema of ``n`` ``$ref`` each to the next: xgrammar's compile time grows steeply with
    ``n`` (1,000: ~1 s; 3,000: minutes); ``tag`` makes distinct ones."""
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "description": tag}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_slow_schemas_are_killed_at_the_limit_and_a_waiting_request_gets_503(model_parts):
    """Regression (issue item 2): two slow schemas held both compile slots, their threads ran on
    for minutes, and every other new grammar got a 400 blaming its schema. Now a compile past the
    limit is killed (its process is gone), only the slow schemas get the 400, a request that merely
    waited for a slot gets a 503 with Retry-After, and a trivial schema compiles at once afterwards."""
    async with running_server(model_parts, grammar_compile_timeout=2.0) as srv:
        grammars = srv.engine.grammars
        grammars.limits = GrammarLimits(max_refs=10**6, max_ref_depth=10**6, max_source_bytes=10**7)
        await srv.engine.compile_grammar(GrammarSpec.json_object())  # the workers' zygote is up
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:

            async def post(body: dict, out: dict, name: str) -> None:
                started = trio.current_time()
                r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
                out[name] = (r, trio.current_time() - started)

            slow = [
                {"max_tokens": 5, "response_format": json_schema_format(ref_chain(3000, f"s{i}"))} for i in range(4)
            ]
            trivial = {
                "max_tokens": 5,
                "response_format": json_schema_format(
                    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}}
                ),
            }
            out: dict = {}
            pids: set[int] = set()
            async with trio.open_nursery() as nursery:
                for i in range(2):  # these two take both workers
                    nursery.start_soon(post, slow[i], out, f"slow{i}")
                with trio.fail_after(10):
                    while len(grammars._busy) < 2:
                        await trio.sleep(0.02)
                pids |= {w.pid for w in grammars._busy}
                for i in (2, 3):  # these wait, then take the workers when the first two are killed
                    nursery.start_soon(post, slow[i], out, f"slow{i}")
                    await trio.sleep(0.2)
                nursery.start_soon(post, trivial, out, "waited")  # behind them: only waits
                with trio.fail_after(10):
                    while "slow0" not in out:
                        await trio.sleep(0.02)
                with trio.fail_after(5):
                    while len(grammars._busy) < 2 or {w.pid for w in grammars._busy} & pids:
                        await trio.sleep(0.02)
                pids |= {w.pid for w in grammars._busy}
            for i in range(4):
                r, seconds = out[f"slow{i}"]
                assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
                assert r.json()["error"]["code"] == "invalid_grammar"
                assert "did not compile within 2 s" in r.json()["error"]["message"]
            r, seconds = out["waited"]
            assert r.status_code == 503 and r.json()["error"]["code"] == "grammar_compiler_busy", r.text
            assert r.headers["Retry-After"] == "2" and 1.9 < seconds < 3.5
            # Every slow compile's process is gone: its CPU is given back, not burnt for minutes.
            assert len(pids) == 4
            with trio.fail_after(5):  # SIGKILL is sent before the 400; the process ends just after
                while not all(process_gone(pid) for pid in pids):
                    await trio.sleep(0.02)
            assert grammars.stats.timed_out == 4 and grammars.stats.busy == 1
            metrics = (await http.get("/metrics")).text
            assert 'trillm:grammar_compile_timeouts_total{model_name="' in metrics
            assert re.search(r"trillm:grammar_compile_timeouts_total\{[^}]*\} 4\.0", metrics)
            assert re.search(r"trillm:grammar_compiler_busy_total\{[^}]*\} 1\.0", metrics)
            # And a trivial schema compiles and serves at once.
            started = trio.current_time()
            r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **trivial})
            assert r.status_code == 200 and trio.current_time() - started < 5, r.text
    assert grammars.worker_pids == []  # the engine stopped: no compile process is left


async def test_schemas_past_a_bound_are_400s_at_once_and_others_compile(server):
    """The issue's 5,000-long $ref chain (178 KB) never reaches a compile: it is refused in
    microseconds, naming the bound, so it holds no worker and a trivial schema right after compiles."""
    cases = [
        (ref_chain(5000), "bytes long; the limit is 131072 bytes"),
        (ref_chain(300), "more than 256 $ref"),
        (ref_chain(100), "a chain of 101 $ref; the limit is 64"),
        ({"enum": list(range(2000))}, "an enum has 2000 values; the limit is 1024"),
        ({"type": "string", "maxLength": 10**6}, "maxLength is 1e+06; the limit is 65536"),
        ({"type": "array", "minItems": 70000}, "minItems is 70000; the limit is 65536"),
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for schema, message in cases:
            started = trio.current_time()
            r = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": ASK, "response_format": json_schema_format(schema)},
            )
            assert r.status_code == 400 and trio.current_time() - started < 2, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_grammar" and err["param"] == "response_format"
            assert message in err["message"], err
        for extra, param, message in [
            ({"guided_regex": "a{0,100000}"}, "guided_regex", "{0,100000} is past the limit of 65536"),
            ({"guided_grammar": 'root ::= "a"{70000}'}, "guided_grammar", "{70000} is past the limit"),
        ]:
            r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param and message in r.text, r.text
        assert server.engine.grammars.stats.compiled == 0  # none of them reached a worker
        r = await http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": ASK,
                "max_tokens": 20,
                "response_format": json_schema_format({"type": "object", "properties": {"name": {"maxLength": 10}}}),
            },
        )
        assert r.status_code == 200, r.text


async def test_an_empty_language_is_a_400_and_a_dead_end_ends_the_choice_with_an_error(server):
    """Regression (issue item 3): a grammar with no string answered 200 with free text ("token
    48127 is outside the grammar; the rest is unconstrained"). An empty language is refused before
    generation, also one that allows a first token and then none (``"a"`` then an empty class); a
    grammar whose dead end lies past what the compile searches (up to three letters, then an empty
    class) ends that choice with finish_reason "error" where no token is allowed, never with
    unconstrained text: a 400 for a plain reply, an "error" finish in a stream."""
    empty = "[^\\x00-\\U0010FFFF]"
    dead_end = f"root ::= [a-z]{{0,3}} {empty}"
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for grammar in (f"root ::= {empty}", f'root ::= "a" {empty}', f'root ::= "ab" ("c" | "d") {empty}'):
            r = await http.post(
                "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "guided_grammar": grammar}
            )
            assert r.status_code == 400, (grammar, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_grammar" and err["param"] == "guided_grammar"
            assert "matches no output" in err["message"]

        body = {"model": MODEL, "messages": ASK, "max_tokens": 20, "guided_grammar": dead_end}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar", r.text
        assert "allows no token" in r.json()["error"]["message"]

        chunks = []
        async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            async for line in s.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert re.fullmatch("[a-z]{1,3}", text) and finish == ["error"], chunks
        # Other requests are unaffected, and the failed choices left nothing behind.
        ok = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 5})
        assert ok.status_code == 200
    assert await live_matchers(server.engine) == 0


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
    """A client that leaves while its grammar compiles: the compile's worker is killed (nothing
    of it runs on), its slot is free, and the server is fine."""
    grammars = server.engine.grammars
    grammars.limits = GrammarLimits(max_refs=10**6, max_ref_depth=10**6, max_source_bytes=10**7)
    await server.engine.compile_grammar(GrammarSpec.json_object())  # a worker is up: only the compile is left
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

        async def leave() -> None:
            body = {"model": MODEL, "messages": ASK, "response_format": json_schema_format(ref_chain(3000))}
            await http.post("/v1/chat/completions", json=body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leave)
            with trio.fail_after(10):
                while not grammars._busy:
                    await trio.sleep(0.02)
            (pid,) = [w.pid for w in grammars._busy]
            nursery.cancel_scope.cancel()  # the client goes away mid-compile
    with trio.fail_after(10):
        while grammars._busy or not process_gone(pid):
            await trio.sleep(0.02)
    await wait_idle(server.engine)
    assert server.engine.stats().num_open_requests == 0 and await live_matchers(server.engine) == 0
    # And the server is fine.
    out = await in_thread(lambda: client(server).chat.completions.create(model=MODEL, messages=ASK, max_tokens=3))
    assert out.choices[0].finish_reason in ("stop", "length")
