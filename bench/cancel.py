"""``trillm bench --cancel-heavy SECONDS``: clients that stop after a random number of
tokens and resend the same conversation, like users who stop and retry a reply.

Reports the tokens delivered per second, how many streams were cut, the prefix
cache hit rate, and the page accounting once the storm is over (free +
evictable must equal the total, with nothing running).
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import trio

from trillm.bench.prometheus import scrape


async def cancel_heavy(url: str, model: str, prompts: list[str], seconds: float, seed: int = 0) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    delivered = cut = finished = 0
    deadline = trio.current_time() + seconds

    async def user(http: Any, prompt: str) -> None:
        nonlocal delivered, cut, finished
        while trio.current_time() < deadline:
            stop_after = rng.randint(1, 64)
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 48,
                "temperature": 0.8,
                "stream": True,
            }
            got = 0
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choices = json.loads(line[6:])["choices"]
                    if choices and choices[0]["delta"].get("content"):
                        got += 1
                        if got >= stop_after:
                            break  # leaving the block drops the connection mid-stream
            delivered += got
            if got >= stop_after:
                cut += 1
            else:
                finished += 1

    started = time.perf_counter()
    async with httpx.AsyncClient(
        base_url=url, timeout=600, limits=httpx.Limits(max_connections=len(prompts) * 2)
    ) as http:
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(user, http, prompt)
        elapsed = time.perf_counter() - started
        await trio.sleep(2)  # let the last disconnects reach the scheduler
        metrics = scrape((await http.get("/metrics")).text)
    return {
        "seconds": round(elapsed, 1),
        "tokens_delivered_per_s": round(delivered / elapsed, 1),
        "streams_cut": cut,
        "streams_finished": finished,
        "prefix_cache_hit_rate": round(
            metrics["prefix_cache_hits_total"] / max(1, metrics["prefix_cache_queries_total"]), 3
        ),
        "aborted": int(metrics["num_requests_aborted_total"]),
        "running_after": int(metrics["num_requests_running"]),
        "free_pages": int(metrics["kv_cache_free_pages"]),
        "evictable_pages": int(metrics["kv_cache_evictable_pages"]),
        "total_pages": int(metrics["kv_cache_total_pages"]),
        "accounting_exact": metrics["kv_cache_free_pages"] + metrics["kv_cache_evictable_pages"]
        == metrics["kv_cache_total_pages"]
        and metrics["num_requests_running"] == 0,
    }
