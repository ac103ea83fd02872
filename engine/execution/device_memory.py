"""How much memory the device a model runs on has: the ceiling of ``--models-memory``'s default."""

from __future__ import annotations

from pathlib import Path

import torch

from trillm.engine.config import EngineConfig
from trillm.engine.execution.gguf_support import meminfo
from trillm.engine.execution.loading import choose_device


def device_memory(config: EngineConfig) -> int | None:
    """Bytes of the GPU's memory, or of the machine's (less where a cgroup, a container, caps it
    lower); None where neither is known."""
    device = choose_device(config)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = meminfo("MemTotal")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    if limit.isdigit():
        total = int(limit) if total is None else min(total, int(limit))
    return total
