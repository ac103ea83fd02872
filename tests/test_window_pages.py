"""Pages that fall out of every layer's sliding window go back to the pool as a sequence advances.

A model whose every layer attends only its last W tokens (Mistral v0.1, Mixtral, Phi-3) never
reads a page wholly before its next query's window again: the scheduler frees it (its place in
the sequence's table holds ``DROPPED_PAGE``, which the windowed kernels skip or mask), so a long
generation holds about W / page_size pages instead of all of them. Held to ``transformers``
(its own sliding-window mask) through the engine, on every backend's kernels the engine runs.
"""

from __future__ import annotations

import pytest
import torch
import trio
from transformers import MistralConfig, MistralForCausalLM

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine
from trillm.engine.execution.loading import load_model
from trillm.engine.execution.shape import ModelShape
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import DROPPED_PAGE, PageAllocator, pages_needed
from trillm.engine.scheduling.prefix_cache import PrefixCache
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence

from tests.families import PROMPTS, config_of, hf_greedy, save_random
from tests.helpers import wait_idle

WINDOW, PAGE = 8, 4


def _run(sched: Scheduler, seq: Sequence, allocator: PageAllocator) -> int:
    """Step ``seq`` to its end; returns the most pages it held at once (checked each step)."""
    most = 0
    while sched.has_work:
        batch = sched.schedule()
        live = seq.pages[seq.dropped_pages :]
        assert seq.pages[: seq.dropped_pages] == [DROPPED_PAGE] * seq.dropped_pages
        # what the next query reads: its window's pages, and the one it writes
        assert seq.dropped_pages == max(0, seq.num_computed - WINDOW + 1) // PAGE
        most = max(most, len(live))
        sched.complete(batch, [11] * sum(c.samples for c in batch.chunks))
    return most


def test_a_long_generation_holds_its_window_of_pages():
    allocator = PageAllocator(64)
    sched = Scheduler(allocator, PAGE, 4, 64, window=WINDOW)
    seq = Sequence("a", list(range(10)), SamplingParams(max_tokens=60, ignore_eos=True), 4096, frozenset())
    sched.add(seq)
    most = _run(sched, seq, allocator)
    assert len(seq.output_ids) == 60 and seq.finish_reason == "length"
    assert most <= pages_needed(WINDOW, PAGE) + 2  # not the 18 pages of its 70 tokens
    assert allocator.used_pages == 0 and allocator.free_pages == 64  # each page freed once


def test_without_a_window_every_page_is_kept():
    allocator = PageAllocator(64)
    sched = Scheduler(allocator, PAGE, 4, 64)
    seq = Sequence("a", list(range(10)), SamplingParams(max_tokens=30, ignore_eos=True), 4096, frozenset())
    sched.add(seq)
    while sched.has_work:
        batch = sched.schedule()
        assert seq.dropped_pages == 0 and DROPPED_PAGE not in seq.pages[1:]
        sched.complete(batch, [11] * sum(c.samples for c in batch.chunks))
    assert allocator.used_pages == 0


def test_the_prefix_cache_keeps_what_it_took_and_never_a_dropped_place():
    """A prompt's pages cached as they are computed stay cached (the cache's reference) when the
    window passes them; the sequence's table, with dropped places, is never inserted."""
    allocator = PageAllocator(64)
    cache = PrefixCache(allocator, PAGE)
    sched = Scheduler(allocator, PAGE, 4, 6, cache, window=WINDOW)  # 6-token chunks: a prompt in 4
    prompt = list(range(100, 124))
    seq = Sequence("a", prompt, SamplingParams(max_tokens=20, ignore_eos=True), 4096, frozenset())
    sched.add(seq)
    _run(sched, seq, allocator)
    assert allocator.used_pages == cache.evictable_pages > 0  # only the cache holds pages now
    cached = cache.match(prompt + [1])
    assert cached and DROPPED_PAGE not in cached[1:] and len(set(cached)) == len(cached)
    again = Sequence("b", prompt, SamplingParams(max_tokens=4, ignore_eos=True), 4096, frozenset())
    sched.add(again)
    _run(sched, again, allocator)
    assert again.num_cached_tokens >= PAGE  # the cached prompt pages were reused
    assert cache.flush() and allocator.used_pages == 0


def test_preempted_and_aborted_sequences_free_only_their_live_pages():
    allocator = PageAllocator(12)
    sched = Scheduler(allocator, PAGE, 4, 64, window=WINDOW)
    seqs = [
        Sequence(name, list(range(12)), SamplingParams(max_tokens=40, ignore_eos=True), 4096, frozenset())
        for name in "abc"
    ]
    for seq in seqs:
        sched.add(seq)
    for _ in range(30):  # three sequences in 12 pages: only the window makes room for all three
        batch = sched.schedule()
        sched.complete(batch, [11] * sum(c.samples for c in batch.chunks))
        assert allocator.used_pages == sum(len(s.pages) - s.dropped_pages for s in sched.running)
    assert sched.num_preemptions == 0 and all(s.dropped_pages for s in seqs)
    sched.abort("b")
    while sched.has_work:
        batch = sched.schedule()
        sched.complete(batch, [11] * sum(c.samples for c in batch.chunks))
    assert allocator.used_pages == 0 and allocator.free_pages == 12


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, model_dir):
    """Every layer a window of 8 (Mistral 7B v0.1's layout, at 4,096 there)."""
    torch.manual_seed(3)
    config = MistralConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return save_random(MistralForCausalLM(config).eval(), tmp_path_factory.mktemp("mistral"), model_dir)


@pytest.mark.parametrize("kernels", ["cpu", "reference"])
async def test_the_engine_gives_transformers_tokens_while_it_drops_pages(mistral_dir, kernels):
    """40 prompt tokens and 40 more (10 pages past the window): the tokens transformers gives,
    the pages held bounded by the window, every page back when the request ends."""
    assert ModelShape.from_config(config_of(mistral_dir)).attention_span == WINDOW
    hf = MistralForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32, attn_implementation="eager").eval()
    config = EngineConfig(model=str(mistral_dir), dtype="float32", num_pages=64, page_size=PAGE, kernels=kernels)
    engine = Engine(config, *load_model(config))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    held = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with engine.generate(PROMPTS[0], params) as outputs:
            tokens = []
            async for out in outputs:
                tokens += out.token_ids
                held.append(engine.allocator.used_pages)
        await wait_idle(engine)
        nursery.cancel_scope.cancel()
    assert tokens == hf_greedy(hf, PROMPTS[0], 40)
    assert max(held[5:]) <= pages_needed(WINDOW, PAGE) + 3  # not the 20 pages of 80 tokens
    assert engine.allocator.used_pages == engine.scheduler.evictable_pages
