"""Parking (``engine/parking.py``): a stopped engine's model kept with its weights, woken into a
new engine that answers as before; the weights moved to another device and back with every
storage moved once (a tied head, the experts' views of their stack) and no value changed."""

from __future__ import annotations

import attrs
import pytest
import torch
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.execution.loading import load_model
from trillm.engine.parking import ParkedModel, _Mover, relocate
from trillm.engine.sampling_params import SamplingParams

from tests.families import tiny_qwen3
from tests.helpers import make_engine, wait_idle

# Where weights are parked from in this check: the GPU where there is one (`make gpu-check`),
# else the meta device (shapes and storage only: values are checked where they exist).
AWAY = torch.device("cuda" if torch.cuda.is_available() else "meta")


async def _greedy(engine, ids: list[int]) -> list[int]:
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with engine.generate(ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) as outputs:
            tokens = [t async for out in outputs for t in out.token_ids]
        await wait_idle(engine)
        stats = engine.stats()
        assert stats.free_pages + stats.evictable_pages == stats.total_pages
        nursery.cancel_scope.cancel()
    return tokens


async def test_a_parked_engine_wakes_around_the_same_weights_and_answers_the_same(model_parts, tokenizer):
    ids = tokenizer("The capital of France is")["input_ids"]
    engine = make_engine(model_parts)
    before = await _greedy(engine, ids)
    assert ParkedModel.can_park(engine)
    parked = ParkedModel.of(engine)
    assert parked.model is model_parts[0] and parked.weight_bytes == model_parts[0].resident_bytes
    woken = parked.wake()
    assert woken is not engine and woken.runner is not engine.runner and woken.model is model_parts[0]
    assert await _greedy(woken, ids) == before


@attrs.frozen
class _Experts:
    stack: torch.Tensor
    views: list[torch.Tensor]
    tied: tuple[torch.Tensor, torch.Tensor]


def test_tensors_sharing_storage_move_as_one_copy_and_keep_their_views():
    stack = torch.randn(4, 3, 5)
    shared = torch.randn(7, 2)
    value = _Experts(stack, list(stack.unbind(0)), (shared, shared.t()))
    mover = _Mover(AWAY, pin=False)
    moved = mover.value(value)
    assert mover.moved_bytes == stack.nbytes + shared.nbytes  # each storage once
    assert moved.stack.device.type == AWAY.type and all(v.device.type == AWAY.type for v in moved.views)
    ptr = moved.stack.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == ptr for v in moved.views)
    assert [v.storage_offset() for v in moved.views] == [0, 15, 30, 45]
    assert moved.tied[1].stride() == shared.t().stride()
    if AWAY.type != "meta":
        back = _Mover(torch.device("cpu"), pin=False).value(moved)
        torch.testing.assert_close(back.stack, stack, rtol=0, atol=0)
        torch.testing.assert_close(back.views[2], stack[2], rtol=0, atol=0)
        torch.testing.assert_close(back.tied[1], shared.t(), rtol=0, atol=0)
    again = mover.value(value)  # a second pass reuses the copies it made
    assert again.stack.untyped_storage().data_ptr() == ptr


@pytest.mark.gpu
def test_a_models_weights_go_away_and_come_back_unchanged(tmp_path, model_dir):
    model = load_model(EngineConfig(model=str(tiny_qwen3(tmp_path / "tiny", model_dir, 3)), dtype="float32"))[0]
    copies = {name: value.clone() for name, value in vars(model).items() if isinstance(value, torch.Tensor)}
    tables = {id(t): t.nbytes for t in (model.cos, model.sin, model.local_cos, model.local_sin, model.embed_scale)}
    resident = model.resident_bytes
    moved = relocate(model, AWAY)
    assert moved == resident + sum(tables.values())  # every weight and table, once
    assert model.layers[0].qkv.device.type == AWAY.type and model.embed.device.type == AWAY.type
    if AWAY.type != "meta":
        relocate(model, torch.device("cpu"))
        for name, value in copies.items():
            torch.testing.assert_close(getattr(model, name), value, rtol=0, atol=0)
