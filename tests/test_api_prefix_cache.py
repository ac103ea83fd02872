"""The prefix cache through the API: a user who stops a reply and resends hits the cache."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import wait_idle
from tests.server import MODEL, client, in_thread

pytestmark = pytest.mark.e2e

SYSTEM = "You are a meticulous assistant. " * 30
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three rivers in Europe."}]


async def test_stop_then_resend_hits_the_cache_with_identical_greedy_output(server):
    c = client(server)

    def stop_after_a_few_chunks():
        stream = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=200, temperature=0, stream=True)
        for i, _ in enumerate(stream):
            if i == 4:
                stream.close()
                return

    await in_thread(stop_after_a_few_chunks)
    await wait_idle(server.engine)
    assert server.engine.stats().evictable_pages > 0  # the cancelled request left its KV behind

    def stream_with_usage():
        return list(
            c.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )

    chunks = await in_thread(stream_with_usage)
    streamed_usage = chunks[-1].usage
    assert streamed_usage.prompt_tokens_details.cached_tokens >= streamed_usage.prompt_tokens - 16
    hit = await in_thread(c.chat.completions.create, model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert hit.usage.prompt_tokens_details.cached_tokens >= hit.usage.prompt_tokens - 16

    async with httpx.AsyncClient(base_url=server.url) as http:
        flushed = (await http.post("/flush_cache")).json()["flushed_pages"]
    assert flushed > 0 and server.engine.stats().evictable_pages == 0
    cold = await in_thread(c.chat.completions.create, model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.choices[0].message.content == cold.choices[0].message.content
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == cold.choices[0].message.content


async def test_completions_report_cached_tokens_per_prompt(server):
    c = client(server)
    prompt = SYSTEM + " The end."
    first = await in_thread(c.completions.create, model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    both = await in_thread(
        c.completions.create, model=MODEL, prompt=[prompt, prompt + " Again"], max_tokens=2, temperature=0
    )
    assert both.usage.prompt_tokens_details.cached_tokens >= 2 * (first.usage.prompt_tokens - 16)
