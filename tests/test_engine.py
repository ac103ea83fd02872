"""The engine's actors: concurrency, cancellation and page accounting, preemption."""

from __future__ import annotations

import pytest
import trio

from trillm.engine.engine import EngineNotRunning, RequestRejected
from trillm.engine.sampling_params import SamplingParams

from tests.helpers import make_engine, outputs_by_prompt, wait_idle


async def _drain(engine, ids, params):
    async with engine.generate(ids, params) as outputs:
        return [o async for o in outputs]


async def test_many_concurrent_requests_complete_and_free_every_page(engine, tokenizer):
    results: dict[int, list] = {}

    async def one(i: int) -> None:
        ids = tokenizer(f"Request {i}: tell me about the number {i}.")["input_ids"]
        results[i] = await _drain(engine, ids, SamplingParams(max_tokens=5 + i % 7, temperature=0.8, ignore_eos=True))

    async with trio.open_nursery() as nursery:
        for i in range(24):
            nursery.start_soon(one, i)
    for i, outputs in results.items():
        assert sum(len(o.token_ids) for o in outputs) == 5 + i % 7  # a verification may bring several at once
        assert outputs[-1].finish_reason == "length"
        assert all(o.finish_reason is None for o in outputs[:-1])
    assert len(results) == 24
    await wait_idle(engine)


async def test_a_new_request_does_not_wait_for_running_ones(engine, tokenizer):
    """Continuous batching: a short request joins and finishes while a long one runs."""
    long_ids = tokenizer("Write a very long story about a dragon.")["input_ids"]
    short_ids = tokenizer("Hi")["input_ids"]
    order: list[str] = []

    async def run(name, ids, n):
        await _drain(engine, ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "long", long_ids, 120)
        await trio.sleep(0.3)
        nursery.start_soon(run, "short", short_ids, 3)
    assert order == ["short", "long"]


async def test_cancelling_waiting_and_running_requests_frees_every_page(engine, tokenizer):
    total = engine.stats().total_pages
    ids = tokenizer("Count slowly from one to one hundred:")["input_ids"]
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    got_some = 0

    async def stop_after(n_outputs: int) -> None:
        nonlocal got_some
        async with engine.generate(ids, params) as outputs:
            count = 0
            async for _ in outputs:
                count += 1
                if count >= n_outputs:
                    got_some += 1
                    return

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(stop_after, 1 + i % 5)
        # Some requests are cancelled before they ever run (still waiting).
        for _ in range(10):
            with trio.move_on_after(0):
                nursery.start_soon(_drain, engine, ids, params)
        await trio.sleep(0.05)
        nursery.cancel_scope.deadline = trio.current_time() + 60  # a guard against a hang, not a speed test
    assert got_some == 20
    await wait_idle(engine)
    stats = engine.stats()
    assert stats.free_pages + stats.evictable_pages == total
    assert stats.num_aborted >= 20


async def test_closing_the_channel_alone_cancels_the_request(engine, tokenizer):
    """No explicit abort: the scheduler notices the closed channel on its next send."""
    ids = tokenizer("Hello there")["input_ids"]
    _request_id, outputs = engine.submit(ids, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    await outputs.receive()
    outputs.close()
    await wait_idle(engine)
    assert engine.stats().num_aborted == 1


async def test_pages_of_a_cancelled_request_are_free_after_the_next_step(engine, tokenizer):
    """Cancellation reaches the scheduler within one step, even with others running."""
    ids = tokenizer("Tell me a story about a cat")["input_ids"]
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    _, other = engine.submit(ids, params)
    _, victim = engine.submit(ids + ids, params)
    await victim.receive()
    victim.close()  # the consumer leaves
    step = engine.num_steps
    while engine.num_steps < step + 2:  # the step in flight, then one more
        await other.receive()
    stats = engine.stats()
    assert stats.num_open_requests == 1 and stats.num_running == 1
    assert stats.free_pages + stats.evictable_pages + len(engine.scheduler.running[0].pages) == stats.total_pages
    other.close()


async def test_preemption_under_a_tiny_pool_gives_identical_greedy_outputs(model_parts, tokenizer, nursery):
    prompts = [f"Story {i}: the wizard and the" for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def run_all(eng) -> dict[str, list[int]]:
        outputs = await outputs_by_prompt(eng, tokenizer, prompts, params)
        return {p: [t for o in outs for t in o.token_ids] for p, outs in outputs.items()}

    roomy = make_engine(model_parts, num_pages=256, page_size=4)
    tight = make_engine(model_parts, num_pages=30, page_size=4)
    async with trio.open_nursery() as n:
        await n.start(roomy.run)
        await n.start(tight.run)
        expected = await run_all(roomy)
        got = await run_all(tight)
        await wait_idle(roomy)
        await wait_idle(tight)
        n.cancel_scope.cancel()
    assert tight.stats().num_preemptions > 0
    assert got == expected


async def test_prompt_longer_than_the_context_is_rejected(model_parts, nursery, tokenizer):
    eng = make_engine(model_parts, max_model_len=64)
    await nursery.start(eng.run)
    with pytest.raises(RequestRejected, match="64"):
        eng.submit(list(range(100, 200)), SamplingParams())
    # A request that fits stops at the context limit with "length".
    outputs = await _drain(eng, list(range(100, 160)), SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert len(outputs) == 4 and outputs[-1].finish_reason == "length"
    await wait_idle(eng)


async def test_shutdown_ends_open_streams_and_frees_everything(model_parts, tokenizer):
    eng = make_engine(model_parts)
    ids = tokenizer("Tell me everything")["input_ids"]
    finals: list[str | None] = []

    async def consume():
        async with eng.generate(ids, SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)) as outputs:
            last = None
            async for o in outputs:
                last = o
            finals.append(last.finish_reason if last else None)

    async with trio.open_nursery() as clients:
        async with trio.open_nursery() as engine_nursery:
            await engine_nursery.start(eng.run)
            for _ in range(4):
                clients.start_soon(consume)
            await trio.sleep(0.5)
            engine_nursery.cancel_scope.cancel()
    assert finals == ["abort"] * 4
    stats = eng.stats()
    assert stats.free_pages == stats.total_pages and stats.num_open_requests == 0
    assert eng._thread.busy == 0 and eng._thread.alive == (eng._thread.holders > 0)
    with pytest.raises(EngineNotRunning):
        eng.submit(ids, SamplingParams())


async def test_choices_of_one_prompt_share_its_pages_and_match_a_lone_run(engine, tokenizer):
    ids = tokenizer("Describe in detail how a steam engine works, step by step, for a curious child who " * 3)[
        "input_ids"
    ]
    assert len(ids) > 2 * 16  # at least two full pages to share
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    lone = [t for o in await _drain(engine, ids, params) for t in o.token_ids]

    _, outputs = engine.submit_many([(ids, params)] * 3)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    shared_seen = False
    with outputs:
        async for out in outputs:
            tokens[out.index] += out.token_ids
            held = [p for s in engine.scheduler.running for p in s.pages]
            shared_seen |= len(held) > len(set(held))
    assert shared_seen
    assert tokens == {0: lone, 1: lone, 2: lone}
