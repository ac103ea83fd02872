"""Triton store of this step's K/V into the paged cache by slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_cs,
    stride_ch,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = (offs < WIDTH) & ((offs * 0 + slot) >= 0)  # slot -1: a padding row, stored nowhere
    head, d = offs // HEAD_DIM, offs % HEAD_DIM
    dest = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs + head * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as ``kernels.reference.store_kv``."""
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("K/V rows and the cache must be contiguous in head_dim")
    kv_heads, head_dim = k.shape[1], k.shape[2]
    width = kv_heads * head_dim
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        WIDTH=width,
        BLOCK=triton.next_power_of_2(width),
    )
