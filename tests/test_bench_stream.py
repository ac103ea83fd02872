"""``trillm bench``'s streaming client counts inter-token latency per token: a chunk that carries
several tokens (speculation's kept runs) is several gaps, not one long one."""

from __future__ import annotations

import httpx

from trillm.bench.run import _stream_one

from tests.server import MODEL, in_thread, running_server

REPEATING = "The cat sat on the mat. " * 6


async def test_a_chunk_of_several_tokens_counts_one_gap_per_token(model_parts) -> None:
    async with running_server(model_parts, speculative="ngram") as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            ttft, gaps, tokens = await _stream_one(http, MODEL, REPEATING, 40, None, {"temperature": 0})
        metrics = (await in_thread(httpx.get, srv.url + "/metrics")).text
    accepted = sum(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("trillm:spec_decode_num_accepted")
    )
    assert accepted > 0  # some chunk carried a kept run of proposed tokens with its own token
    assert tokens == 40 and len(gaps) == tokens - 1  # one gap for every token after the first
    assert ttft > 0 and all(g >= 0 for g in gaps)
