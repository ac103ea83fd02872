"""Weights kept in GGUF-style blocks: the exact values of a float32 matrix, in 6 or 9 bits.

The default model ships as a GGUF file whose linear weights are Q4_1 blocks (and whose
tied embedding is Q8_0); loading it dequantizes them to float32. Every float32 weight
is then ``d * q + m`` (or ``d * q``) for its block of 32 along the input dimension, so
the same numbers fit in the block form again. ``pack_q4_1`` / ``pack_q8_0`` find that
form and verify it value by value: a matrix that is not exactly of that form is not
packed (None), so packing never changes a weight. A matmul that decodes the blocks in
registers (``kernels/cpu_matmul``) then reads 5.3x (Q4_1) or 3.6x (Q8_0) fewer bytes
per decode step for the same float32 arithmetic (scales are kept in float32, not
GGUF's float16: simpler to decode, 0.75 instead of 0.625 bytes per Q4_1 weight).

Layout, per row n of W [N, K] and block b (32 values along K, K % 32 == 0):

* Q4_1: ``qs`` uint8 [N, K / 2]; byte ``16 b + j`` holds q[32 b + j] in its low nibble
  and q[32 b + j + 16] in its high nibble (GGUF's order); ``d``, ``m`` float32 [N, K / 32].
  w = float32(d * q) + m, rounded after the product and after the sum (no fused
  multiply-add), as GGUF's dequantizer and ``transformers`` compute it.
* Q8_0: ``qs`` int8 [N, K]; ``d`` float32 [N, K / 32]; w = float32(d * q).
"""

from __future__ import annotations

import attrs
import torch

BLOCK = 32
PROBE_ROWS = 16  # a matrix whose first rows are not of a form is not: one cheap pass says so
CHUNK_BLOCKS = 1 << 14  # blocks a pass takes at once: its scratch (2 MiB each) stays in cache


@attrs.frozen
class Q4_1Weight:
    qs: torch.Tensor  # uint8 [N, K // 2]
    d: torch.Tensor  # float32 [N, K // 32]
    m: torch.Tensor  # float32 [N, K // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))


@attrs.frozen
class Q8_0Weight:
    qs: torch.Tensor  # int8 [N, K]
    d: torch.Tensor  # float32 [N, K // 32]

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d))


BlockWeight = Q4_1Weight | Q8_0Weight


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> int32 [N, K / 32, 32] in GGUF's order."""
    n = qs.shape[0]
    blocks = qs.reshape(n, -1, BLOCK // 2).to(torch.int32)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=-1)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int [N, K / 32, 32] of 0..15 -> uint8 [N, K / 2]."""
    low, high = q[..., : BLOCK // 2], q[..., BLOCK // 2 :]
    return (low | (high << 4)).to(torch.uint8).reshape(q.shape[0], -1)


def dequantize(weight: BlockWeight) -> torch.Tensor:
    """The float32 matrix [N, K], value by value as the layout above defines it."""
    n, k = weight.shape
    if isinstance(weight, Q4_1Weight):
        q = _unpack_nibbles(weight.qs).to(torch.float32)
        w = weight.d.unsqueeze(-1) * q + weight.m.unsqueeze(-1)  # two torch ops: two roundings
    else:
        q = weight.qs.reshape(n, -1, BLOCK).to(torch.float32)
        w = weight.d.unsqueeze(-1) * q
    return w.reshape(n, k)


def _scale_candidates(span: torch.Tensor, levels: int) -> list[torch.Tensor]:
    """Scales to try per block, likeliest first: span / levels rounded to float16 (GGUF
    stores scales in float16), then in float32, then the float16 neighbours."""
    exact = span / levels
    half = exact.to(torch.float16)
    inf = torch.tensor(float("inf"), dtype=torch.float16)
    return [half.float(), exact, torch.nextafter(half, inf).float(), torch.nextafter(half, -inf).float()]


def _blocks(w: torch.Tensor) -> torch.Tensor | None:
    if w.dim() != 2 or w.shape[1] % BLOCK or w.dtype != torch.float32:
        return None
    return w.reshape(-1, BLOCK)


def _try_scale(
    w: torch.Tensor,
    off: torch.Tensor,
    d: torch.Tensor,
    divisor: torch.Tensor,
    lowest: int,
    highest: int,
    q: torch.Tensor,
    rebuilt: torch.Tensor,
) -> torch.Tensor:
    """Which blocks of ``w`` are ``d * q + off`` exactly, q written into ``q`` (``rebuilt``: scratch).
    ``divisor`` is ``d`` but where ``d`` is 0 (a zero-span block, whose q is 0)."""
    torch.sub(w, off, out=q).div_(divisor).round_().clamp_(lowest, highest)
    torch.mul(q, d, out=rebuilt).add_(off)  # two torch ops: two roundings, as dequantize
    return torch.eq(rebuilt, w).all(1)


def _solve(
    blocks: torch.Tensor,
    offset: torch.Tensor,
    span: torch.Tensor,
    levels: int,
    lowest: int,
    highest: int,
    q_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per block [B, 32]: (d [B], q [B, 32]) with d * q + offset == blocks exactly, or None.

    The likeliest scale is tried on every block at once, in place (a load packs every
    projection, so this pass is most of a start-up); each later candidate only on the blocks
    no earlier one solved. When the likeliest one solves under half of them the matrix is not
    of this form (e.g. Q8_0 weights tried as Q4_1), and the rest are not tried: that costs
    only speed. A non-finite value makes its block's ``span`` non-finite (max and min carry
    NaN and infinity), so checking the spans checks every value.
    """
    if not bool(torch.isfinite(span).all()):
        return None
    candidates = _scale_candidates(span, levels)
    solvable = span > 0  # zero-span blocks are d = 0, q = 0 (their values all equal the offset)
    d_out = torch.where(solvable, candidates[0], 0.0)
    divisor = torch.where(solvable, candidates[0], 1.0)
    q_out = torch.empty(blocks.shape, dtype=q_dtype)
    exact = torch.empty(blocks.shape[0], dtype=torch.bool)
    rows = min(blocks.shape[0], CHUNK_BLOCKS)
    q, rebuilt = torch.empty(rows, BLOCK), torch.empty(rows, BLOCK)  # reused: no page faults per chunk
    for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
        part = slice(start, start + CHUNK_BLOCKS)
        w = blocks[part]
        n = w.shape[0]
        off, d, div = offset[part].unsqueeze(1), d_out[part].unsqueeze(1), divisor[part].unsqueeze(1)
        exact[part] = _try_scale(w, off, d, div, lowest, highest, q[:n], rebuilt[:n])
        q_out[part] = q[:n]
    todo = torch.nonzero(~exact).squeeze(1)
    if 2 * todo.numel() > blocks.shape[0]:
        return None
    for d_all in candidates[1:]:
        if todo.numel() == 0:
            break
        w, d, off = blocks[todo], d_all[todo].unsqueeze(1), offset[todo].unsqueeze(1)
        q = torch.empty_like(w)
        exact = _try_scale(w, off, d, d, lowest, highest, q, torch.empty_like(w))
        done = todo[exact]
        d_out[done] = d_all[done]
        q_out[done] = q[exact].to(q_dtype)
        todo = todo[~exact]
    return (d_out, q_out) if todo.numel() == 0 else None


def pack_q4_1(w: torch.Tensor) -> Q4_1Weight | None:
    """``w`` float32 [N, K] in Q4_1 blocks, or None unless every value is reproduced exactly.

    A Q4_1 quantizer gives the block's minimum q = 0, so m is the minimum; the maximum
    has q = 15, which bounds d to a few float16 candidates, each verified per block.
    """
    blocks = _blocks(w)
    if blocks is None or (w.shape[0] > PROBE_ROWS and pack_q4_1(w[:PROBE_ROWS]) is None):
        return None
    m = blocks.amin(1)
    solved = _solve(blocks, m, blocks.amax(1) - m, 15, 0, 15, torch.int32)
    if solved is None:
        return None
    d, q = solved
    n = w.shape[0]
    return Q4_1Weight(qs=_pack_nibbles(q.view(n, -1, BLOCK)), d=d.view(n, -1), m=m.view(n, -1))


def pack_q8_0(w: torch.Tensor) -> Q8_0Weight | None:
    """``w`` float32 [N, K] in Q8_0 blocks, or None unless every value is reproduced exactly.

    A Q8_0 quantizer maps the block's largest magnitude to q = +-127, which bounds d
    to a few float16 candidates, each verified per block.
    """
    blocks = _blocks(w)
    if blocks is None or (w.shape[0] > PROBE_ROWS and pack_q8_0(w[:PROBE_ROWS]) is None):
        return None
    largest = torch.maximum(blocks.amax(1), -blocks.amin(1))  # |w| without a copy of w
    solved = _solve(blocks, torch.zeros(blocks.shape[0]), largest, 127, -128, 127, torch.int8)
    if solved is None:
        return None
    d, q = solved
    return Q8_0Weight(qs=q.view(w.shape), d=d.view(w.shape[0], -1))


def pack_exact(w: torch.Tensor) -> BlockWeight | None:
    """The smaller exact block form of ``w`` (Q4_1 before Q8_0), or None."""
    return pack_q4_1(w) or pack_q8_0(w)
