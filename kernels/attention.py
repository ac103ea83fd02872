"""Triton attention over the paged KV cache: split-K decode and causal extend.

Both read K/V straight from the pages through the block table (no gather).
Decode splits each context into ``NUM_SPLITS`` parts so that a few long
sequences still fill the GPU, then merges the parts by their log-sum-exp; the
split count is fixed, so a CUDA graph can capture the launch. References with
the same signatures are in ``kernels/reference.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_SPLITS = 8


@triton.jit
def _attend_block(
    q,
    m,
    total,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    pos,
    n_mask,
    allowed,
    kvh,
    d,
    d_mask,
    scale,
    softcap,
    stride_cp,
    stride_cs,
    stride_ch,
    PAGE_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Fold one block of keys, read from the pages, into an online softmax's running
    (max, sum, weighted V); ``allowed`` masks scores. Rows that see no key yet keep 0."""
    page = tl.load(table_ptr + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    rows = page * stride_cp + (pos % PAGE_SIZE) * stride_cs + kvh * stride_ch
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k).to(q.dtype)).to(tl.float32) * scale
    if SOFTCAP:  # Gemma 2: softcap * tanh(s / softcap), tanh(y) = 2 sigmoid(2 y) - 1
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    total = total * alpha + tl.sum(p, axis=1)
    return m_new, total, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    softcap,
    window,
    stride_qb,
    stride_qh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_tb,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + b)
    first = tl.maximum(length - window, 0)  # a sliding window's first key (window: a huge number if none)
    split_len = tl.cdiv(tl.cdiv(length - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, length)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        m, total, acc = _attend_block(
            q,
            m,
            total,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            tables_ptr + b * stride_tb,
            pos,
            n_mask,
            n_mask[None, :],
            kvh,
            d,
            d_mask,
            scale,
            softcap,
            stride_cp,
            stride_cs,
            stride_ch,
            PAGE_SIZE,
            SOFTCAP,
        )
    has = total > 0
    out = acc / tl.where(has, total, 1.0)[:, None]
    lse = tl.where(has, m + tl.log(tl.where(has, total, 1.0)), float("-inf"))
    part = (b * NUM_HEADS + heads) * NUM_SPLITS + split  # [G] rows of [B, H, S]
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    sinks_ptr,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    part = (b * NUM_HEADS + h) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + part)
    top = tl.max(lse, axis=0)
    if HAS_SINKS:  # gpt-oss: the head's sink logit joins the denominator, its value zero
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        top = tl.maximum(top, sink)
    weight = tl.exp(lse - top)
    denominator = tl.sum(weight, axis=0)
    if HAS_SINKS:
        denominator += tl.exp(sink - top)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=d[None, :] < HEAD_DIM, other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / denominator
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _window(window: int) -> int:
    """The kernels' form of a sliding window: none (0) is wider than any context."""
    return window if window > 0 else 1 << 30


def _dims(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int]:
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != k_cache.contiguous().stride():
        raise ValueError("q rows and the KV cache must be contiguous in head_dim; the cache fully contiguous")
    return heads, kv_heads, max(16, triton.next_power_of_2(head_dim))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.decode_attention``."""
    batch = q.shape[0]
    heads, kv_heads, block_d = _dims(q, k_cache)
    group = heads // kv_heads
    part_out = torch.empty(batch, heads, NUM_SPLITS, q.shape[2], dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, heads, NUM_SPLITS, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, kv_heads, NUM_SPLITS)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        part_out,
        part_lse,
        scale,
        float(softcap),
        _window(window),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        PAGE_SIZE=k_cache.shape[1],
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=q.shape[2],
        BLOCK_D=block_d,
        BLOCK_N=32,
        NUM_SPLITS=NUM_SPLITS,
        NUM_HEADS=heads,
        SOFTCAP=softcap > 0,
    )
    out = torch.empty_like(q)
    _decode_merge_kernel[(batch, heads)](
        part_out,
        part_lse,
        out,
        sinks if sinks is not None else part_lse,  # not read without sinks
        out.stride(0),
        out.stride(1),
        HEAD_DIM=q.shape[2],
        BLOCK_D=block_d,
        NUM_SPLITS=NUM_SPLITS,
        NUM_HEADS=heads,
        HAS_SINKS=sinks is not None,
    )
    return out


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    starts_ptr,
    lens_ptr,
    out_ptr,
    sinks_ptr,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_tb,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    block = tl.program_id(2)
    q_start = tl.load(starts_ptr + seq)
    new = tl.load(starts_ptr + seq + 1) - q_start
    length = tl.load(lens_ptr + seq)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < new
    q_pos = length - new + rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    kvh = h // GROUP
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last = tl.minimum(length, length - new + (block + 1) * BLOCK_M)  # keys past the block's last row are future
    # Keys before the block's first row's sliding window are seen by no row (window: a huge number if none).
    lo = tl.maximum(length - new + block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(lo, last, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < length
        m, total, acc = _attend_block(
            q,
            m,
            total,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            tables_ptr + seq * stride_tb,
            pos,
            n_mask,
            n_mask[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window),
            kvh,
            d,
            d_mask,
            scale,
            softcap,
            stride_cp,
            stride_cs,
            stride_ch,
            PAGE_SIZE,
            SOFTCAP,
        )
    if HAS_SINKS:  # gpt-oss: the head's sink logit joins each row's denominator, its value zero
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        acc = acc * alpha[:, None]
        total = total * alpha + tl.exp(sink - m_new)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    max_new_tokens: int | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.extend_attention``; ``max_new_tokens``
    (the most new rows of any sequence) saves a device-to-host read when known."""
    heads, kv_heads, block_d = _dims(q, k_cache)
    if max_new_tokens is None:
        max_new_tokens = int((query_starts[1:] - query_starts[:-1]).max()) if block_tables.shape[0] else 0
    out = torch.empty_like(q)
    if max_new_tokens == 0:
        return out
    block_m = 16
    _extend_kernel[(block_tables.shape[0], heads, triton.cdiv(max_new_tokens, block_m))](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_starts,
        context_lens,
        out,
        sinks if sinks is not None else out,  # not read without sinks
        scale,
        float(softcap),
        _window(window),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        PAGE_SIZE=k_cache.shape[1],
        GROUP=heads // kv_heads,
        HEAD_DIM=q.shape[2],
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=32,
        HAS_SINKS=sinks is not None,
        SOFTCAP=softcap > 0,
    )
    return out
