"""Triton grouped GEMM for a mixture of experts: every expert's tokens in one launch.

Tokens are sorted by expert and each expert's run padded to a multiple of ``BLOCK_M``
(``align``), so a program's block of rows belongs to one expert: it multiplies those rows of x
by that expert's matrix. The mixture then takes two launches (gate/up, down) instead of two per
expert, and the routing weights ride on the second (the fused-MoE shape of vLLM and SGLang).
Weights are the experts' dense matrices stacked, [E, K, N] (the transposed layout the dense
projections use). The plain-torch reference with the same contract is ``reference.grouped_matmul``;
``align`` is there too (it is plain torch, and the reference set must not import Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    rows_ptr,
    experts_ptr,
    scale_ptr,
    K,
    N,
    stride_am,
    stride_be,
    stride_bk,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    expert = tl.load(experts_ptr + block)
    rows = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows >= 0
    a_rows = tl.where(valid, rows // A_ROW_DIV, 0)
    cols = n0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0
        )
        b = tl.load(
            b_ptr + expert * stride_be + ks[:, None] * stride_bk + cols[None, :],
            mask=(ks[:, None] < K) & (cols[None, :] < N),
            other=0.0,
        )
        acc += tl.dot(a, b.to(a.dtype)).to(tl.float32)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + tl.where(valid, rows, 0), mask=valid, other=0.0)[:, None]
    tl.store(
        c_ptr + tl.where(valid, rows, 0)[:, None] * stride_cm + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & (cols[None, :] < N),
    )


def grouped_matmul(
    a: torch.Tensor,  # [R / a_row_div, K]: row r of the output reads row r // a_row_div
    weights: torch.Tensor,  # [E, K, N]
    rows: torch.Tensor,  # [P] from ``align``
    block_experts: torch.Tensor,  # [P / block_m]
    out_rows: int,
    a_row_div: int = 1,
    scale: torch.Tensor | None = None,  # [out_rows]: each output row times this (routing weights)
    block_m: int = 16,
) -> torch.Tensor:
    """[out_rows, N]: output row r = a[r // a_row_div] @ weights[expert of r] (* scale[r])."""
    _, K, N = weights.shape
    out = torch.empty(out_rows, N, dtype=a.dtype, device=a.device)
    if rows.numel() == 0:
        return out
    a, weights = a.contiguous(), weights.contiguous()
    block_n = 32 if N >= 32 else 16
    grid = (block_experts.numel(), triton.cdiv(N, block_n))
    _grouped_kernel[grid](
        a,
        weights,
        out,
        rows,
        block_experts,
        scale if scale is not None else out,  # not read without a scale
        K,
        N,
        a.stride(0),
        weights.stride(0),
        weights.stride(1),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        HAS_SCALE=scale is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=32,
    )
    return out
