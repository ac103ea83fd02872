"""``trillm bench``'s streaming client counts inter-token latency per token: a chunk that carries
several tokens (speculation's kept runs) is several gaps, not one long one."""

from __future__ import annotations

import httpx
import pytest

from trillm.bench.run import _stream_one
from trillm.engine import EngineConfig
from trillm.engine.execution import gguf_support
from trillm.engine.execution.model_source import fetch_default_gguf, resolve_model

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


def test_a_client_of_a_running_server_reads_a_gguf_file_that_does_not_fit_beside_it(tmp_path, monkeypatch) -> None:
    """``trillm bench --url``: the server holds the model; the bench reads only its metadata and
    tokenizer, so the memory the file would need is not asked of this machine again."""
    monkeypatch.setattr(gguf_support, "available_memory", lambda: 1 << 20)  # 1 MiB free: nothing fits
    monkeypatch.setattr(gguf_support, "resident_file_bytes", lambda path: 0)
    monkeypatch.setattr(gguf_support, "meminfo", lambda key: 1 << 20)
    packaged = fetch_default_gguf(EngineConfig().cache_path)  # the default model's file, as the tests use it
    cache = tmp_path / "cache"  # its metadata's folder written here
    with pytest.raises(gguf_support.UnsupportedModel, match="GiB of memory is available"):
        resolve_model(str(packaged), cache)
    folder = resolve_model(str(packaged), cache, memory=False)
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
