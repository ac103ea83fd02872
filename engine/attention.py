"""Attention over the paged KV cache, in plain torch (the CPU path).

The cache is one flat array of slots per layer: slot = page * page_size + offset.
Decode rows are attended together with a padded slot table and a mask; prefill
chunks (several new tokens of one sequence) are attended one sequence at a time
with a causal mask shifted by what is already cached.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F


@attrs.frozen
class PrefillSpan:
    """One sequence's chunk: rows [start, end) of the batch, attending ``context_slots``."""

    start: int
    end: int
    context_slots: torch.Tensor  # [context_len] slots, the chunk's own at the tail
    causal_mask: torch.Tensor | None  # [n, context_len] bool; None: plain causal


@attrs.frozen
class AttentionMetadata:
    """How the rows of one flattened batch map onto the paged cache."""

    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    decode_rows: torch.Tensor  # [Bd] batch rows that are single-token decodes
    decode_slots: torch.Tensor  # [Bd, Lmax] context slots per decode row (padded)
    decode_mask: torch.Tensor  # [Bd, 1, 1, Lmax] True where a slot is real
    prefills: tuple[PrefillSpan, ...]


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store this step's K/V in the cache, then attend every row to its context."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    num_heads, kv_heads = q.shape[1], k.shape[1]
    gqa = num_heads != kv_heads
    out = torch.empty_like(q)

    if meta.decode_rows.numel():
        qd = q.index_select(0, meta.decode_rows).unsqueeze(2)  # [Bd, H, 1, D]
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [Bd, KVH, L, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )
        out.index_copy_(0, meta.decode_rows, od.squeeze(2))

    for span in meta.prefills:
        qp = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kp = k_cache[span.context_slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, C, D]
        vp = v_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp,
            kp,
            vp,
            attn_mask=span.causal_mask,
            is_causal=span.causal_mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[span.start : span.end] = op.squeeze(0).transpose(0, 1)
    return out
