"""``python -m trillm.bench.memory_soak``: the server's memory, one traffic type at a time.

Starts ``trillm serve`` in a subprocess (or measures ``--url`` with ``--pid``), warms it
with every traffic type so pools and caches are touched, then sends ``--requests``
requests of ONE type at a time and reads the server's resident memory before and
after each batch (``/proc/PID/status`` VmRSS and ``smaps_rollup`` Anonymous, after the
engine is idle again), printing KB per request. A leak shows as a steady cost per
request in one type; fragmentation as growth that ``MALLOC_ARENA_MAX`` or trimming
changes (set them in the environment: the server inherits it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import trio

MODEL = "smollm2-135m-instruct"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
_fresh = itertools.count()
# ~7,700 tokens of SmolLM2's tokenizer: a prompt near its 8,192-token context (chunked prefill).
LONG_WORDS = 1980


def prompt() -> list[dict[str, str]]:
    """A short chat prompt never sent before (the prefix cache, tokenizer and detokenizer see new text)."""
    return [{"role": "user", "content": f"Request {next(_fresh)}: write one short sentence about the sea."}]


@attrs.frozen
class Memory:
    """The server process's resident memory, in KiB."""

    rss_kb: int
    anon_kb: int

    @classmethod
    def of(cls, pid: int) -> Memory:
        def field(path: str, name: str) -> int:
            with open(path) as f:
                for line in f:
                    if line.startswith(name + ":"):
                        return int(line.split()[1])
            raise KeyError(name)

        return cls(field(f"/proc/{pid}/status", "VmRSS"), field(f"/proc/{pid}/smaps_rollup", "Anonymous"))


# -- one request of each traffic type -----------------------------------------------------------


async def post(http: Any, path: str, body: dict[str, Any], tries: int = 6) -> None:
    """POST and check the answer, retrying a 503 after its ``Retry-After`` as the OpenAI SDKs do
    (a busy machine's grammar compiler answers "busy, retry", not a failure), and a pooled
    keep-alive connection the server closed as it was taken (the SDKs retry that too)."""
    import httpx  # the soak's client (a dev dependency), as the other bench clients import it

    for _ in range(tries - 1):
        try:
            response = await http.post(path, json=body)
        except httpx.RemoteProtocolError:
            continue
        if response.status_code != 503:
            break
        await trio.sleep(min(float(response.headers.get("retry-after", 1)), 5.0))
    else:
        response = await http.post(path, json=body)
    response.raise_for_status()


async def chat(http: Any) -> None:
    """A non-streamed chat that completes."""
    body = {"model": MODEL, "messages": prompt(), "max_tokens": 8, "temperature": 0.8}
    await post(http, "/v1/chat/completions", body)


async def chat_aborted(http: Any) -> None:
    """A non-streamed chat whose client leaves while it generates."""
    body = {"model": MODEL, "messages": prompt(), "max_tokens": 200, "ignore_eos": True}
    with trio.move_on_after(0.15):
        await http.post("/v1/chat/completions", json=body)


async def stream_aborted(http: Any) -> None:
    """A streamed chat cut after three events."""
    body = {"model": MODEL, "messages": prompt(), "max_tokens": 200, "ignore_eos": True, "stream": True}
    events = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                events += 1
                if events >= 3:
                    break  # leaving the block drops the connection mid-stream


async def completions_n2(http: Any) -> None:
    """A completion with two choices."""
    prompt = f"Request {next(_fresh)}: the sea is"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "n": 2, "temperature": 0.8}
    await post(http, "/v1/completions", body)


async def json_schema(http: Any) -> None:
    """A structured output with a schema never seen before (a grammar compile, a cache entry)."""
    key = f"field_{next(_fresh)}"
    schema = {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}
    body = {
        "model": MODEL,
        "messages": prompt(),
        "max_tokens": 16,
        "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}},
    }
    await post(http, "/v1/chat/completions", body)


async def tool_call(http: Any) -> None:
    """A chat that must call a tool (a grammar from the tool's schema, then the parser)."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "tools": [WEATHER_TOOL], "tool_choice": "required"}
    await post(http, "/v1/chat/completions", body)


async def embeddings(http: Any) -> None:
    """Four fresh inputs embedded (a prefill-only request each, its pooled rows)."""
    inputs = [f"Input {next(_fresh)}: the quick brown fox jumps over the lazy dog" for _ in range(4)]
    await post(http, "/v1/embeddings", {"model": MODEL, "input": inputs})


async def messages(http: Any) -> None:
    """An Anthropic Messages call, streamed to its end (the chat path under Anthropic's events)."""
    import httpx

    body = {"model": MODEL, "max_tokens": 8, "messages": prompt(), "stream": True}
    for attempt in range(3):
        try:
            async with http.stream("POST", "/v1/messages", json=body) as response:
                response.raise_for_status()
                async for _ in response.aiter_lines():
                    pass
            return
        except httpx.RemoteProtocolError:  # a keep-alive connection closed as it was taken
            if attempt == 2:
                raise


async def long_prompt(http: Any, num_words: int = LONG_WORDS) -> None:
    """A prompt near the context limit (~3.9 tokens a word), a few tokens out: prefill in chunks,
    then a short decode."""
    words = " ".join(f"w{(next(_fresh) * 7919 + i) % 1000}" for i in range(num_words))
    body = {"model": MODEL, "prompt": words, "max_tokens": 4}
    await post(http, "/v1/completions", body)


KINDS: dict[str, Callable[[Any], Awaitable[None]]] = {
    "chat": chat,
    "chat_aborted": chat_aborted,
    "stream_aborted": stream_aborted,
    "completions_n2": completions_n2,
    "json_schema": json_schema,
    "tool_call": tool_call,
    "embeddings": embeddings,
    "messages": messages,
    "long_prompt": long_prompt,
}


# -- the measurement ----------------------------------------------------------------------------


async def wait_idle(http: Any, timeout: float = 30.0) -> None:
    """Until no request runs or waits (an aborted one is freed within a step or two)."""
    from trillm.bench.prometheus import scrape

    with trio.move_on_after(timeout):
        while True:
            metrics = scrape((await http.get("/metrics")).text)
            if metrics["num_requests_running"] == 0 and metrics["num_requests_waiting"] == 0:
                return
            await trio.sleep(0.2)


# Types too slow on a small machine for a full batch: this fraction of one.
SLOW_KINDS = {"long_prompt": 20}


async def send(http: Any, kind: str, count: int, concurrency: int) -> None:
    """``count`` requests of one type (fewer of a slow one), ``concurrency`` at a time."""
    fn = KINDS[kind]
    count = max(1, count // SLOW_KINDS.get(kind, 1))
    left = iter(range(count))

    async def worker() -> None:
        for _ in left:
            await fn(http)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)


async def measure(
    url: str, pid: int, kinds: list[str], requests: int, warmup: int, concurrency: int, rounds: int
) -> list[dict[str, Any]]:
    """Warm every type, then ``rounds`` batches of ``requests`` per type; one row per batch."""
    import httpx

    rows: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        for kind in kinds:
            await send(http, kind, warmup, concurrency)
        await wait_idle(http)
        start = Memory.of(pid)
        print(f"after warm-up: VmRSS {start.rss_kb / 1024:.1f} MiB, anonymous {start.anon_kb / 1024:.1f} MiB")
        for round_ in range(rounds):
            for kind in kinds:
                before = Memory.of(pid)
                began = time.perf_counter()
                await send(http, kind, requests, concurrency)
                await wait_idle(http)
                await trio.sleep(0.5)
                after = Memory.of(pid)
                row_requests = max(1, requests // SLOW_KINDS.get(kind, 1))
                row = {
                    "round": round_,
                    "kind": kind,
                    "requests": row_requests,
                    "seconds": round(time.perf_counter() - began, 1),
                    "rss_mib": round(after.rss_kb / 1024, 1),
                    "rss_kb_per_request": round((after.rss_kb - before.rss_kb) / row_requests, 1),
                    "anon_kb_per_request": round((after.anon_kb - before.anon_kb) / row_requests, 1),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        end = Memory.of(pid)
        total = rounds * sum(max(1, requests // SLOW_KINDS.get(k, 1)) for k in kinds)
        print(
            f"after {total} requests: VmRSS {end.rss_kb / 1024:.1f} MiB "
            f"({(end.rss_kb - start.rss_kb) / 1024:+.1f} MiB, {(end.rss_kb - start.rss_kb) / total:+.1f} KB/request)"
        )
    return rows


async def soak(url: str, pid: int, kinds: list[str], minutes: float, clients: int) -> list[dict[str, Any]]:
    """The issue's load: ``clients`` clients, each sending a random type after another, for
    ``minutes``; resident memory sampled every 30 s, then once more after the engine is idle."""
    import random

    import httpx

    rows: list[dict[str, Any]] = []
    done: dict[str, int] = dict.fromkeys(kinds, 0)
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=clients * 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        for kind in kinds:
            await send(http, kind, 4, 2)
        await wait_idle(http)
        start = Memory.of(pid)
        began = time.perf_counter()
        deadline = began + minutes * 60

        def sample(label: str) -> None:
            now = Memory.of(pid)
            row = {
                "t_s": round(time.perf_counter() - began),
                "at": label,
                "requests": sum(done.values()),
                "rss_mib": round(now.rss_kb / 1024, 1),
                "rss_growth_mib": round((now.rss_kb - start.rss_kb) / 1024, 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)

        async def client() -> None:
            while time.perf_counter() < deadline:
                kind = rng.choice(kinds)
                await KINDS[kind](http)
                done[kind] += 1

        async def sampler() -> None:
            while time.perf_counter() < deadline:
                await trio.sleep(30)
                sample("loaded")

        sample("start")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler)
            for _ in range(clients):
                nursery.start_soon(client)
        await wait_idle(http)
        await trio.sleep(2)
        sample("idle")
        print("requests by type:", json.dumps(done))
    return rows


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trillm.api.cli", "serve", "--port", str(port), *extra], env={**os.environ}
    )


def main(argv: list[str] | None = None) -> None:
    from trillm.bench.server_probe import wait_healthy
    from trillm.engine import free_port

    p = argparse.ArgumentParser(prog="python -m trillm.bench.memory_soak", description=__doc__)
    p.add_argument("--url", help="measure this server (with --pid) instead of starting one")
    p.add_argument("--pid", type=int, help="the process behind --url")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--requests", type=int, default=100, help="requests per batch")
    p.add_argument("--warmup", type=int, default=20, help="requests of each type before measuring")
    p.add_argument("--rounds", type=int, default=2, help="batches of each type")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--long-words", type=int, default=LONG_WORDS, help="words of a long_prompt (~3.9 tokens each)")
    p.add_argument("--minutes", type=float, help="instead of batches: all types mixed for this long")
    p.add_argument("--clients", type=int, default=12, help="concurrent clients of --minutes")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("server_args", nargs="*", help="extra `trillm serve` flags (after --), e.g. --no-malloc-tuning")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    KINDS["long_prompt"] = partial(long_prompt, num_words=args.long_words)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"unknown kinds: {', '.join(sorted(unknown))}")
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        port = free_port()
        proc = start_server(port, args.server_args)
        url, pid = f"http://127.0.0.1:{port}", proc.pid
    elif pid is None:
        raise SystemExit("--url needs --pid (whose memory to read)")
    try:
        wait_healthy(url, proc)
        if args.minutes:
            rows = trio.run(soak, url, pid, kinds, args.minutes, args.clients)
        else:
            rows = trio.run(measure, url, pid, kinds, args.requests, args.warmup, args.concurrency, args.rounds)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
