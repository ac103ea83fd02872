"""Kernels for the model's hot spots, each as Triton and as a plain-torch reference.

A ``Kernels`` record is one complete set; ``select_kernels`` builds the set it is asked
for (Triton runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` for tests). Which
set runs where is chosen once, by the engine's backend registry
(``trillm.engine.execution.backends``), which wraps a set in a ``KernelBackend``. The CPU C
kernels (``cpu_*.py``) are not a set; the engine's ``CpuBackend`` calls them directly.

A Python started in the repository root finds this folder as a top-level ``kernels``, the
name of Hugging Face's package, which transformers (5.25 on) depends on and imports. Imported
under that name, this file hands the name to the installed namesake (``_yield_to_namesake``),
so that ``from kernels import ...`` gets Hugging Face's; where none is installed it stays,
without a ``__version__``, which transformers reads as no usable ``kernels``. Either way it
must load without trillm's dependencies (tests/test_kernels_folder.py): the standard library
only at its top, a dataclass rather than attrs for ``Kernels``, torch only for the type checker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KERNEL_CHOICES = ("triton", "reference")


def _yield_to_namesake() -> None:
    """Put the installed top-level ``kernels`` (Hugging Face's) in this module's place, if any.

    The import system returns whatever ``sys.modules["kernels"]`` holds once this file has run,
    so the importer gets the namesake. It is looked for on ``sys.path`` less this folder's parent.
    """
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        return
    namesake = importlib.util.module_from_spec(spec)
    ours = sys.modules["kernels"]
    sys.modules["kernels"] = namesake  # its own ``kernels.*`` imports find it during its run
    try:
        spec.loader.exec_module(namesake)
    except BaseException:
        sys.modules["kernels"] = ours
        raise


if __name__ == "kernels":
    _yield_to_namesake()


@dataclass(frozen=True)
class Kernels:
    """One implementation of every kernel; all share the reference signatures."""

    name: str
    store_kv: Callable[..., None]
    decode_attention: Callable[..., torch.Tensor]
    extend_attention: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    sample_top_k_top_p: Callable[..., torch.Tensor]
    grouped_matmul: Callable[..., torch.Tensor]  # a mixture's experts in one launch (``moe.py``)


def reference_kernels() -> Kernels:
    from trillm.kernels import reference as r

    return Kernels(
        "reference",
        r.store_kv,
        r.decode_attention,
        r.extend_attention,
        r.add_rms_norm,
        r.rotary,
        r.sample_top_k_top_p,
        r.grouped_matmul,
    )


def triton_kernels() -> Kernels:
    from trillm.kernels.attention import decode_attention, extend_attention
    from trillm.kernels.cache import store_kv
    from trillm.kernels.moe import grouped_matmul
    from trillm.kernels.norm import add_rms_norm
    from trillm.kernels.rotary import rotary
    from trillm.kernels.sampling import sample_top_k_top_p

    return Kernels(
        "triton", store_kv, decode_attention, extend_attention, add_rms_norm, rotary, sample_top_k_top_p, grouped_matmul
    )


def triton_available(device: torch.device) -> bool:
    """Triton compiles for CUDA; on the CPU it only interprets (slowly, for tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def select_kernels(choice: str, device: torch.device) -> Kernels:
    """The set ``choice`` names, ``triton`` or ``reference``. There is no ``auto`` here: which
    backend runs where is decided once, by the engine's registry (its ``auto`` rule)."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, not {choice!r}")
    if choice == "reference":
        return reference_kernels()
    if not triton_available(device):
        raise ValueError(f"Triton kernels cannot run on {device} here (set TRITON_INTERPRET=1 to interpret them)")
    return triton_kernels()
