"""The C layer loop of decode-only steps (``kernels/cpu_forward.c``) against the Python loop
it replaces: the same kernels in the same order, so logits and KV must be bit for bit equal."""

from __future__ import annotations

import pytest
import torch

from trillm.engine.execution.model_runner import ModelRunner
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.kernels import cpu_forward


@pytest.fixture
def fusing_model(model_parts, monkeypatch):
    """The default model (block weights), counting the steps that took the C loop."""
    model = model_parts[0]
    assert model.backend.fuse_decode and model.backend.fusable(model), (
        "the default model on this CPU should run decode steps in C"
    )
    calls = []
    real = cpu_forward.DecodeLayers.run
    monkeypatch.setattr(
        cpu_forward.DecodeLayers, "run", lambda self, h, *a: (calls.append(h.shape[0]), real(self, h, *a))[1]
    )
    yield model, calls
    model.backend.fuse_decode = True


def test_decode_steps_in_c_equal_the_python_loop(fusing_model):
    model, calls = fusing_model
    fused, plain = ModelRunner(model, 40, 16), ModelRunner(model, 40, 16)
    sched = Scheduler(PageAllocator(40), 16, 8, 256)
    # Seven sequences of ragged lengths (some crossing page boundaries while decoding),
    # finishing one after another: decode batches of 7 down to 1 rows.
    seqs = [
        Sequence(
            f"s{i}",
            list(range(100 + 13 * i, 100 + 13 * i + 5 + 6 * i)),
            SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True),
            10_000,
            frozenset(),
        )
        for i in range(7)
    ]
    for seq in seqs:
        sched.add(seq)
    decode_rows = []
    while sched.has_work:
        batch = sched.schedule()
        logits = {}
        for name, runner, fuse in (("fused", fused, True), ("plain", plain, False)):
            model.backend.fuse_decode = fuse
            with torch.inference_mode():
                logits[name] = runner.execute_logits(runner.prepare(batch))
        assert torch.equal(logits["fused"], logits["plain"])
        if all(c.length == 1 for c in batch.chunks):
            decode_rows.append(len(batch.chunks))
        sched.complete(batch, logits["plain"].argmax(-1).tolist())
    assert calls == decode_rows and 7 in calls and 1 in calls  # every decode-only step, and only those, in C
    for (k1, v1), (k2, v2) in zip(fused.kv_cache, plain.kv_cache):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_bad_slots_and_layouts_are_refused(fusing_model):
    model, _ = fusing_model
    runner = ModelRunner(model, 8, 16)
    layers = [(la.input_norm, la.qkv, la.o_proj, la.post_norm, la.gate_up, la.down) for la in model.layers]
    with pytest.raises(ValueError, match="layers but"):
        cpu_forward.DecodeLayers(layers, runner.kv_cache[:-1], model.shape.num_heads, 1e-5, 0.125)
    with pytest.raises(ValueError, match="layer shapes"):
        cpu_forward.DecodeLayers(
            [layers[0][:1] + (layers[0][5],) + layers[0][2:]], runner.kv_cache[:1], model.shape.num_heads, 1e-5, 0.125
        )
    loop = cpu_forward.DecodeLayers(layers, runner.kv_cache, model.shape.num_heads, 1e-5, 0.125)
    h = torch.randn(1, model.shape.hidden_size)
    cos, sin = model.cos[:1].contiguous(), model.sin[:1].contiguous()
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    before = [k.clone() for k, _ in runner.kv_cache]
    with pytest.raises(ValueError, match="out of range"):  # slot 8 * 16 is past the cache
        loop.run(h.clone(), cos, sin, torch.tensor([8 * 16]), tables, lens, 2)
    with pytest.raises(ValueError, match="out of range"):  # page 9 of 8
        loop.run(h.clone(), cos, sin, torch.tensor([0]), torch.full((1, 1), 9, dtype=torch.int32), lens, 2)
    with pytest.raises(ValueError, match="int32"):
        loop.run(h.clone(), cos, sin, torch.tensor([0]), tables.long(), lens, 2)
    assert all(torch.equal(k, b) for (k, _), b in zip(runner.kv_cache, before))  # nothing written by a refusal
