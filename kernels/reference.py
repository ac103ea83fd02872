"""Plain-torch references for every kernel in ``kernels/``.

Each function has exactly the signature of its Triton twin, so tests compare
the two on the same inputs and the engine can swap one for the other. They are
written for clarity, not speed; the CPU fast path lives in ``engine/execution/backends/cpu.py``.

Shapes: the KV cache of one layer is ``[num_pages, page_size, kv_heads, head_dim]``;
token ``p`` of a sequence lives in slot ``table[p // page_size] * page_size + p % page_size``.
"""

from __future__ import annotations

import torch


def store_kv(
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_pages, page_size, KVH, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int; -1 skips the row (padding)
) -> None:
    """Write each row's K/V into its slot of the paged cache, in place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def _context(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, KVH, D]: the first ``length`` tokens of one sequence, in order."""
    page_size = cache.shape[1]
    pages = table[: -(-length // page_size)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [n, H, D] at ``q_positions`` over k/v [L, KVH, D]; causal, GQA; float32 math; with
    ``window`` > 0 each query sees only its last ``window`` positions (itself included); ``sinks``
    [H]: a logit per head in the softmax's denominator, its value zero; ``softcap`` > 0: each
    score s is softcap * tanh(s / softcap) (Gemma 2)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), kf) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    keys = torch.arange(k.shape[0]).unsqueeze(0)
    hidden = keys > q_positions.unsqueeze(1)  # [n, L]: the future
    if window > 0:
        hidden |= keys <= q_positions.unsqueeze(1) - window  # before the sliding window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lhd->nhd", weights, vf).to(q.dtype)


def decode_attention(
    q: torch.Tensor,  # [B, H, D], one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_pages] int
    context_lens: torch.Tensor,  # [B] int, tokens in the cache including the new one
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Each row attends all ``context_lens[b]`` tokens of its own sequence; with ``window`` > 0
    only the last ``window`` of them (a sliding-window layer); ``sinks`` [H]: gpt-oss's logits
    in each softmax's denominator."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k, v = _context(k_cache, block_tables[b], n), _context(v_cache, block_tables[b], n)
        out[b] = _attend(q[b : b + 1], k, v, torch.tensor([n - 1]), scale, window, sinks, softcap)[0]
    return out


def extend_attention(
    q: torch.Tensor,  # [T, H, D], the new tokens of all sequences, back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_pages] int
    query_starts: torch.Tensor,  # [S + 1] int, row offsets of each sequence's new tokens in q
    context_lens: torch.Tensor,  # [S] int, tokens in the cache including the new ones
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's cached prefix plus themselves
    (their K/V already stored). Row ``i`` of a sequence with ``n`` new tokens sits at
    position ``context_len - n + i``; with ``window`` > 0 it sees its last ``window`` positions."""
    out = torch.empty_like(q)
    for s in range(block_tables.shape[0]):
        start, end, length = int(query_starts[s]), int(query_starts[s + 1]), int(context_lens[s])
        if end == start:
            continue
        k, v = _context(k_cache, block_tables[s], length), _context(v_cache, block_tables[s], length)
        positions = torch.arange(length - (end - start), length)
        out[start:end] = _attend(q[start:end], k, v, positions, scale, window, sinks, softcap)
    return out


def add_rms_norm(
    x: torch.Tensor,  # [T, hidden]
    residual: torch.Tensor | None,  # [T, hidden] or None for the first layer
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual): new_residual = x + residual; normed as Llama's RMSNorm
    (float32 statistics, cast back, then times the weight)."""
    summed = x if residual is None else x + residual
    xf = summed.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, summed


def rotary(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    positions: torch.Tensor,  # [T] int
    cos: torch.Tensor,  # [max_len, D], rotate-half layout (both halves equal)
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, rotate-half convention (as Llama in transformers); tables [max_len, R] with
    R < D rotate the first R values of each head and pass the rest (partial rotary)."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    rotary = cos.shape[-1]

    def turn(x: torch.Tensor) -> torch.Tensor:
        part, rest = x[..., :rotary], x[..., rotary:]
        half = rotary // 2
        rotated = torch.cat([-part[..., half:], part[..., :half]], dim=-1)
        turned = (part.float() * c.float() + rotated.float() * s.float()).to(x.dtype)
        return torch.cat([turned, rest], dim=-1) if rest.shape[-1] else turned

    return turn(q), turn(k)


def sample_top_k_top_p(
    logits: torch.Tensor,  # [B, V] float32
    temperature: torch.Tensor,  # [B] float32; 0 means greedy
    top_k: torch.Tensor,  # [B] int; <= 0 means off
    top_p: torch.Tensor,  # [B] float32 in (0, 1]
    min_p: torch.Tensor,  # [B] float32 in [0, 1]
    uniform: torch.Tensor,  # [B] float32 in [0, 1), one draw per row
) -> torch.Tensor:
    """One token per row. Tokens are kept by thresholds, so ties are kept together:
    top-k keeps p >= the k-th largest p; top-p then keeps the largest threshold whose
    mass within the top-k set reaches ``top_p``; min-p keeps p >= min_p * max p.
    The draw inverts the CDF of the kept probabilities in vocabulary order:
    the first token whose running mass exceeds ``uniform * kept mass``."""
    out = torch.empty(logits.shape[0], dtype=torch.long)
    vocab = logits.shape[1]
    for b in range(logits.shape[0]):
        x = logits[b].float()
        if temperature[b] <= 0:
            out[b] = int(torch.argmax(x))
            continue
        x = x / temperature[b]
        ordered = x.sort(descending=True).values
        k = int(top_k[b])
        threshold = ordered[min(k, vocab) - 1] if k > 0 else ordered[-1]
        e = torch.exp(x - ordered[0])
        mass_k = e[x >= threshold].sum()
        ranked = torch.exp(ordered - ordered[0])
        ranked_mass = ranked.cumsum(0)  # mass of the top r + 1 tokens
        reaching = (ranked_mass >= top_p[b] * mass_k) & (ordered >= threshold)
        if top_p[b] < 1 and bool(reaching.any()):
            threshold = torch.maximum(threshold, ordered[int(reaching.nonzero()[0])])
        if min_p[b] > 0:
            threshold = torch.maximum(threshold, ordered[0] + torch.log(min_p[b]))
        kept = torch.where(x >= threshold, e, torch.zeros_like(e))
        cdf = kept.cumsum(0)
        target = uniform[b] * cdf[-1]
        above = (cdf > target).nonzero()
        out[b] = int(above[0]) if above.numel() else int((kept > 0).nonzero()[-1])
    return out


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [P], block_experts [P / block_m]): the flat (token, slot) indices of ``experts`` [T, k]
    sorted by expert, each expert's run padded with -1 to a multiple of ``block_m``; and the expert
    of each block of ``block_m`` rows (-1: a block of padding only)."""
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    rows = torch.full((int(padded.sum()),), -1, dtype=torch.long, device=experts.device)
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in ``order``
    rank = torch.arange(flat.numel(), device=experts.device) - first[flat[order]]
    rows[starts[flat[order]] + rank] = order
    block_experts = torch.repeat_interleave(torch.arange(num_experts, device=experts.device), padded // block_m)
    return rows, block_experts


def grouped_matmul(
    a: torch.Tensor,
    weights: torch.Tensor,
    rows: torch.Tensor,
    block_experts: torch.Tensor,
    out_rows: int,
    a_row_div: int = 1,
    scale: torch.Tensor | None = None,
    block_m: int = 16,
) -> torch.Tensor:
    """[out_rows, N]: output row r = a[r // a_row_div] @ weights[expert of r] (* scale[r]); ``rows``
    and ``block_experts`` from ``align`` (a mixture's experts in one call; ``kernels/moe.py``)."""
    out = torch.empty(out_rows, weights.shape[2], dtype=a.dtype, device=a.device)
    for b, expert in enumerate(block_experts.tolist()):
        r = rows[b * block_m : (b + 1) * block_m]
        r = r[r >= 0]
        if r.numel():
            y = (a[r // a_row_div].float() @ weights[expert].float()).to(a.dtype)
            out[r] = y if scale is None else (y.float() * scale[r, None].float()).to(a.dtype)
    return out
