"""Bad input, tried as a hostile client would (issue 13): always a 400 naming the field, never a 500,
never a partly queued request, and never a stall of ``/health`` or of other streams."""

from __future__ import annotations

import json
import math
import resource

import attrs
import httpx
import pytest
import trio

from trillm.engine.engine import Engine
from trillm.engine.errors import RequestRejected
from trillm.engine.sampling_params import SamplingParams

from tests.helpers import wait_idle
from tests.server import MODEL, QUESTION

pytestmark = pytest.mark.e2e

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _raw(fields: str, path: str = CHAT) -> bytes:
    """A body with ``fields`` spliced in as written (``NaN`` is not what ``json.dumps`` would send)."""
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": QUESTION} if path == CHAT else {"prompt": "Hello"})
    return (json.dumps(base)[:-1] + ", " + fields + "}").encode()


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    return err


async def _nothing_queued(engine: Engine, before: int) -> None:
    """No choice of a refused call reached the engine."""
    stats = engine.stats()
    assert stats.num_open_requests == 0 and stats.prompt_tokens_total == before
    await wait_idle(engine)


async def test_seed_beyond_the_generator_is_a_400_and_nothing_is_queued(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        before = server.engine.stats().prompt_tokens_total
        for stream in (False, True):
            r = await http.post(CHAT, json={"model": MODEL, "messages": QUESTION, "seed": 2**64 - 1, "n": 2})
            assert _error(r)["param"] == "seed"
            body = {"model": MODEL, "prompt": "Once", "seed": 18446744073709551608, "n": 9, "stream": stream}
            r = await http.post(COMPLETIONS, json=body)
            assert _error(r)["param"] == "seed" and "18446744073709551607" in r.json()["error"]["message"]
            await _nothing_queued(server.engine, before)
            for seed in (2**64, -(2**63) - 1):
                r = await http.post(COMPLETIONS, json={**body, "seed": seed, "n": 1})
                assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
        await _nothing_queued(server.engine, before)
        # The edges themselves are served: the last seed the generator takes, and the first
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 2, "n": 2}
        for seed in (2**64 - 2, -(2**63)):
            r = await http.post(COMPLETIONS, json={**body, "seed": seed})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2


async def test_submit_many_queues_all_or_nothing(engine):
    good = ([1, 2, 3], SamplingParams(max_tokens=2))
    for bad in (([1, 2, 10**9], SamplingParams()), ([1, 2], SamplingParams(logit_bias=((10**9, 1.0),)))):
        with pytest.raises(RequestRejected):
            engine.submit_many([good, good, bad])
        assert engine.stats().num_open_requests == 0
    for params in (dict(seed=2**64), dict(temperature=float("nan")), dict(logit_bias=((1, float("inf")),))):
        with pytest.raises(ValueError):
            SamplingParams(**params)  # type: ignore[arg-type]


NON_FINITE = [
    ('"top_p": NaN', "top_p"),
    ('"min_p": NaN', "min_p"),
    ('"temperature": NaN', "temperature"),
    ('"presence_penalty": Infinity', "presence_penalty"),
    ('"frequency_penalty": -Infinity', "frequency_penalty"),
    ('"repetition_penalty": 1e999', "repetition_penalty"),
    ('"logit_bias": {"42": NaN}', "logit_bias"),
    ('"chat_template_kwargs": {"x": [1, NaN]}', "chat_template_kwargs"),
    ('"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"maximum": Infinity}}}',
     "response_format.json_schema.schema"),
]  # fmt: skip


async def test_non_finite_numbers_are_a_400_naming_the_field(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        before = server.engine.stats().prompt_tokens_total
        for fields, param in NON_FINITE:
            for path in (CHAT, COMPLETIONS) if "chat_template" not in fields else (CHAT,):
                err = _error(await http.post(path, content=_raw(fields, path)))
                assert err["param"] == param and "finite" in err["message"], (fields, err)
        r = await http.post("/v1/responses", content=b'{"model": "%s", "input": "hi", "top_p": NaN}' % MODEL.encode())
        assert _error(r)["param"] == "top_p"
        await _nothing_queued(server.engine, before)


async def test_logit_bias_beyond_the_vocabulary_is_a_400(server):
    vocab = server.engine.model.shape.vocab_size
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for stream in (False, True):
            for path in (CHAT, COMPLETIONS):
                r = await http.post(
                    path, content=_raw(f'"logit_bias": {{"{vocab}": 5}}, "stream": {json.dumps(stream)}', path)
                )
                err = _error(r)
                assert err["param"] == "logit_bias" and str(vocab - 1) in err["message"]
        r = await http.post(COMPLETIONS, content=_raw(f'"logit_bias": {{"{vocab - 1}": -100}}', COMPLETIONS))
        assert r.status_code == 200
    await wait_idle(server.engine)


LONE = '"a\\ud800b"'  # as written in the body: a high surrogate with no low one after it
SURROGATES = [
    (CHAT, '"messages": [{"role": "user", "content": %s}]', "messages[0].content"),
    (CHAT, '"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]', "messages[0].content[0].text"),
    (CHAT, '"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": '
     '[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": %s}}]}]',
     "messages[1].tool_calls[0].function.arguments"),
    (CHAT, '"stop": [%s]', "stop"),
    (CHAT, '"chat_template_kwargs": {%s: 1}', "chat_template_kwargs"),
    (COMPLETIONS, '"prompt": %s', "prompt"),
    (COMPLETIONS, '"prompt": ["ok", %s]', "prompt"),
    ("/tokenize", '"prompt": %s', "prompt"),
    ("/tokenize", '"messages": [{"role": "user", "content": %s}]', "messages[0].content"),
    ("/v1/responses", '"input": %s', "input"),
]  # fmt: skip


async def test_lone_surrogates_are_a_400_anywhere(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for path, field, param in SURROGATES:
            body = {"/tokenize": {}, "/v1/responses": {"model": MODEL}}.get(path, {"model": MODEL, "max_tokens": 2})
            raw = (json.dumps(body)[:-1] + (", " if body else "") + field % LONE + "}").encode()
            for data in (raw, raw.replace(b"\\ud800", b"\xed\xa0\x80")):  # escaped, or raw bytes
                err = _error(await http.post(path, content=data))
                assert err["param"] == param and "surrogate" in err["message"], (path, field, err)
        # A pair is one character, whether escaped or not
        for text in ('"\\ud83d\\ude00 ok"', json.dumps("\U0001f600 ok", ensure_ascii=False)):
            r = await http.post("/tokenize", content=b'{"prompt": ' + text.encode() + b"}")
            assert r.status_code == 200 and r.json()["count"] >= 2
    await wait_idle(server.engine)


async def test_405_says_which_methods_are_allowed(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for method, path, allowed in (
            ("GET", CHAT, "POST"),
            ("POST", "/health", "GET"),
            ("DELETE", "/v1/models", "GET"),
        ):
            r = await http.request(method, path)
            assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
            assert allowed in {m.strip() for m in r.headers["allow"].split(",")}, r.headers


async def test_text_that_cannot_fit_is_refused_before_tokenizing(server):
    max_len = server.engine.max_model_len
    huge = "x" * 3_000_000  # more characters than max_model_len of the longest tokens can hold
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for path, body, param in (
            (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": huge}]}, "messages"),
            (CHAT, {"model": MODEL, "prompt": huge}, "prompt"),
            (COMPLETIONS, {"model": MODEL, "prompt": ["ok", huge]}, "prompt"),
            ("/tokenize", {"prompt": huge}, "prompt"),
            (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "a"}] * (max_len + 1)}, "messages"),
            (COMPLETIONS, {"model": MODEL, "prompt": [1] * (max_len + 1)}, "prompt"),
            ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": "a"}] * (max_len + 1)}, "input"),
        ):
            started = trio.current_time()
            err = _error(await http.post(path, content=json.dumps(body).encode()))
            assert err["param"] == param and err["code"] == "context_length_exceeded", (path, err)
            assert "maximum context length" in err["message"]
            assert trio.current_time() - started < 10  # tokenizing 3 MB on this machine would take ~15 s
    await wait_idle(server.engine)


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@attrs.define
class _Watch:
    """``/health`` latencies and a running stream's gaps, each stamped with when it was seen."""

    health: list[tuple[float, float]] = attrs.Factory(list)
    gaps: list[tuple[float, float]] = attrs.Factory(list)
    done: trio.Event = attrs.Factory(trio.Event)

    def window(self, kind: str, start: float, end: float) -> list[float]:
        return [v for t, v in getattr(self, kind) if start <= t < end]

    async def ping(self, url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while not self.done.is_set():
                started = trio.current_time()
                assert (await http.get("/health")).status_code == 200
                self.health.append((started, trio.current_time() - started))
                await trio.sleep(0.01)

    async def stream(self, url: str) -> None:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async with http.stream("POST", CHAT, json=body) as response:
                last = None
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = trio.current_time()
                    if last is not None:
                        self.gaps.append((last, now - last))
                    last = now
                    if self.done.is_set():
                        return


async def _flood_once(url: str, flood: bytes) -> tuple[list[float], list[float], int]:
    """/health p99 and the stream's largest gap, quiet then during 6 flood requests (2 at a time);
    and how many floods were refused as over the context."""
    watch = _Watch()
    refused = 0

    async def until_chunks(count: int, since: float) -> None:
        while len(watch.window("gaps", since, math.inf)) < count:
            await trio.sleep(0.05)

    async def one(http: httpx.AsyncClient) -> None:
        nonlocal refused
        r = await http.post(CHAT, content=flood, headers={"content-type": "application/json"})
        refused += r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.stream, url)
        await until_chunks(3, 0)  # the stream is running
        nursery.start_soon(watch.ping, url)
        quiet = trio.current_time()
        await until_chunks(10, quiet)
        loud = trio.current_time()
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            for _ in range(3):
                async with trio.open_nursery() as floods:
                    for _ in range(2):
                        floods.start_soon(one, http)
        await until_chunks(1, trio.current_time())  # the gap the floods may have stretched has ended
        end = trio.current_time()
        watch.done.set()
    windows = ((quiet, loud), (loud, end))
    health = [_percentile(watch.window("health", *w), 0.99) for w in windows]
    return health, [max(watch.window("gaps", *w)) for w in windows], refused


async def test_a_flood_of_100k_message_requests_stalls_nobody(server):
    """The issue's case: 100,000 tiny messages took the event loop for 4.6 s. The body is decoded off
    the loop and refused by its count before validation, templating or tokenizing; meanwhile
    ``/health`` keeps answering (p99 under 150 ms beyond what this machine shows without the flood)
    and a running stream keeps its pace. On a shared 2-core machine a step takes 10 ms to a second
    and other processes take the cores for whole time slices, so a second attempt is allowed."""
    flood = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 100_000}).encode()
    for _ in range(2):
        health, gaps, refused = await _flood_once(server.url, flood)
        print(f"/health p99 {health[0]:.3f} -> {health[1]:.3f} s, stream max gap {gaps[0]:.3f} -> {gaps[1]:.3f} s")
        assert refused == 6
        # The stream's bound is coarse: decoding 20 MB takes a core from the forward pass's two threads, which
        # slows steps on a 2-core machine without any stall of the event loop.
        if health[1] < health[0] + 0.15 and gaps[1] < 2 * gaps[0] + 1.0:
            break
        await wait_idle(server.engine, timeout=30)
    assert health[1] < health[0] + 0.15, health
    assert gaps[1] < 2 * gaps[0] + 1.0, gaps
    await wait_idle(server.engine, timeout=30)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


async def _settled_rss_mb() -> float:
    """The least RSS over half a second: the last refused body is freed only once the server has
    sent its answer (the error's traceback holds it until then), which may be after we read it."""
    least = _rss_mb()
    for _ in range(5):
        await trio.sleep(0.1)
        least = min(least, _rss_mb())
    return least


async def test_memory_of_large_bodies_is_given_back(server):
    """Bodies of 7 MB, again and again: the server's memory does not grow with each."""
    bodies = [
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}] * 200_000}).encode(),
        json.dumps({"model": MODEL, "prompt": "y" * 7_000_000}).encode(),
    ]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

        async def round_() -> None:
            for body in bodies:
                r = await http.post(CHAT, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400

        await round_()
        await round_()
        settled = await _settled_rss_mb()
        for _ in range(6):
            await round_()
        grown = await _settled_rss_mb() - settled
    assert grown < 50, f"RSS grew {grown:.0f} MB over 12 large bodies"
    await wait_idle(server.engine)


async def test_legacy_functions_stream_as_function_call(server):
    """``functions`` / ``function_call`` are served, not ignored: streamed in their own delta shape."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "functions": [{"name": "get_weather", "description": "the weather in a city", "parameters": schema}],
        "function_call": {"name": "get_weather"},
        "max_tokens": 60,
        "temperature": 0,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        async with http.stream("POST", CHAT, json=body) as response:
            events = [json.loads(line[6:]) for line in [x async for x in response.aiter_lines()] if line[6:7] == "{"]
    choices = [e["choices"][0] for e in events]
    calls = [c["delta"]["function_call"] for c in choices if c["delta"].get("function_call")]
    assert not any(c["delta"].get("tool_calls") for c in choices)
    assert calls[0]["name"] == "get_weather"
    assert isinstance(json.loads("".join(c.get("arguments", "") for c in calls))["city"], str)
    assert choices[-1]["finish_reason"] == "function_call"
    await wait_idle(server.engine)
