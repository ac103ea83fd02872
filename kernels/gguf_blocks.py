"""GGUF tensor types kept as the file holds them: one table, and the weight record.

A GGUF file stores each matrix [N, K] row by row, each row ``K / values`` blocks of ``bytes``
bytes (or plain F16 / BF16 values). A ``GGUFWeight`` keeps those bytes as they are (a view of
the memory-mapped file where nothing had to change), so a model takes the file's size in
memory, not float32's 4 bytes a weight; ``cpu_gguf`` decodes them inside its matmul.

``BLOCK_TYPES`` is the one place a type is declared: its id, its block layout, the reference
decoder (``gguf``'s, used by the tests and by backends without these kernels) and the layout it
is repacked into at load (``repack``: Q4_0, Q4_1 and Q8_0 go into ``block_weights``' Q4_1 / Q8_0
layouts exactly, which the faster hand-written kernels and the fused decode loop run). A new
type is one entry here, one decoder in ``cpu_gguf.c`` and one case in its test.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from trillm.kernels.block_weights import BlockWeight, Q4_1Weight, Q8_0Weight


@attrs.frozen
class BlockType:
    name: str
    id: int  # ggml's GGMLQuantizationType value, as the file's tensor info holds it
    values: int  # weights per block
    bytes: int  # bytes per block
    repack: str | None = None  # "q4_1" / "q8_0": repacked exactly into block_weights' layouts


BLOCK_TYPES = {
    t.name: t
    for t in (
        BlockType("F16", 1, 1, 2),
        BlockType("BF16", 30, 1, 2),
        BlockType("Q4_0", 2, 32, 18, repack="q4_1"),
        BlockType("Q4_1", 3, 32, 20, repack="q4_1"),
        BlockType("Q5_0", 6, 32, 22),
        BlockType("Q5_1", 7, 32, 24),
        BlockType("Q8_0", 8, 32, 34, repack="q8_0"),
        BlockType("Q2_K", 10, 256, 84),
        BlockType("Q3_K", 11, 256, 110),
        BlockType("Q4_K", 12, 256, 144),
        BlockType("Q5_K", 13, 256, 176),
        BlockType("Q6_K", 14, 256, 210),
        BlockType("MXFP4", 39, 32, 17),  # gpt-oss's experts: E8M0 scale, 32 E2M1 values
    )
}
BY_ID = {t.id: t for t in BLOCK_TYPES.values()}


@attrs.frozen
class GGUFWeight:
    """A matrix [N, K] in the file's blocks: ``data`` uint8 [N, row_bytes], rows as stored.
    ``activation_bits``: the width ``cpu_gguf``'s integer path quantizes x to for it, 16 or 8
    (``ACTIVATION_BITS``); a load-time choice (``--activation-bits``) kept with the weight."""

    kind: BlockType
    data: torch.Tensor
    K: int
    activation_bits: int = attrs.field(default=16, validator=attrs.validators.in_((8, 16)))

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.K

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def row_bytes(kind: BlockType, K: int) -> int:
    if K % kind.values:
        raise ValueError(f"{kind.name} rows hold whole blocks of {kind.values}; {K} values do not")
    return K // kind.values * kind.bytes


def from_bytes(kind: BlockType, raw: np.ndarray, N: int, K: int, activation_bits: int = 16) -> GGUFWeight:
    """A weight over ``raw`` (uint8, the tensor's bytes, e.g. a view of the mapped file)."""
    data = torch.from_numpy(raw).view(N, row_bytes(kind, K))
    return GGUFWeight(kind, data, K, activation_bits)


def rows_of(weight: GGUFWeight, data: torch.Tensor) -> GGUFWeight:
    """``weight`` over other rows of its kind (a cut, a reorder), its other settings kept."""
    return attrs.evolve(weight, data=data)


def reference_dequantize(weight: GGUFWeight) -> torch.Tensor:
    """float32 [N, K] by ``gguf``'s own decoder: what the kernels are tested against."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(weight.data.numpy(), GGMLQuantizationType(weight.kind.id))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(weight.shape)


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """float16 -> float32 of the 2-byte field at ``start`` of each block ([..., bytes] uint8)."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def repacked(weight: GGUFWeight) -> BlockWeight | GGUFWeight:
    """``weight`` in ``block_weights``' layout where its type maps there exactly, else itself.

    Q4_0's ``d * (q - 8)`` is ``d * q + (-8 d)`` in Q4_1 form with the same float32 result: the
    product and the sum are exact (an 11-bit scale times a 4-bit integer). Scales become
    float32 (0.75 bytes a weight for Q4_1 instead of the file's 0.625).
    """
    kind, (N, K) = weight.kind, weight.shape
    if kind.repack is None:
        return weight
    blocks = weight.data.reshape(N, K // kind.values, kind.bytes)
    d = _halves(blocks, 0)
    if kind.name == "Q8_0":
        return Q8_0Weight(qs=blocks[..., 2:].contiguous().view(torch.int8).reshape(N, K), d=d)
    if kind.name == "Q4_1":
        return Q4_1Weight(qs=blocks[..., 4:].reshape(N, K // 2).contiguous(), d=d, m=_halves(blocks, 2))
    return Q4_1Weight(qs=blocks[..., 2:].reshape(N, K // 2).contiguous(), d=d, m=d * -8.0)
