"""A model parked in host memory while no engine runs it: its weights kept, its KV pool freed.

vLLM's sleep mode (level 1) for a server of several models: an unloaded model parked so is
woken without reading its files again. Parking moves every weight tensor to the CPU (pinned
memory on a GPU machine, so waking copies at the bus's speed) and lets the stopped engine go,
with its KV pool and CUDA graphs; waking moves the weights back and builds a new engine
around them (a new pool, graphs captured again). Tensors that share storage (a tied head, the
experts' views of their stack) move as one copy. On a CPU the weights stay where they are and
only the pool is freed. Tensor-parallel ranks and data-parallel replicas live in processes of
their own and are not parked.
"""

from __future__ import annotations

import time
from typing import Any, TypeGuard

import attrs
import torch

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine
from trillm.engine.execution.model import DecoderModel

HOST = torch.device("cpu")
# Held by the model but not moved: the classifier head is read on the CPU wherever the model runs.
STAYS = frozenset({"classifier"})


class _Mover:
    """Moves tensors to ``device``, one copy per storage: views of one keep sharing it."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.device, self.pin = device, pin
        self.storages: dict[int, torch.Tensor] = {}  # old storage's address -> its flat copy there
        self.moved_bytes = 0

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.device:
            return t
        storage = t.untyped_storage()
        flat = self.storages.get(storage.data_ptr())
        if flat is None:
            whole = torch.empty(0, dtype=t.dtype, device=t.device)
            whole.set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
            flat = torch.empty(whole.shape, dtype=t.dtype, device=self.device, pin_memory=self.pin)
            flat.copy_(whole, non_blocking=self.pin)
            self.storages[storage.data_ptr()] = flat
            self.moved_bytes += storage.nbytes()
        return flat.as_strided(t.size(), t.stride(), t.storage_offset())

    def value(self, v: Any) -> Any:
        """``v`` with its tensors moved: the same object where none had to move."""
        if isinstance(v, torch.Tensor):
            return self.tensor(v)
        if isinstance(v, list | tuple) and type(v) in (list, tuple):
            items = [self.value(x) for x in v]
            return v if all(a is b for a, b in zip(items, v)) else type(v)(items)
        if attrs.has(type(v)):
            fields = [f for f in attrs.fields(type(v)) if f.init]
            new = {f.alias: self.value(getattr(v, f.name)) for f in fields}
            if all(new[f.alias] is getattr(v, f.name) for f in fields):
                return v
            return attrs.evolve(v, **new)
        return v


def relocate(model: DecoderModel, device: torch.device, pin: bool = False) -> int:
    """Move ``model``'s weights to ``device`` in place; returns the bytes copied."""
    mover = _Mover(device, pin)
    for name, value in list(vars(model).items()):
        if name not in STAYS:
            setattr(model, name, mover.value(value))
    if device.type == "cuda" or model.device.type == "cuda":
        torch.cuda.synchronize()
    return mover.moved_bytes


@attrs.define(eq=False)
class ParkedModel:
    """What a stopped engine leaves to wake from: its model (and draft) on the host, its tokenizer."""

    config: EngineConfig
    model: DecoderModel
    draft_model: DecoderModel | None
    tokenizer: Any
    eos_ids: frozenset[int]
    device: torch.device  # where it runs, and goes back to
    weight_bytes: int  # what it holds on the host (the resident weights)
    parked_at: float = attrs.Factory(time.monotonic)

    @staticmethod
    def can_park(engine: object) -> TypeGuard[Engine]:
        """One engine in this process (not tensor-parallel ranks, not replicas), stopped."""
        return isinstance(engine, Engine) and engine.ranks is None and not engine.is_running

    @classmethod
    def of(cls, engine: Engine) -> ParkedModel:
        """Park a stopped engine's model (slow on a GPU: call from a thread); the engine is spent."""
        assert cls.can_park(engine)
        device = engine.model.device
        pin = device.type == "cuda"
        for model in (engine.model, engine.draft_model):
            if model is not None:
                relocate(model, HOST, pin)
        parked = cls(
            engine.config,
            engine.model,
            engine.draft_model,
            engine.tokenizer,
            engine.eos_ids,
            device,
            engine.model.resident_bytes,
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the device's memory back for other models, not held by torch
        return parked

    def wake(self) -> Engine:
        """A new engine around the parked weights, moved back (call from a thread)."""
        for model in (self.model, self.draft_model):
            if model is not None:
                relocate(model, self.device)
        return Engine(self.config, self.model, self.tokenizer, self.eos_ids, draft_model=self.draft_model)

    @property
    def holds_host_memory(self) -> bool:
        """Whether its weights take the same memory the running models do (a CPU's)."""
        return self.device.type == "cpu"
