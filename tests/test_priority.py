"""Who goes first: the ``priority`` field and ``--scheduling-policy priority``.

Scheduler tests call the pure ``Scheduler`` with a stand-in model whose token after
position p of request r is a fixed function of (r, p), so a preempted request has
one right answer whatever happened to it. Engine and server tests use the real model.
"""

from __future__ import annotations

import random
import time
import zlib

import httpx
import pytest
import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from trillm.api.errors import ApiError
from trillm.api.metrics import priority_class
from trillm.api.schemas.chat import parse_chat_request
from trillm.api.schemas.completion import parse_completion_request
from trillm.api.schemas.responses import parse_responses_request
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.policy import SchedulingPolicy
from trillm.engine.scheduling.prefix_cache import PrefixCache
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.engine.scheduling.step_loop import StepLoop
from trillm.engine.step import PENDING, Batch, Step

from tests.helpers import make_engine, wait_idle
from tests.server import MODEL, client, in_thread, running_server

PRIORITY = SchedulingPolicy("priority")
VOCAB, EOS = 6, 0


def seq(name: str, prompt_len: int, priority: int = 0, t: float = 0.0, max_tokens: int = 50) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority)
    base = 100 * (zlib.crc32(name.encode()) % 1000)  # prompts of their own: no prefix is shared
    return Sequence(name, [base + i for i in range(prompt_len)], params, 10_000, frozenset(), arrival_time=t)


def step(s: Scheduler) -> Batch:
    batch = s.schedule()
    s.complete(batch, [7 for c in batch.chunks if c.samples])
    return batch


def names(seqs) -> list[str]:
    return [q.request_id for q in seqs]


# -- the order of the queue ----------------------------------------------------------


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = Scheduler(PageAllocator(100), 4, 2, 64, policy=PRIORITY)
    for name, priority, t in [("late-low", 5, 0), ("a", 0, 1), ("urgent", -3, 2), ("b", 0, 3), ("low", 5, 4)]:
        s.add(seq(name, 3, priority, t))
    assert names(s.waiting) == ["urgent", "a", "b", "late-low", "low"]
    step(s)
    assert names(s.running) == ["urgent", "a"]


def test_fcfs_accepts_a_priority_and_ignores_it():
    s = Scheduler(PageAllocator(100), 4, 2, 64)
    for name, priority, t in [("first", 5, 0), ("second", -5, 1), ("third", -9, 2)]:
        s.add(seq(name, 3, priority, t))
    step(s)
    assert names(s.running) == ["first", "second"] and names(s.waiting) == ["third"]
    for _ in range(3):
        step(s)
    assert s.num_preemptions == 0 and names(s.running) == ["first", "second"]


# -- displacing running sequences ----------------------------------------------------


def test_a_higher_priority_arrival_short_of_pages_preempts_the_lowest_priority_latest_running():
    allocator = PageAllocator(7)
    cache = PrefixCache(allocator, 4)
    s = Scheduler(allocator, 4, 8, 64, cache, PRIORITY)
    for name, priority, t in [("low-old", 5, 0), ("low-new", 5, 1), ("mid", 1, 2)]:
        s.add(seq(name, 6, priority, t))  # 6 prompt tokens (+ 2 generated): 2 pages each
    step(s)
    assert names(s.running) == ["mid", "low-old", "low-new"] and allocator.free_pages == 1
    s.add(seq("urgent", 6, 0, 3))
    batch = step(s)
    # Among the lowest priority, the latest arrival goes; its full page stays in the prefix cache.
    assert names(s.running) == ["mid", "low-old", "urgent"] and names(s.waiting) == ["low-new"]
    assert names(c.seq for c in batch.chunks) == ["mid", "low-old", "urgent"] and s.num_preemptions == 1
    victim = s.waiting[0]
    assert victim.output_ids == [7] and victim.num_computed == 0 and victim.pages == []
    assert s.evictable_pages == 1 and cache.match(victim.token_ids(0, 7)), "its page went to the prefix cache"


def test_a_lower_or_equal_priority_arrival_waits_instead_of_preempting():
    s = Scheduler(PageAllocator(4), 4, 8, 64, policy=PRIORITY)
    s.add(seq("a", 6, 1, 0))
    s.add(seq("b", 6, 1, 1))
    step(s)
    s.add(seq("same", 6, 1, 2))
    s.add(seq("lower", 6, 2, 3))
    step(s)
    assert names(s.running) == ["a", "b"] and names(s.waiting) == ["same", "lower"] and s.num_preemptions == 0


def test_a_full_batch_of_running_sequences_makes_way_for_a_higher_priority():
    s = Scheduler(PageAllocator(100), 4, 2, 64, policy=PRIORITY)
    s.add(seq("low-1", 3, 3, 0))
    s.add(seq("low-2", 3, 3, 1))
    step(s)
    s.add(seq("urgent", 3, -1, 2))
    batch = step(s)
    assert names(s.running) == ["low-1", "urgent"] and names(s.waiting) == ["low-2"]
    # The victim's decode scheduled this step was taken out again: it spends no tokens.
    assert names(c.seq for c in batch.chunks) == ["low-1", "urgent"]
    # It does not come straight back in the same or the next step: it ranks below both running.
    step(s)
    assert names(s.running) == ["low-1", "urgent"] and s.num_preemptions == 1


def test_fcfs_never_displaces_a_running_sequence():
    s = Scheduler(PageAllocator(100), 4, 2, 64)
    s.add(seq("low-1", 3, 3, 0))
    s.add(seq("low-2", 3, 3, 1))
    step(s)
    s.add(seq("urgent", 3, -1, 2))
    step(s)
    assert names(s.running) == ["low-1", "low-2"] and names(s.waiting) == ["urgent"]


def test_a_running_sequence_short_of_pages_preempts_the_lowest_priority_even_if_scheduled():
    """Decodes go first, so a low-priority decode may be scheduled before a high-priority prefill
    needs its pages: it is preempted all the same and its chunk leaves the step."""
    s = Scheduler(PageAllocator(5), 4, 8, 64, policy=PRIORITY)
    s.add(seq("low", 7, 5, 0))
    step(s)  # low: 2 pages, one token generated
    big = seq("high", 12, 0, 1)
    s.add(big)
    s.max_batch_tokens = 2  # the high one's prompt needs several chunks
    step(s)  # low decodes; high gets 1 token of prefill (1 page)
    assert names(s.running) == ["low", "high"] and s.allocator.free_pages == 2
    s.max_batch_tokens = 64
    batch = step(s)  # high needs 3 pages for its whole prompt: low goes, though its decode came first
    assert names(c.seq for c in batch.chunks) == ["high"] and names(s.waiting) == ["low"]
    assert s.num_preemptions == 1


# -- aging ----------------------------------------------------------------------------


def test_aging_lets_a_long_wait_outrank_a_later_higher_priority():
    aging = SchedulingPolicy("priority", aging_seconds=2.0)
    old_low = seq("old-low", 3, 5, t=0.0)  # effective rank: 0 + 5 x 2 = 10
    assert aging.rank(seq("soon", 3, 0, t=9.0)) < aging.rank(old_low) < aging.rank(seq("later", 3, 0, t=11.0))
    s = Scheduler(PageAllocator(100), 4, 1, 64, policy=aging)
    s.add(old_low)
    s.add(seq("after", 3, 0, t=12.0))
    s.add(seq("before", 3, 0, t=8.0))
    assert names(s.waiting) == ["before", "old-low", "after"]
    # Without aging priority alone counts, as vLLM.
    strict = Scheduler(PageAllocator(100), 4, 1, 64, policy=PRIORITY)
    for q in (seq("old-low", 3, 5, 0.0), seq("after", 3, 0, 12.0), seq("before", 3, 0, 8.0)):
        strict.add(q)
    assert names(strict.waiting) == ["before", "after", "old-low"]


def test_an_aged_running_sequence_is_not_displaced():
    s = Scheduler(PageAllocator(100), 4, 1, 64, policy=SchedulingPolicy("priority", aging_seconds=1.0))
    s.add(seq("low", 3, 3, t=0.0))
    step(s)
    s.add(seq("too-late", 3, 0, t=4.0))  # 4 > 0 + 3 x 1: the low one has waited long enough
    step(s)
    assert names(s.running) == ["low"] and s.num_preemptions == 0
    s.add(seq("in-time", 3, 0, t=2.0))
    step(s)
    assert names(s.running) == ["in-time"] and s.num_preemptions == 1


def test_policy_settings_are_validated():
    with pytest.raises(ValueError, match="fcfs or priority"):
        SchedulingPolicy("lifo")
    with pytest.raises(ValueError, match="aging"):
        SchedulingPolicy("priority", -1.0)
    with pytest.raises(ValueError, match="priority"):
        SamplingParams(priority=10**7)


# -- no lost or repeated tokens, whatever the preemptions ---------------------------------


def model_token(request_id: str, end: int) -> int:
    """The stand-in model: the token it samples after the first ``end`` tokens."""
    return zlib.crc32(f"{request_id}:{end}".encode()) % VOCAB


def truth(q: Sequence, end: int) -> list[int]:
    return [q.prompt_ids[p] if p < len(q.prompt_ids) else model_token(q.request_id, p) for p in range(end)]


def expected(q: Sequence) -> list[int]:
    """Outputs of a request alone: ignore_eos, so exactly ``max_tokens`` stand-in tokens."""
    max_tokens = q.params.max_tokens or 0
    return [model_token(q.request_id, len(q.prompt_ids) + i) for i in range(max_tokens)]


def run_pipeline(rng: random.Random, requests: list[tuple[int, Sequence]], policy: SchedulingPolicy, depth: int):
    """Drive the engine's own ``StepLoop``; every input token and every KV read must be the truth."""
    page_size = rng.choice([1, 2, 4])
    longest = max(len(q.prompt_ids) + (q.params.max_tokens or 0) for _, q in requests)
    allocator = PageAllocator(-(-longest // page_size) + rng.randint(0, 10))
    cache = PrefixCache(allocator, page_size) if rng.random() < 0.6 else None
    s = Scheduler(allocator, page_size, rng.randint(1, 4), rng.randint(8, 32), cache, policy)
    written: dict[tuple[int, int], tuple[int, ...]] = {}

    def prepare(batch: Batch) -> list[list[int]]:
        for c in batch.chunks:
            real = truth(c.seq, c.end)[c.start :]
            assert all(t in (PENDING, r) for t, r in zip(c.seq.token_ids(c.start, c.end), real, strict=True))
        return [list(c.seq.pages) for c in batch.chunks]

    def execute(step: Step[list[list[int]]]) -> list[int]:
        sampled = []
        for chunk, table in zip(step.batch.chunks, step.inputs, strict=True):
            real = truth(chunk.seq, chunk.end)
            for p in range(chunk.start):
                assert written[(table[p // page_size], p % page_size)] == tuple(real[: p + 1]), "stale KV read"
            for p in range(chunk.start, chunk.end):
                written[(table[p // page_size], p % page_size)] = tuple(real[: p + 1])
            if chunk.samples:
                sampled.append(model_token(chunk.seq.request_id, chunk.end))
        return sampled

    loop = StepLoop(s, prepare, depth)
    arrivals = sorted(requests, key=lambda r: r[0])
    n = 0
    while arrivals or loop.has_work:
        while arrivals and arrivals[0][0] <= n:
            s.add(arrivals.pop(0)[1])
        loop.run_once(execute)
        n += 1
        assert n < 5_000, "the pipeline stalled"
    if cache is not None:
        cache.flush()
    assert allocator.free_pages == allocator.num_pages
    return s.num_preemptions


PIPELINES = settings(max_examples=60, deadline=None, derandomize=True, database=None)


@pytest.mark.parametrize("policy_name", ["priority", "fcfs"])
@PIPELINES
@given(seed=st.integers(0, 2**32 - 1))
# Regressions: a follower (n > 1) that took its leader's pages but found no room waited holding
# them, and a sequence preempted to the queue's front then waited for ever for those pages.
@example(seed=2175)  # priority
@example(seed=2405)  # fcfs, also before priorities existed
def test_preempted_requests_lose_and_repeat_no_token(policy_name, seed):
    """Random priorities, arrivals, pools, followers and aging, one step at a time or one
    ahead: every request ends with exactly the tokens it would have alone, nothing stalls,
    and no page leaks."""
    rng = random.Random(seed)
    policy = SchedulingPolicy(policy_name, rng.choice([0.0, 0.0, 3.0]))
    requests = []
    for i in range(rng.randint(2, 10)):
        arrival = rng.randint(0, 15)
        prompt = [rng.randint(1, VOCAB - 1) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, priority=rng.choice([-2, 0, 0, 3]))
        requests.append((arrival, Sequence(f"r{i}", prompt, params, 10_000, frozenset({EOS}), arrival_time=arrival)))
        for j in range(rng.choice([0, 0, 2])):  # n > 1: followers of equal rank share the prompt's pages
            requests.append(
                (arrival, Sequence(f"r{i}.{j}", prompt, params, 10_000, frozenset({EOS}), arrival_time=arrival))
            )
    for depth in (1, 2):
        fresh: list[tuple[int, Sequence]] = []
        for a, q in requests:
            fresh.append(
                (a, Sequence(q.request_id, list(q.prompt_ids), q.params, q.max_len, q.eos_ids, arrival_time=a))
            )
            if "." in q.request_id:
                fresh[-1][1].leader = next(c for _, c in fresh if c.request_id == q.request_id.split(".")[0])
        run_pipeline(random.Random(seed), fresh, policy, depth)
        for _, q in fresh:
            assert (q.output_ids, q.finish_reason) == (expected(q), "length"), (depth, q.request_id)


# -- the real engine and server -------------------------------------------------------------


async def _tokens(outputs) -> list[int]:
    return [t async for o in outputs for t in o.token_ids]


async def test_a_preempted_request_streams_what_it_would_alone(model_parts, tokenizer, nursery):
    """Greedy outputs of low-priority requests displaced by a high-priority one equal their
    outputs run alone; the high one runs at once; every page is free afterwards."""
    eng = make_engine(model_parts, scheduling_policy="priority", max_num_seqs=2, max_batch_tokens=64)
    await nursery.start(eng.run)
    prompts = [tokenizer(f"Story {i}: the wizard and the")["input_ids"] for i in range(3)]
    low = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, priority=4)
    alone = []
    for ids in prompts[:2]:
        async with eng.generate(ids, low) as outputs:
            alone.append(await _tokens(outputs))
    eng.flush_cache()  # the contest below must compute its prompts, not find them cached
    got: dict[str, list[int]] = {}

    async def one(name: str, ids: list[int], params: SamplingParams) -> None:
        async with eng.generate(ids, params) as outputs:
            got[name] = await _tokens(outputs)

    async with trio.open_nursery() as n:
        n.start_soon(one, "low-0", prompts[0], low)
        n.start_soon(one, "low-1", prompts[1], low)
        while eng.router.generation_tokens_total < 2 * 24 + 6:  # both run and have a few tokens
            await trio.sleep(0.005)
        urgent = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, priority=-1)
        n.start_soon(one, "urgent", prompts[2], urgent)
    assert eng.stats().num_preemptions >= 1
    assert got["low-0"] == alone[0] and got["low-1"] == alone[1]
    assert len(got["urgent"]) == 4
    await wait_idle(eng)


def test_the_priority_field_is_bounded_and_strict_on_every_endpoint():
    q = [{"role": "user", "content": "hi"}]
    assert parse_chat_request({"model": "m", "messages": q, "priority": -7}).common.params.priority == -7
    assert parse_completion_request({"model": "m", "prompt": "x", "priority": 3}).common.params.priority == 3
    assert parse_responses_request({"model": "m", "input": "x", "priority": 2}).common.params.priority == 2
    assert parse_chat_request({"model": "m", "messages": q}).common.params.priority == 0
    for bad in (10**6 + 1, -(10**6) - 1, 1.5, "1", True):
        with pytest.raises(ApiError) as err:
            parse_chat_request({"model": "m", "messages": q, "priority": bad})
        assert err.value.status == 400 and err.value.param == "priority"
    assert [priority_class(p) for p in (-3, 0, 9)] == ["high", "normal", "low"]


async def test_a_high_priority_request_is_served_at_once_under_a_full_batch_of_low_ones(model_parts):
    """Three long low-priority streams fill the batch and a fourth waits; a high-priority request
    is answered, start to end, while every low one still generates. Under fcfs it could not start
    before one of them ended. The displaced stream loses no tokens; pages are all free afterwards."""
    n_low, low_tokens = 4, 64
    async with running_server(
        model_parts, scheduling_policy="priority", max_num_seqs=3, max_batch_tokens=128
    ) as server:
        c = client(server)
        done: dict[str, float] = {}
        counts: dict[str, int] = {}

        def stream(name: str, priority: int, max_tokens: int) -> None:
            first = None
            start = time.monotonic()
            chunks = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"Tell a long story about {name}."}],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "priority": priority},
            )
            for chunk in chunks:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.monotonic()
                    done[f"{name}:ttft"] = first - start
                if chunk.usage is not None:
                    counts[name] = chunk.usage.completion_tokens
            done[name] = time.monotonic()

        async with trio.open_nursery() as n:
            for i in range(n_low):
                n.start_soon(in_thread, stream, f"low-{i}", 10, low_tokens)
            stats = server.engine.stats
            while stats().num_running < 3 or stats().num_waiting < 1 or stats().generation_tokens_total < 3 * 5:
                await trio.sleep(0.01)  # the batch is full, one more waits, all three stream
            n.start_soon(in_thread, stream, "high", -10, 8)
        first_low_done = min(done[f"low-{i}"] for i in range(n_low))
        assert done["high"] < first_low_done, "the high-priority request waited for a low-priority one to end"
        # The low one that found the batch full waited for a seat until another ended; the high one did not.
        assert done["high:ttft"] < max(done[f"low-{i}:ttft"] for i in range(n_low))
        assert counts == {**{f"low-{i}": low_tokens for i in range(n_low)}, "high": 8}
        assert server.engine.stats().num_preemptions >= 1
        async with httpx.AsyncClient(base_url=server.url) as http:
            text = (await http.get("/metrics")).text
        for cls, count in (("high", 1), ("low", n_low)):
            label = f'model_name="{MODEL}",priority="{cls}"'
            assert f"trillm:time_to_first_token_by_priority_seconds_count{{{label}}} {count}.0" in text
            assert f"trillm:request_queue_time_by_priority_seconds_count{{{label}}} {count}.0" in text
        await wait_idle(server.engine)
