"""Decode steps replayed from graphs give the same logits and KV as eager steps.

Without a GPU the graphs are "eager captures" (the same static buffers, bucket padding
and padding rows, with the step function run again on replay); on a GPU the same test
captures real CUDA graphs of the Triton forward.
"""

from __future__ import annotations

import pytest
import torch

from trillm.engine.execution.backends import create_backend
from trillm.engine.execution.cuda_graphs import batch_buckets
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_runner import ModelRunner
from trillm.engine.execution.shape import ModelShape
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence

from tests.test_kernel_engine import TINY, _weights

pytestmark = pytest.mark.gpu


def test_buckets_cover_every_batch_size():
    assert batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64)[-3:] == [48, 56, 64]
    for n in range(1, 65):
        assert any(b >= n for b in batch_buckets(64))


def test_replayed_decode_steps_match_eager_ones():
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    backend = create_backend("triton" if cuda else "reference", device, torch.float32)
    model = DecoderModel(ModelShape.from_config(TINY), _weights(), torch.float32, 256, device, backend=backend)
    eager = ModelRunner(model, 60, 4)
    graphed = ModelRunner(model, 60, 4, graph_batch=6, max_model_len=256)
    assert graphed.graphs is not None and graphed.graphs.buckets == [1, 2, 4, 6]
    used: list[int] = []
    for size, replay in list(graphed.graphs.replays.items()):
        graphed.graphs.replays[size] = lambda replay=replay, size=size: (used.append(size), replay())[1]

    allocator = PageAllocator(60)
    sched = Scheduler(allocator, 4, 8, 64)
    # Five sequences that finish one by one: the batch shrinks 5 -> 1 through the buckets.
    seqs = [
        Sequence(
            f"s{i}",
            list(range(10 + 7 * i, 13 + 9 * i)),
            SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True),
            256,
            frozenset(),
        )
        for i in range(5)
    ]
    for seq in seqs:
        sched.add(seq)
    decode_steps = 0
    while sched.has_work:
        batch = sched.schedule()
        logits = {}
        for name, runner in (("eager", eager), ("graphed", graphed)):
            with torch.inference_mode():
                logits[name] = runner.execute_logits(runner.prepare(batch)).cpu()
        torch.testing.assert_close(logits["graphed"], logits["eager"], atol=1e-5, rtol=1e-5)
        decode_steps += all(c.length == 1 for c in batch.chunks)
        sched.complete(batch, [int(row.argmax()) for row in logits["eager"]])
    assert all(len(seq.output_ids) == seq.params.max_tokens for seq in seqs)
    assert len(used) == decode_steps and {6, 4, 2, 1} <= set(used)  # 5 rows pad to 6, 3 to 4
    for (k1, v1), (k2, v2) in zip(eager.kv_cache, graphed.kv_cache):  # padding rows wrote no slot
        torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-5)
