"""Scheduling one step ahead: step N+1 is scheduled and launched before step N's
tokens are known, and must give exactly what one step at a time gives.

The scheduler tests drive it the way the engine does, with a stand-in model whose
token after position p of request r is a fixed function of (r, p): whatever the
batching, preemption or timing, every request then has one right answer.
"""

from __future__ import annotations

import random
import zlib
from collections import deque

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from trillm.engine.execution.backends.base import StepRows
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.prefix_cache import PrefixCache
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.engine.scheduling.step_loop import StepLoop
from trillm.engine.step import PENDING, Batch, Step, StepInputs, fill_pending

from tests.helpers import make_engine, wait_idle

VOCAB, EOS = 6, 0


def model_token(request_id: str, end: int) -> int:
    """The stand-in model: the token it samples after the first ``end`` tokens."""
    return zlib.crc32(f"{request_id}:{end}".encode()) % VOCAB


def true_token(seq: Sequence, position: int) -> int:
    if position < len(seq.prompt_ids):
        return seq.prompt_ids[position]
    return model_token(seq.request_id, position)


class Driver:
    """Runs the engine's own ``StepLoop`` over a ``Scheduler``, ``depth`` steps in flight
    at most, and checks each step as the worker would run it."""

    def __init__(self, depth: int, num_pages: int, page_size: int, max_seqs: int, budget: int, cache: bool) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = PrefixCache(self.allocator, page_size) if cache else None
        self.scheduler = Scheduler(self.allocator, page_size, max_seqs, budget, self.cache)
        self.loop: StepLoop[tuple[StepInputs, list[list[int]]]] = StepLoop(self.scheduler, self._prepare, depth)
        self.last_sampled: list[int] | None = None
        self.written: dict[tuple[int, int], tuple[int, ...]] = {}  # (page, offset) -> the prefix its KV encodes

    @property
    def in_flight(self) -> deque[Step[tuple[StepInputs, list[list[int]]]]]:
        return self.loop.in_flight

    def step(self) -> None:
        self.loop.run_once(lambda step: self._execute(step.batch, *step.inputs))
        self._check_accounting()

    def _prepare(self, batch: Batch) -> tuple[StepInputs, list[list[int]]]:
        """What ``ModelRunner.prepare`` snapshots: tokens (some PENDING), pages, sample rows."""
        step = StepRows()
        for index, chunk in enumerate(batch.chunks):
            q = chunk.seq  # never a step past the end: no wasted work, no position past the context
            assert chunk.end < q.max_len and chunk.end - len(q.prompt_ids) < (q.params.max_tokens or 10**9)
            step.add(index, chunk)
        inputs = step.inputs(torch.empty(0), None)  # type: ignore[arg-type]  # no attention here
        return inputs, [list(c.seq.pages) for c in batch.chunks]

    def _execute(self, batch: Batch, inputs: StepInputs, pages: list[list[int]]) -> list[int]:
        """The worker's view: fill in the PENDING tokens, read and write KV through the
        snapshot's pages, sample. Every input and every KV read must be the truth."""
        rows = fill_pending(inputs, self.last_sampled)
        ids = inputs.input_ids.tolist()
        ps = self.page_size
        sampled = []
        row = 0
        for chunk, table in zip(batch.chunks, pages):
            seq = chunk.seq
            truth = [true_token(seq, p) for p in range(chunk.end)]
            assert ids[row : row + chunk.length] == truth[chunk.start :], "an input token is not the sampled one"
            row += chunk.length
            for p in range(chunk.start):
                assert self.written[(table[p // ps], p % ps)] == tuple(truth[: p + 1]), "stale KV read"
            for p in range(chunk.start, chunk.end):
                self.written[(table[p // ps], p % ps)] = tuple(truth[: p + 1])
            if chunk.samples:
                history = rows[len(sampled)].output_ids
                if seq.params.needs_history:
                    assert list(history) == truth[len(seq.prompt_ids) :], "the sampler saw a PENDING token"
                sampled.append(model_token(seq.request_id, chunk.end))
        self.last_sampled = sampled
        return sampled

    def _check_accounting(self) -> None:
        s = self.scheduler
        held = [p for q in [*s.running, *s.waiting] for p in q.pages]
        cached = set(self.cache._nodes) if self.cache is not None else set()
        for page in set(held) | cached:
            assert self.allocator.refcount(page) == held.count(page) + (page in cached)
        assert self.allocator.free_pages + len(set(held) | cached) == self.allocator.num_pages
        for q in [*s.running, *s.waiting]:
            assert q.output_ids.count(PENDING) <= len(self.in_flight)
            assert q.num_settled <= q.num_computed


def make_requests(rng: random.Random) -> list[tuple[int, Sequence]]:
    """(arrival step, sequence): shared prompt stems, n > 1 followers, penalties, EOS."""
    stems = [[rng.randint(1, VOCAB - 1) for _ in range(14)] for _ in range(3)]
    requests = []
    for i in range(rng.randint(1, 14)):
        prompt = rng.choice(stems)[: rng.randint(1, 14)] + [rng.randint(1, VOCAB - 1) for _ in range(rng.randint(0, 3))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 12),
            ignore_eos=rng.random() < 0.3,
            min_tokens=rng.choice([0, 0, 2]),
            presence_penalty=rng.choice([0.0, 0.5]),
        )
        arrival = rng.randint(0, 12)
        first = Sequence(
            f"r{i}", prompt, params, rng.choice([10_000, len(prompt) + 4]), frozenset({EOS}), arrival_time=arrival
        )
        requests.append((arrival, first))
        for j in range(rng.choice([0, 0, 0, 2])):
            follower = Sequence(
                f"r{i}.{j}", list(prompt), params, first.max_len, frozenset({EOS}), arrival_time=arrival
            )
            follower.leader = first
            requests.append((arrival, follower))
    return requests


def expected(seq: Sequence) -> tuple[list[int], str]:
    """What one request must produce, from the stand-in model alone."""
    outputs: list[int] = []
    p = seq.params
    while True:
        token = model_token(seq.request_id, len(seq.prompt_ids) + len(outputs))
        outputs.append(token)
        if token == EOS and not p.ignore_eos and len(outputs) > p.min_tokens:
            return outputs, "stop"
        if len(outputs) >= p.max_tokens or len(seq.prompt_ids) + len(outputs) >= seq.max_len:
            return outputs, "length"


def run(rng: random.Random, requests: list[tuple[int, Sequence]], depth: int, aborts: dict[int, str]) -> None:
    page_size = rng.choice([1, 2, 4])
    longest = max((len(q.prompt_ids) + (q.params.max_tokens or 0) for _, q in requests), default=1)
    d = Driver(
        depth,
        num_pages=-(-longest // page_size) + rng.randint(0, 12),
        page_size=page_size,
        max_seqs=rng.randint(1, 6),
        budget=rng.randint(8, 40),
        cache=rng.random() < 0.7,
    )
    arrivals = sorted(requests, key=lambda r: r[0])
    live: set[str] = set()
    step = 0
    while arrivals or d.scheduler.has_work or d.in_flight:
        while arrivals and arrivals[0][0] <= step:
            seq = arrivals.pop(0)[1]
            d.scheduler.add(seq)
            live.add(seq.request_id)
        if step in aborts:
            d.scheduler.abort(aborts[step])  # lands while up to ``depth`` steps are in flight
        d.step()
        step += 1
        assert step < 5_000, "the pipeline stalled"
    if d.cache is not None:
        d.cache.flush()
    assert d.allocator.free_pages == d.allocator.num_pages


def fresh(requests: list[tuple[int, Sequence]]) -> list[tuple[int, Sequence]]:
    """The same requests, unstarted (the leader links point into the copy)."""
    copies: dict[str, Sequence] = {}
    out = []
    for arrival, q in requests:
        copy = Sequence(q.request_id, list(q.prompt_ids), q.params, q.max_len, q.eos_ids, arrival_time=q.arrival_time)
        copy.leader = copies[q.leader.request_id] if q.leader is not None else None
        copies[q.request_id] = copy
        out.append((arrival, copy))
    return out


def without_early_eos(requests: list[tuple[int, Sequence]]) -> list[tuple[int, Sequence]]:
    """The stand-in cannot honour min_tokens bans; drop requests that would need one."""

    def needs_ban(q: Sequence) -> bool:
        if q.params.ignore_eos:
            return False
        return any(model_token(q.request_id, len(q.prompt_ids) + i) == EOS for i in range(q.params.min_tokens))

    kept = {q.request_id for _, q in requests if not needs_ban(q)}
    return [(a, q) for a, q in requests if q.request_id in kept and (q.leader is None or q.leader.request_id in kept)]


PIPELINES = settings(max_examples=150, deadline=None, derandomize=True, database=None)


@PIPELINES
@given(seed=st.integers(0, 2**32 - 1))
def test_one_step_ahead_gives_what_one_step_at_a_time_gives(seed):
    """Same tokens and finish reasons whatever the depth; every input, every history the
    sampler sees and every KV read is the truth; no page leaks; preemption, a prefix cache,
    followers, EOS found a step late, min_tokens and max_len all mixed in."""
    rng = random.Random(seed)
    requests = without_early_eos(make_requests(rng))
    pool_seed = rng.random()
    results = {}
    for depth in (1, 2):
        reqs = fresh(requests)
        run(random.Random(pool_seed), reqs, depth, {})
        results[depth] = {q.request_id: (list(q.output_ids), q.finish_reason) for _, q in reqs}
        for _, q in reqs:
            assert (list(q.output_ids), q.finish_reason) == expected(q), (depth, q.request_id)
    assert results[1] == results[2]


@PIPELINES
@given(seed=st.integers(0, 2**32 - 1))
def test_aborts_while_two_steps_are_in_flight_never_leak(seed):
    """Aborts land between launch and resolve of two steps: each aborted request keeps a
    prefix of its answer with no PENDING left, the others their whole answer."""
    rng = random.Random(seed)
    requests = without_early_eos(make_requests(rng))
    ids = [q.request_id for _, q in requests]
    aborts = {rng.randint(0, 30): rng.choice(ids) for _ in range(rng.randint(0, 4))} if ids else {}
    reqs = fresh(requests)
    run(random.Random(rng.random()), reqs, 2, aborts)
    for _, q in reqs:
        outputs, reason = expected(q)
        if q.finish_reason == "abort":
            assert q.output_ids == outputs[: len(q.output_ids)] and PENDING not in q.output_ids
        else:
            assert (q.output_ids, q.finish_reason) == (outputs, reason)


# -- the real engine ----------------------------------------------------------------


async def _collect(engine, prompts, params_list):
    """Submit all at once; gather each choice's tokens, text, finish reason and counts."""
    out: dict = {}

    async def one(key, ids, params):
        if isinstance(params, list):  # n choices of one prompt
            _, receive = engine.submit_many([(ids, p) for p in params])
        else:
            _, receive = engine.submit(ids, params)
        with receive:
            async for o in receive:
                tokens, text, _, _ = out.get((key, o.index), ((), "", None, 0))
                out[(key, o.index)] = (tokens + o.token_ids, text + o.text, o.finish_reason, o.num_output_tokens)

    async with trio.open_nursery() as nursery:
        for key, (ids, params) in enumerate(zip(prompts, params_list)):
            nursery.start_soon(one, key, ids, params)
    return out


@pytest.fixture(scope="module")
def reference_parts(model_dir):
    """The default model on the torch references of the kernels: the runner's flat inputs."""
    from trillm.engine.config import EngineConfig
    from trillm.engine.execution.loading import load_model

    return load_model(EngineConfig(dtype="float32", kernels="reference"))


@pytest.mark.trio
@pytest.mark.parametrize("kernels", ["default", "reference"])  # CPU fast path (Triton on a GPU); flat inputs
@pytest.mark.gpu
async def test_the_engine_gives_the_same_greedy_outputs_with_and_without_overlap(request, tokenizer, kernels):
    """A tiny pool (preemption), stop strings and stop ids found a step late, penalties that
    read the history, n = 2, and uneven lengths: identical tokens, text, reasons, counts."""
    texts = [
        "The capital of France is",
        "List three colours:",
        "def fibonacci(n):",
        "Once upon a time",
        "1, 2, 3, 4,",
        "Write a haiku about the sea.",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    params_list: list = [
        SamplingParams(max_tokens=24, temperature=0),
        SamplingParams(max_tokens=30, temperature=0, stop=(",",)),
        SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, presence_penalty=0.4),
        [SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=17, temperature=0)],
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(tokenizer.encode(" 7")[0],)),
        SamplingParams(max_tokens=26, temperature=0, frequency_penalty=0.5),
    ]
    results = {}
    for overlap in (False, True):
        parts = request.getfixturevalue("model_parts" if kernels == "default" else "reference_parts")
        assert (parts[0].backend.name == "reference") == (kernels == "reference")
        engine = make_engine(
            parts, num_pages=14, page_size=4, max_num_seqs=6, max_batch_tokens=32, overlap_schedule=overlap
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            results[overlap] = await _collect(engine, prompts, params_list)
            await wait_idle(engine)
            assert engine.scheduler.num_preemptions > 0  # the pool is small enough to preempt
            nursery.cancel_scope.cancel()
    assert results[True] == results[False]
    reasons = {reason for _, _, reason, _ in results[True].values()}
    assert "stop" in reasons and "length" in reasons
    for tokens, _, _, count in results[True].values():
        assert count == len(tokens) and PENDING not in tokens


@pytest.mark.trio
@pytest.mark.gpu
async def test_a_failed_step_ends_its_requests_and_the_next_ones_run(model_parts, tokenizer):
    """The third step raises; with the step after it already queued, its requests end with
    "error", requests submitted afterwards are right, and every page comes back."""
    engine = make_engine(model_parts)
    real = engine.runner.execute_forward
    calls = {"n": 0}

    def failing_third(inputs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real(inputs)

    engine.runner.execute_forward = failing_third
    ids = tokenizer.encode("The capital of France is")
    greedy = SamplingParams(max_tokens=8, temperature=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        first = await _collect(engine, [ids, ids[:-1]], [greedy, greedy])
        assert {reason for _, _, reason, _ in first.values()} == {"error"}
        second = await _collect(engine, [ids], [greedy])
        lone = make_engine(model_parts)
        async with trio.open_nursery() as inner:
            await inner.start(lone.run)
            reference = await _collect(lone, [ids], [greedy])
            inner.cancel_scope.cancel()
        assert second == reference and second[(0, 0)][2] == "length"
        await wait_idle(engine)
        nursery.cancel_scope.cancel()
