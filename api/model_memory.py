"""How much a served model takes and may take: ``--models-memory``'s budget, a model's size on
disk before its first load, and how many unloaded models stay parked (``--park-models``)."""

from __future__ import annotations

from pathlib import Path

import torch

from trillm.api.settings import ServerConfig
from trillm.engine import EngineConfig, device_memory

GiB = 2**30
DEFAULT_MEMORY_SHARE = 0.9  # of the device's memory, where --models-memory is not given
DEFAULT_PARKED_ON_GPU = 2  # --park-models where it is not given, on a GPU (0 on a CPU)
WEIGHT_FILES = ("*.safetensors", "*.gguf", "*.bin", "*.pt")


def files_bytes(model: str) -> int:
    """The size of a model's weight files on disk (a GGUF file, a folder's safetensors); 0 for a
    name not on disk (a hub id): its load is weighed once it has loaded."""
    path = Path(model).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for pattern in WEIGHT_FILES for f in path.glob(pattern))
    return 0


def park_limit(server: ServerConfig, config: EngineConfig) -> int:
    """How many unloaded models stay parked (``--park-models``)."""
    if server.park_models is not None:
        return server.park_models
    on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return DEFAULT_PARKED_ON_GPU if on_gpu else 0


def memory_budget(server: ServerConfig, config: EngineConfig) -> int | None:
    """Bytes all loaded models may take (``--models-memory``); None: no budget."""
    if server.models_memory is not None:
        return int(server.models_memory * GiB) or None
    total = device_memory(config)
    return int(DEFAULT_MEMORY_SHARE * total) if total else None
