"""Helpers the tests share: engines that must end idle, and the task tree for leak checks.

Fixtures live in ``conftest.py``; the real server in ``server.py``; tests import
helpers from here, never from each other.
"""

from __future__ import annotations

import os
from typing import Any

import trio

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine


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


def make_engine(model_parts, draft: Any = None, **overrides: Any) -> Engine:
    """An engine over the loaded ``model_parts``; ``draft``: a loaded model to draft with."""
    settings: dict[str, Any] = dict(dtype="float32", num_pages=256, page_size=16, max_num_seqs=32, max_batch_tokens=256)
    if os.environ.get("TRILLM_NUM_THREADS"):  # this worker's share of the cores (tests/cores.py)
        settings["num_threads"] = int(os.environ["TRILLM_NUM_THREADS"])
    settings.update(overrides)
    return Engine(EngineConfig(**settings), *model_parts, draft_model=draft)


def all_tasks() -> set[trio.lowlevel.Task]:
    """Every living task, found by walking the task tree from the root."""
    found: set[trio.lowlevel.Task] = set()
    stack = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        found.add(task)
        stack.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return found


async def outputs_by_prompt(engine: Engine, tokenizer: Any, prompts: list[str], params: Any) -> dict[str, list[Any]]:
    """Every prompt through ``engine`` at once: each prompt's outputs, in order."""
    out: dict[str, list[Any]] = {}

    async def one(prompt: str) -> None:
        async with engine.generate(tokenizer(prompt)["input_ids"], params) as outputs:
            out[prompt] = [o async for o in outputs]

    async with trio.open_nursery() as nursery:
        for prompt in prompts:
            nursery.start_soon(one, prompt)
    return out
