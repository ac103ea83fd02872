"""Shared fixtures: the real default model (loaded once) and engines that must end idle."""

from __future__ import annotations

import os
from typing import Any, AsyncIterator

import torch

# Without a GPU, Triton kernels run in its interpreter; it must be chosen
# before any kernel module is imported (``triton.jit`` reads it then).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine, load_model
from trillm.engine.execution.model_source import DEFAULT_ALIAS, resolve_model


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model(DEFAULT_ALIAS, EngineConfig().cache_path)


@pytest.fixture(scope="session")
def model_parts(model_dir) -> tuple[Any, Any, frozenset[int]]:
    """SmolLM2 in float32, so it can be compared with transformers exactly."""
    return load_model(EngineConfig(dtype="float32"))


@pytest.fixture(scope="session")
def tokenizer(model_parts):
    return model_parts[1]


async def wait_idle(engine: Engine, timeout: float = 10.0) -> None:
    """Wait until the engine holds no requests and every page is free or only cached, or fail."""
    with trio.move_on_after(timeout):
        while True:
            s = engine.stats()
            idle = s.num_open_requests == 0 and s.num_running == 0 and s.num_waiting == 0
            if idle and s.free_pages + s.evictable_pages == s.total_pages:
                return
            await trio.sleep(0.01)
    s = engine.stats()
    raise AssertionError(f"engine did not return to idle: {s}")


def make_engine(model_parts, **overrides: Any) -> Engine:
    settings: dict[str, Any] = dict(dtype="float32", num_pages=256, page_size=16, max_num_seqs=32, max_batch_tokens=256)
    settings.update(overrides)
    return Engine(EngineConfig(**settings), *model_parts)


@pytest.fixture
async def engine(model_parts) -> AsyncIterator[Engine]:
    """A running engine; after the test it must be idle with every page free,
    and once stopped it must leave no task and no borrowed worker thread behind."""
    from tests.server import all_tasks

    eng = make_engine(model_parts)
    before = all_tasks()
    async with trio.open_nursery() as nursery:
        await nursery.start(eng.run)
        yield eng
        await wait_idle(eng)
        nursery.cancel_scope.cancel()
    leaked = all_tasks() - before
    assert not leaked, f"tasks outlived the engine: {[t.name for t in leaked]}"
    assert eng._limiter.borrowed_tokens == 0 and not eng.is_running


@pytest.fixture
async def server(model_parts):
    """A real Hypercorn server on 127.0.0.1 around a fresh engine; idle afterwards."""
    from tests.server import running_server

    async with running_server(model_parts) as srv:
        yield srv
