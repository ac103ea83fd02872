"""The KV pool's size: asked for, or following the memory free at start (``engine/kv_budget``)."""

from __future__ import annotations

import logging

import pytest

from trillm.engine import EngineConfig
from trillm.engine.kv_budget import AUTO_CAP, AUTO_FLOOR, AUTO_SHARE, GiB, KVBudgetError, MiB, plan_kv_pool

PER_TOKEN = 46_080  # SmolLM2-135M in float32: 30 layers x K and V x 3 heads x 64 x 4 bytes


def test_pages_or_a_budget_asked_for_are_kept():
    plan = plan_kv_pool(EngineConfig(num_pages=10, page_size=4), PER_TOKEN, 8192, 1 * GiB)
    assert (plan.num_pages, plan.pool_bytes, plan.reason) == (10, 10 * 4 * PER_TOKEN, "--num-pages")
    plan = plan_kv_pool(EngineConfig(kv_cache_bytes=96 * MiB), PER_TOKEN, 8192, 16 * GiB)
    assert plan.num_pages == 96 * MiB // (16 * PER_TOKEN) and plan.reason == "--kv-cache-mb"


def test_a_budget_the_memory_cannot_hold_is_refused_in_one_line():
    with pytest.raises(KVBudgetError, match=r"--kv-cache-mb 8192: a KV pool of 8.0 GiB does not fit; 2.0 GiB"):
        plan_kv_pool(EngineConfig(kv_cache_bytes=8 * GiB), PER_TOKEN, 8192, 2 * GiB)


def test_by_default_the_pool_holds_one_whole_context_within_a_share_of_free_memory():
    small = plan_kv_pool(EngineConfig(), PER_TOKEN, 8192, 20 * GiB)  # 8,192 tokens take 360 MiB: the floor
    assert small.pool_bytes <= AUTO_FLOOR < small.pool_bytes + 16 * PER_TOKEN and "at least 512 MiB" in small.reason
    long = plan_kv_pool(EngineConfig(), 65_536, 131_072, 100 * GiB)  # 8 GiB for one context: capped
    assert long.pool_bytes <= AUTO_CAP and "capped at 4 GiB" in long.reason
    whole = plan_kv_pool(EngineConfig(), 65_536, 32_768, 100 * GiB)  # 2 GiB: exactly one context
    assert whole.num_pages * 16 == 32_768 and "one full context" in whole.reason
    tight = plan_kv_pool(EngineConfig(), 65_536, 131_072, 6 * GiB)  # a quarter of what is free
    assert tight.pool_bytes <= AUTO_SHARE * 6 * GiB < tight.pool_bytes + 16 * 65_536
    assert "25% of the memory available; 6.0 GiB available" in tight.reason
    unknown = plan_kv_pool(EngineConfig(), PER_TOKEN, 8192, None)
    assert unknown.pool_bytes <= AUTO_FLOOR and "unknown" in unknown.reason


def test_a_machine_too_full_for_a_small_pool_is_refused():
    with pytest.raises(KVBudgetError, match=r"no room for a KV pool: 256 tokens of it take 16 MiB"):
        plan_kv_pool(EngineConfig(), 65_536, 131_072, 40 * MiB)


def test_the_engine_logs_its_pool_and_context_length(model_parts, caplog):
    from .helpers import make_engine

    with caplog.at_level(logging.INFO, logger="trillm.engine"):
        engine = make_engine(model_parts, num_pages=None, kv_cache_bytes=64 * MiB, max_model_len=1024)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool"))
    tokens = engine.allocator.num_pages * 16
    assert line.startswith(f"KV pool: 64 MiB, {tokens} tokens in {engine.allocator.num_pages} pages (--kv-cache-mb)")
    assert line.endswith("context length 1024 (the model's 8192)") and engine.max_model_len == 1024


def test_replicas_on_one_cpu_divide_the_share_of_free_memory():
    alone = plan_kv_pool(EngineConfig(), 65_536, 131_072, 8 * GiB)
    shared = plan_kv_pool(EngineConfig(), 65_536, 131_072, 8 * GiB, sharers=2)
    assert shared.pool_bytes <= alone.pool_bytes / 2 < shared.pool_bytes + 16 * 65_536
    assert "12% of the memory available, shared by 2 replicas" in shared.reason
