"""Triton top-k / top-p / min-p sampling with per-row parameters, no sort.

Each row is one program. Thresholds are found by bisection over the row's
values (each probe is one pass counting, or summing, what lies above it) and
then snapped to the smallest value actually present above the bound, so ties
are kept together exactly as in the sort-based reference. The draw inverts
the CDF of the kept probabilities in vocabulary order with the row's uniform.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BISECTION_STEPS = 32  # halvings of the row's value range: below float32 spacing for logits


@triton.jit
def _count_at_least(base, vocab, t, bound, BLOCK: tl.constexpr):
    count = tl.zeros([BLOCK], tl.int32)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")) / t
        count += (x >= bound).to(tl.int32)
    return tl.sum(count, axis=0)


@triton.jit
def _mass_at_least(base, vocab, t, top, bound, BLOCK: tl.constexpr):
    mass = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")) / t
        mass += tl.where(x >= bound, tl.exp(x - top), 0.0)
    return tl.sum(mass, axis=0)


@triton.jit
def _smallest_at_least(base, vocab, t, bound, BLOCK: tl.constexpr):
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")) / t
        low = tl.minimum(low, tl.where(x >= bound, x, float("inf")))
    return tl.min(low, axis=0)


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    uniform_ptr,
    out_ptr,
    vocab,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row * stride_row
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature <= 0
    t = tl.where(greedy, 1.0, temperature)

    # The maximum (first index on ties, for greedy rows) and the minimum.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    lowest = tl.full([BLOCK], float("inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        mask = idx < vocab
        x = tl.load(base + idx, mask=mask, other=float("-inf")) / t
        better = x > best
        best_idx = tl.where(better, idx, best_idx)
        best = tl.where(better, x, best)
        lowest = tl.minimum(lowest, tl.where(mask & (x > float("-inf")), x, float("inf")))
    top = tl.max(best, axis=0)
    argmax = tl.min(tl.where(best == top, best_idx, vocab), axis=0)
    bottom = tl.min(lowest, axis=0)  # the least finite value: banned tokens (-inf) never count

    # top-k: the largest value v with count(x >= v) >= k.
    k = tl.load(top_k_ptr + row)
    k = tl.where((k > 0) & (k < vocab), k, vocab)
    lo = bottom
    hi = top
    for _ in range(STEPS):
        mid = (lo + hi) * 0.5
        enough = _count_at_least(base, vocab, t, mid, BLOCK) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    k_bound = _smallest_at_least(base, vocab, t, lo, BLOCK)
    k_bound = tl.where(_count_at_least(base, vocab, t, top, BLOCK) >= k, top, k_bound)

    # top-p within the top-k set: the largest value whose mass reaches top_p of it.
    top_p = tl.load(top_p_ptr + row)
    goal = top_p * _mass_at_least(base, vocab, t, top, k_bound, BLOCK)
    lo = k_bound
    hi = top
    for _ in range(STEPS):
        mid = (lo + hi) * 0.5
        enough = _mass_at_least(base, vocab, t, top, mid, BLOCK) >= goal
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    p_bound = _smallest_at_least(base, vocab, t, lo, BLOCK)
    p_bound = tl.where(_mass_at_least(base, vocab, t, top, top, BLOCK) >= goal, top, p_bound)
    bound = tl.where(top_p < 1.0, tl.maximum(k_bound, p_bound), k_bound)
    min_p = tl.load(min_p_ptr + row)
    bound = tl.where(min_p > 0, tl.maximum(bound, top + tl.log(tl.where(min_p > 0, min_p, 1.0))), bound)

    # Inverse CDF over the kept tokens, in vocabulary order.
    target = tl.load(uniform_ptr + row) * _mass_at_least(base, vocab, t, top, bound, BLOCK)
    running = 0.0
    chosen = vocab
    last_kept = 0
    for v0 in range(0, vocab, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")) / t
        e = tl.where(x >= bound, tl.exp(x - top), 0.0)
        crossed = ((tl.cumsum(e, axis=0) + running) > target) & (e > 0)
        chosen = tl.minimum(chosen, tl.min(tl.where(crossed, idx, vocab), axis=0))
        last_kept = tl.maximum(last_kept, tl.max(tl.where(e > 0, idx, 0), axis=0))
        running += tl.sum(e, axis=0)
    chosen = tl.where(chosen < vocab, chosen, last_kept)
    tl.store(out_ptr + row, tl.where(greedy, argmax, chosen).to(tl.int64))


def sample_top_k_top_p(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """Same contract as ``kernels.reference.sample_top_k_top_p``."""
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("logits must be float32 with contiguous rows")
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    _sample_kernel[(logits.shape[0],)](
        logits,
        logits.stride(0),
        temperature,
        top_k,
        top_p,
        min_p,
        uniform,
        out,
        logits.shape[1],
        BLOCK=1024,
        STEPS=BISECTION_STEPS,
    )
    return out
