"""How a request ends: every kind goes through ``Endings.end`` and is counted there once.

A real scheduler and output router driven by plain calls (no actors, no model; the real
tokenizer, since the output path detokenizes): each kind is brought about the way the
engine meets it, then its count, the metrics it feeds, the consumer's last output, the
observer and the pages are checked against what the engine has always done.
"""

from __future__ import annotations

import time

import pytest
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.execution.loading import load_tokenizer
from trillm.engine.mailbox import OutputMailbox
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.end_kinds import End
from trillm.engine.scheduling.endings import Endings
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.output_router import OutputRouter
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.engine.scheduling.telemetry import NullObserver

NUM_PAGES = 64


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EngineConfig())[0]


class Recorder(NullObserver):
    """An ``EngineObserver`` that keeps the finish reasons it hears."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def finished(self, reason: str, seconds: float) -> None:
        self.reasons.append(reason)


class Rig:
    """One engine's scheduling half, stepped by hand with chosen tokens."""

    def __init__(self, tokenizer, stall_timeout: float | None = None) -> None:
        self.tokenizer = tokenizer
        self.allocator = PageAllocator(NUM_PAGES)
        self.scheduler = Scheduler(self.allocator, 4, 8, 64)
        self.router = OutputRouter(tokenizer, stall_timeout)
        self.observer = Recorder()
        self.router.observer = self.observer
        self.endings = Endings(self.router, self.scheduler)

    def open(self, params: SamplingParams, request_id: str = "r") -> tuple[Sequence, OutputMailbox]:
        prompt = self.tokenizer("The capital of France is")["input_ids"]
        seq = Sequence(request_id, prompt, params, 10_000, frozenset(), arrival_time=time.monotonic())
        mailbox = OutputMailbox()
        self.router.open(seq, mailbox, 0)
        self.scheduler.add(seq)
        return seq, mailbox

    def step(self, token: int) -> End | None:
        """One step that samples ``token`` for the request; what routing it says of its end."""
        batch = self.scheduler.schedule()
        self.scheduler.launch(batch)
        ((seq, index),) = self.scheduler.resolve(batch, [token for c in batch.chunks if c.samples])
        return self.router.route(seq, [index], [None])


def _paris(tokenizer) -> int:
    return tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]


def _bring_about(rig: Rig, kind: End, mailbox: OutputMailbox) -> End | None:
    """Drive the request to ``kind`` as the engine meets it; returns what routing reported."""
    paris = _paris(rig.tokenizer)
    if kind in (End.FINISHED, End.STOPPED):
        return rig.step(paris)  # max_tokens=1, or the stop string "Par"
    if kind is End.GONE:
        assert rig.step(paris) is None
        mailbox.close()  # the handler left
        return rig.step(paris)
    if kind is End.STALLED:
        assert rig.step(paris) is None  # its first output waits, never taken
        time.sleep(0.02)
        return rig.step(paris)
    assert rig.step(paris) is None  # running, holding pages: then cut short by the engine
    return kind


PARAMS = {
    End.FINISHED: SamplingParams(max_tokens=1, ignore_eos=True),
    End.STOPPED: SamplingParams(max_tokens=50, stop=("Par",), ignore_eos=True),
}
# What each way of ending has always meant: the consumer's last finish reason (None: none is
# sent after the ordinary outputs; "-": the consumer has gone), the observer's finished
# reasons, and whether /metrics counts it aborted, and stalled.
EXPECTED = {
    End.FINISHED: ("length", ["length"], False, False),
    End.STOPPED: ("stop", ["stop"], False, False),
    End.ABORTED: (None, [], True, False),
    End.GONE: ("-", [], True, False),
    End.STALLED: ("abort", [], True, True),
    End.ERROR: ("error", [], False, False),
    End.SHUTDOWN: ("abort", [], False, False),
}


@pytest.mark.parametrize("kind", list(End), ids=lambda k: k.value)
def test_each_way_of_ending_is_applied_and_counted_once(tokenizer, kind):
    rig = Rig(tokenizer, stall_timeout=0.01 if kind is End.STALLED else None)
    seq, mailbox = rig.open(PARAMS.get(kind, SamplingParams(max_tokens=50, ignore_eos=True)))
    reported = _bring_about(rig, kind, mailbox)
    assert reported is kind
    if kind is End.STOPPED:  # finished by the output path, not the scheduler: its pages wait for the ending
        assert rig.allocator.free_pages < NUM_PAGES

    assert rig.endings.end(seq.request_id, kind, "boom" if kind is End.ERROR else None)
    assert not rig.endings.end(seq.request_id, kind)  # a second ending does nothing
    assert not rig.endings.end(seq.request_id, End.ABORTED)

    last_reason, observed, aborted, stalled = EXPECTED[kind]
    assert rig.endings.counts == {kind: 1}
    assert rig.endings.num_aborted == int(aborted) and rig.endings.num_stalled == int(stalled)
    assert rig.observer.reasons == observed
    assert rig.allocator.free_pages == NUM_PAGES and not rig.scheduler.has_work
    assert seq.request_id not in rig.router.live
    assert seq.finish_reason == {End.FINISHED: "length", End.STOPPED: "stop"}.get(kind, "abort")
    if last_reason == "-":
        return
    out = mailbox.receive_nowait()  # one choice: everything it was sent, merged
    assert out.finish_reason == last_reason
    assert out.error == ("boom" if kind is End.ERROR else None)
    if kind is End.STOPPED:
        assert "Par" not in out.text
    with pytest.raises(trio.EndOfChannel):
        mailbox.receive_nowait()


def test_release_finished_keeps_the_reason_and_abort_says_abort(tokenizer):
    """The scheduler's two calls: freeing a finished request's pages is not an abort."""
    rig = Rig(tokenizer)
    seq, _ = rig.open(SamplingParams(max_tokens=50, ignore_eos=True))
    rig.step(_paris(tokenizer))
    seq.finish_reason = "stop"  # what a stop string does in the output path
    assert rig.scheduler.release_finished(seq.request_id) is seq
    assert seq.finish_reason == "stop" and rig.allocator.free_pages == NUM_PAGES
    assert rig.scheduler.release_finished(seq.request_id) is None

    other, _ = rig.open(SamplingParams(max_tokens=50, ignore_eos=True), "other")
    rig.step(_paris(tokenizer))
    with pytest.raises(AssertionError):
        rig.scheduler.release_finished(other.request_id)  # still running: that would be an abort
    assert rig.scheduler.abort(other.request_id) is other
    assert other.finish_reason == "abort" and rig.allocator.free_pages == NUM_PAGES
