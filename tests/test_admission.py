"""One admission path: each refusal, from the rules themselves, from an ``Engine`` and from a
``ReplicaSet`` (which shares them; built here without starting a replica)."""

from __future__ import annotations

import attrs
import pytest
import trio

from trillm.engine import admission
from trillm.engine.config import EngineConfig
from trillm.engine.errors import EngineNotRunning, EngineOverloaded, PromptTooLong, RequestRejected
from trillm.engine.replicas.front import ReplicaSet
from trillm.engine.sampling_params import SamplingParams

from tests.helpers import make_engine

OK = SamplingParams(max_tokens=4)
BAD_BIAS = SamplingParams(max_tokens=4, logit_bias=((100, 1.0),))


@attrs.define
class Gate:
    """What admission reads, set by hand."""

    is_running: bool = True
    max_model_len: int = 16
    vocab_size: int = 100
    queued: int = 0
    limit: int = 4

    def num_queued(self) -> int:
        return self.queued

    def max_queued(self) -> int:
        return self.limit


def test_a_request_that_fits_is_admitted():
    admission.admit(Gate(queued=3), [([1, 2, 3], OK)])
    admission.admit(Gate(), [([0, 99] * 7 + [5], SamplingParams(logit_bias=((0, 1.0), (99, -1.0))))])


def test_a_stopped_engine_refuses_before_any_other_check():
    with pytest.raises(EngineNotRunning):
        admission.admit(Gate(is_running=False, queued=100), [([], BAD_BIAS)])


def test_over_capacity_counts_the_whole_call():
    admission.admit(Gate(queued=3, limit=4), [([1], OK)])
    with pytest.raises(EngineOverloaded, match=r"^3 requests are already waiting \(the limit is 4\)$"):
        admission.admit(Gate(queued=3, limit=4), [([1], OK), ([2], OK)])
    with pytest.raises(EngineOverloaded):
        admission.check_capacity(Gate(queued=0, limit=0), 1)


@pytest.mark.parametrize(
    ("prompt", "refusal"),
    [([], RequestRejected), ([1] * 16, PromptTooLong), ([1, 100], RequestRejected), ([-1, 1], RequestRejected)],
    ids=["empty", "too-long", "past-the-vocabulary", "negative"],
)
def test_a_bad_prompt_is_refused_even_beside_good_ones(prompt, refusal):
    with pytest.raises(refusal) as caught:
        admission.admit(Gate(), [([1, 2], OK), (prompt, OK)])
    assert caught.value.param == "prompt"
    if refusal is PromptTooLong:
        assert (caught.value.num_prompt_tokens, caught.value.max_model_len) == (16, 16)


@pytest.mark.parametrize("bias", [((100, 1.0),), ((-1, 1.0),)], ids=["past-the-vocabulary", "negative"])
def test_bad_params_are_refused(bias):
    with pytest.raises(RequestRejected, match=r"logit_bias: token ids must be in \[0, 99\]") as caught:
        admission.admit(Gate(), [([1, 2], SamplingParams(logit_bias=bias))])
    assert caught.value.param == "logit_bias"


async def test_an_engine_refuses_each_way_and_queues_nothing(model_parts):
    engine = make_engine(model_parts, max_waiting=2)
    vocab = engine.vocab_size
    with pytest.raises(EngineNotRunning):
        engine.submit([1, 2], OK)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        refusals = [
            ([([1, 2], OK)] * 3, EngineOverloaded),
            ([([], OK)], RequestRejected),
            ([([1] * engine.max_model_len, OK)], PromptTooLong),
            ([([1, vocab], OK)], RequestRejected),
            ([([1, 2], OK), ([1, 2], SamplingParams(logit_bias=((vocab, 1.0),)))], RequestRejected),
        ]
        for requests, refusal in refusals:
            with pytest.raises(refusal):
                engine.submit_many(requests)
        assert engine.stats().num_open_requests == 0 and engine.stats().prompt_tokens_total == 0
        nursery.cancel_scope.cancel()


def test_a_replica_set_refuses_through_the_same_rules():
    replicas = ReplicaSet(EngineConfig(dp=2))
    try:
        vocab = replicas.vocab_size
        with pytest.raises(EngineNotRunning):
            replicas.submit([1, 2], OK)
        with pytest.raises(RequestRejected):
            replicas.check_prompt([])
        with pytest.raises(PromptTooLong):
            replicas.check_prompt([1] * replicas.max_model_len)
        with pytest.raises(RequestRejected, match=rf"\[0, {vocab - 1}\]"):
            replicas.check_prompt([vocab])
        with pytest.raises(RequestRejected, match="logit_bias"):
            replicas.check_params(SamplingParams(logit_bias=((vocab, 1.0),)))
        with pytest.raises(EngineOverloaded, match=r"\(the limit is 0\)"):  # no replica is up yet
            replicas.check_capacity(1)
        replicas.check_prompt([1, 2])
        replicas.check_params(OK)
    finally:
        replicas.grammars.close()
