"""How much memory the device a model runs on has: the ceiling of ``--models-memory``'s default."""

from __future__ import annotations

import torch

from trillm.engine.config import EngineConfig
from trillm.engine.execution.gguf_support import cgroup_memory_limit, meminfo
from trillm.engine.execution.loading import choose_device


def device_memory(config: EngineConfig) -> int | None:
    """Bytes of the GPU's memory, or of the machine's (less where a cgroup, a container, caps it
    lower); None where neither is known."""
    device = choose_device(config)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    known = [n for n in (meminfo("MemTotal"), cgroup_memory_limit()) if n is not None]
    return min(known) if known else None
