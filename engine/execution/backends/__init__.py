"""Model-execution backends and the one registry that picks them.

``BACKENDS`` maps each value of the ``--kernels`` setting to a factory of
``(device, dtype) -> Backend``; ``auto`` resolves by device (Triton on CUDA, the CPU
fast path elsewhere): the one ``auto`` rule. A new backend is a ``Backend`` subclass and
one entry here. The composition root (``loading.py``) makes the backend and hands it to
the model; a backend reads the model only through ``ModelWeights``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trillm.engine.execution.backends.base import Backend, KVCache, ModelWeights
from trillm.engine.execution.backends.cpu import CpuBackend
from trillm.engine.execution.backends.kernel import KernelBackend, KernelMetadata
from trillm.kernels import select_kernels

BackendFactory = Callable[[torch.device, torch.dtype], Backend]

BACKENDS: dict[str, BackendFactory] = {
    "cpu": CpuBackend,
    "triton": lambda device, dtype: KernelBackend(device, dtype, select_kernels("triton", device)),
    "reference": lambda device, dtype: KernelBackend(device, dtype, select_kernels("reference", device)),
}


def resolve_backend(choice: str, device: torch.device) -> str:
    """The registry key for a ``--kernels`` value: ``auto`` is Triton on CUDA, else the CPU path."""
    if choice == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    if choice not in BACKENDS:
        raise ValueError(f"kernels must be one of {('auto', *BACKENDS)}, not {choice!r}")
    return choice


def create_backend(choice: str, device: torch.device, dtype: torch.dtype) -> Backend:
    """The backend ``choice`` names (or ``auto`` picks) for a model on ``device`` in ``dtype``."""
    return BACKENDS[resolve_backend(choice, device)](device, dtype)


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendFactory",
    "CpuBackend",
    "KVCache",
    "KernelBackend",
    "KernelMetadata",
    "ModelWeights",
    "create_backend",
    "resolve_backend",
]
