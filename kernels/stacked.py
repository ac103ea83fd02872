"""Projections side by side: a fused Q/K/V or gate/up whose parts a GGUF file keeps in different
block types. A projection here is dense and transposed, [in, out] (a torch tensor), or in blocks,
[out, in] (``block_weights``, ``gguf_blocks``); the model's layers and the fused decode loop
(``cpu_forward``) both run them.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


def out_features(w: Any) -> int:
    return w.shape[1] if isinstance(w, torch.Tensor) else w.shape[0]


def in_features(w: Any) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor) else w.shape[1]


def nbytes(w: Any) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


@attrs.frozen
class Stacked:
    """Projections whose outputs sit side by side ([out_1 + out_2 + ..., in]): a fused Q/K/V or
    gate/up whose parts a GGUF file keeps in different block types."""

    parts: tuple[Any, ...]  # dense tensors or block weights

    @property
    def shape(self) -> tuple[int, int]:
        return sum(out_features(p) for p in self.parts), in_features(self.parts[0])

    @property
    def nbytes(self) -> int:
        return sum(nbytes(p) for p in self.parts)
