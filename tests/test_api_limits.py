"""Server-side limits: the per-request deadline and the bounded waiting queue."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from tests.helpers import wait_idle
from tests.server import MODEL, QUESTION, running_server

pytestmark = pytest.mark.e2e

LONG = {"model": MODEL, "messages": QUESTION, "max_tokens": 3000, "ignore_eos": True}


async def test_deadline_ends_requests_cleanly_and_frees_their_pages(model_parts):
    async with running_server(model_parts, request_timeout=1.0) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            started = trio.current_time()
            r = await http.post("/v1/chat/completions", json=LONG)
            assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
            assert trio.current_time() - started < 5
            await wait_idle(server.engine)

            async with http.stream(
                "POST",
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": ["Once upon", "a time"],
                    "max_tokens": 3000,
                    "ignore_eos": True,
                    "stream": True,
                },
            ) as response:
                events = [line async for line in response.aiter_lines() if line]
            assert events[-1] == "data: [DONE]"
            finals = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
            assert sorted(c["index"] for c in finals if c["finish_reason"] == "length") == [0, 1]
            await wait_idle(server.engine)
            assert server.engine.stats().num_aborted == 3


async def test_a_full_waiting_queue_answers_503_at_once(model_parts):
    async with running_server(model_parts, max_num_seqs=1, max_waiting=1) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            async with http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as running:
                lines = running.aiter_lines()
                await lines.__anext__()  # the first request runs
                async with http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as waiting:
                    await trio.sleep(0.3)  # the second one waits (only one sequence may run)
                    started = trio.current_time()
                    for body in (LONG, {**LONG, "stream": True}):  # a stream is refused before it starts
                        r = await http.post("/v1/chat/completions", json=body)
                        assert r.status_code == 503 and r.headers["retry-after"] == "1"
                        assert r.json()["error"]["code"] == "server_overloaded"
                    assert trio.current_time() - started < 1
                    assert waiting.status_code == 200
        await wait_idle(server.engine)
