"""Shared fixtures: the real default model (loaded once) and engines that must end idle."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import tests.cores  # noqa: F401  (first: a parallel run's share of the cores, before torch)

# isort: split
import torch

# Without a GPU, Triton kernels run in its interpreter; it must be chosen
# before any kernel module is imported (``triton.jit`` reads it then).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine, load_model
from trillm.engine.execution.model_source import converted_default

from tests.helpers import all_tasks, make_engine, wait_idle


@pytest.fixture(scope="session")
def model_dir():
    """The default model as a float32 safetensors checkpoint (``converted_default``): what
    ``transformers`` loads as the reference for the model the engine serves from the GGUF file."""
    return converted_default(EngineConfig().cache_path)


@pytest.fixture(scope="session")
def model_parts(model_dir) -> tuple[Any, Any, frozenset[int]]:
    """SmolLM2 in float32 with a float32 KV cache (the default is float16: ``test_kv_cache_dtype``), so it
    can be compared with transformers exactly."""
    return load_model(EngineConfig(dtype="float32", kv_cache_dtype="float32"))


@pytest.fixture(scope="session")
def tokenizer(model_parts):
    return model_parts[1]


@pytest.fixture
async def engine(model_parts) -> AsyncIterator[Engine]:
    """A running engine; after the test it must be idle with every page free,
    and once stopped it must leave no task and no borrowed worker thread behind."""
    eng = make_engine(model_parts)
    before = all_tasks()
    async with trio.open_nursery() as nursery:
        await nursery.start(eng.run)
        yield eng
        await wait_idle(eng)
        nursery.cancel_scope.cancel()
    leaked = all_tasks() - before
    assert not leaked, f"tasks outlived the engine: {[t.name for t in leaked]}"
    assert eng._thread.busy == 0 and eng._thread.alive == (eng._thread.holders > 0) and not eng.is_running


@pytest.fixture
async def server(model_parts):
    """A real Hypercorn server on 127.0.0.1 around a fresh engine; idle afterwards."""
    from tests.server import running_server

    async with running_server(model_parts) as srv:
        yield srv


_MODEL_FIXTURES = {"model_dir", "model_parts", "tokenizer", "engine", "server"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``model``: the test loads the real default model (through any of its fixtures);
    ``e2e``: it talks to a real server. ``gpu`` and ``slow`` are written on the tests."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & _MODEL_FIXTURES:
            item.add_marker(pytest.mark.model)
        if "server" in used:
            item.add_marker(pytest.mark.e2e)
    # Files holding ``slow`` tests first (each file's own order kept): under ``--dist worksteal``
    # the first worker starts on them at once, and the other takes half of what is left once
    # it runs dry, rather than one long file trailing at the end.
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
