"""Triton rotary embedding of Q and K in one launch (rotate-half convention)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    x_ptr,
    o_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    t,
    c,
    s,
    HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < HEADS) & (j[None, :] < HALF)
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh + j[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    first = x1.to(tl.float32) * c[None, :] - x2.to(tl.float32) * s[None, :]
    second = x2.to(tl.float32) * c[None, :] + x1.to(tl.float32) * s[None, :]
    dst = o_ptr + t * stride_ot + h[:, None] * stride_oh + j[None, :]
    tl.store(dst, first.to(x1.dtype), mask=mask)
    tl.store(dst + HALF, second.to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_table,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    position = tl.load(positions_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + position * stride_table + j, mask=j < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + position * stride_table + j, mask=j < HALF, other=0.0).to(tl.float32)
    _rotate(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, c, s, HEADS, BLOCK_H, HALF, BLOCK_HALF)
    _rotate(
        k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, c, s, KV_HEADS, BLOCK_KVH, HALF, BLOCK_HALF
    )


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``kernels.reference.rotary`` (partial rotary included)."""
    if q.stride(2) != 1 or k.stride(2) != 1 or cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("q, k and the tables must be contiguous in their last dimension")
    partial = cos.shape[1] < q.shape[2]  # the rest of each head passes as it is
    q_out, k_out = (q.clone(), k.clone()) if partial else (torch.empty_like(q), torch.empty_like(k))
    half = cos.shape[1] // 2
    _rotary_kernel[(q.shape[0],)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos.stride(0),
        HEADS=q.shape[1],
        KV_HEADS=k.shape[1],
        BLOCK_H=triton.next_power_of_2(q.shape[1]),
        BLOCK_KVH=triton.next_power_of_2(k.shape[1]),
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return q_out, k_out
