"""Only the runner's one thread runs OpenMP teams (``engine/runner_thread.py``).

A torch op that went parallel on the event loop once (a prefill chunk's mask after a prefix-cache
hit) left a second OpenMP pool behind, and from then on libgomp slept at every barrier of every
team: each later decode step 2.5x slower on two cores. Here: every step runs on one OS thread
however the prompts come, the event loop's torch ops run in teams of one while an engine runs
(and get their width back after), and the thread itself hands back results, errors and
cancellations as ``trio.to_thread.run_sync`` did.
"""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
import trio

from trillm.engine.execution import model_runner
from trillm.engine.runner_thread import RunnerThread, single_threaded
from trillm.engine.sampling_params import SamplingParams

from tests.helpers import make_engine, wait_idle


def _step_threads(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """The threads every ``ModelRunner.execute`` from now on runs on."""
    threads: set[int] = set()
    execute = model_runner.ModelRunner.execute

    def recording(self, inputs):  # type: ignore[no-untyped-def]
        threads.add(threading.get_ident())
        return execute(self, inputs)

    monkeypatch.setattr(model_runner.ModelRunner, "execute", recording)
    return threads


async def test_every_step_runs_on_one_thread_and_the_event_loop_stays_single_threaded(
    model_parts, tokenizer, monkeypatch
) -> None:
    threads = _step_threads(monkeypatch)
    outer = torch.get_num_threads()
    engine = make_engine(model_parts, max_batch_tokens=512)
    base = tokenizer("Tell me a long story about a lighthouse keeper and the sea. " * 3)["input_ids"]
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        assert torch.get_num_threads() == 1  # this is the event loop's thread
        # a prompt, then one that extends it (a prefix-cache hit: its chunk starts past 0 and
        # needs a mask), then several at once
        for ids in (base, base + tokenizer(" The keeper was old, and the storms were long." * 8)["input_ids"]):
            async with engine.generate(ids, SamplingParams(max_tokens=8, temperature=0)) as outputs:
                assert [o async for o in outputs]
        async with trio.open_nursery() as clients:
            for i in range(4):
                clients.start_soon(_drain, engine, tokenizer(f"Question {i}: what is {i} + {i}?")["input_ids"])
        await wait_idle(engine)
        nursery.cancel_scope.cancel()
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert torch.get_num_threads() == outer  # the event loop's own width is back
    assert engine._thread.alive == (engine._thread.holders > 0)


async def test_two_engines_share_the_thread_and_it_ends_with_the_last(model_parts, tokenizer, monkeypatch) -> None:
    """Two CPU engines' runner threads would be two OpenMP pools: they share one."""
    threads = _step_threads(monkeypatch)
    first, second = make_engine(model_parts), make_engine(model_parts)
    assert first._thread is second._thread
    holders = first._thread.holders  # another test's engine may hold it too
    async with trio.open_nursery() as outer:
        await outer.start(first.run)
        async with trio.open_nursery() as inner:
            await inner.start(second.run)
            assert first._thread.holders == holders + 2
            async with trio.open_nursery() as clients:
                for engine in (first, second, first, second):
                    clients.start_soon(_drain, engine, tokenizer("Name three colours.")["input_ids"])
            await wait_idle(second)
            inner.cancel_scope.cancel()
        assert first._thread.holders == holders + 1 and first._thread.alive  # the first still runs
        await _drain(first, tokenizer("And three more.")["input_ids"])
        await wait_idle(first)
        outer.cancel_scope.cancel()
    assert len(threads) == 1
    assert first._thread.holders == holders and first._thread.alive == (holders > 0)


async def _drain(engine, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    async with engine.generate(ids, SamplingParams(max_tokens=6, temperature=0)) as outputs:
        assert [o async for o in outputs]


def test_single_threaded_nests_and_restores() -> None:
    outer = torch.get_num_threads()
    with single_threaded():
        assert torch.get_num_threads() == 1
        with single_threaded():  # a second engine on the same event loop
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1  # still inside the first
    assert torch.get_num_threads() == outer


async def test_the_runner_thread_returns_raises_and_is_never_abandoned() -> None:
    thread = RunnerThread("test-runner")
    idents = [await thread.run(threading.get_ident) for _ in range(5)]
    assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        await thread.run(lambda: 1 / 0)
    assert await thread.run(lambda: 41 + 1) == 42  # the thread survives a failed job

    class Job:
        def __call__(self) -> int:
            return 1

    job = Job()
    gone = weakref.ref(job)
    assert await thread.run(job) == 1
    del job
    assert gone() is None  # the idle thread keeps nothing of the job it ran (a step holds its grammars)

    release, finished = threading.Event(), []

    def slow() -> str:
        release.wait(5)
        finished.append(True)
        return "done"

    got = None
    with trio.move_on_after(0.05):
        threading.Timer(0.2, release.set).start()
        got = await thread.run(slow)  # cancelled while it runs: waits for it all the same
        await trio.sleep(1)  # the cancellation lands here
    assert got == "done" and finished == [True] and thread.busy == 0
    with trio.CancelScope() as scope:  # cancelled before it starts: it never runs
        scope.cancel()
        await thread.run(lambda: finished.append(False))
    assert finished == [True]
    thread.stop()
    assert not thread.alive
    assert await thread.run(lambda: 7) == 7 and thread.alive  # a stopped thread starts afresh
    thread.stop()
