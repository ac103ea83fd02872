"""The math every backend shares: decoder-layer weights, projections and RMSNorm.

A projection is dense and transposed, [in, out], or exact GGUF blocks, [out, in]
(``kernels/block_weights.py``); ``project`` runs either, so the model and each
backend's layer loop never ask which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import attrs
import torch
import torch.nn.functional as F

from trillm.kernels import cpu_matmul
from trillm.kernels.block_weights import BlockWeight, pack_exact

# A projection: dense and transposed, [in, out], or exact GGUF blocks, [out, in].
Weight: TypeAlias = torch.Tensor | BlockWeight
# Sums a row-parallel projection's partial outputs over the ranks, in place.
Reduce: TypeAlias = Callable[[torch.Tensor], torch.Tensor]
# An RMSNorm over the last dimension: (x, weight, eps) -> normed x of x's shape.
Norm: TypeAlias = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@attrs.define
class LayerWeights:
    """One decoder layer."""

    input_norm: torch.Tensor
    qkv: Weight  # hidden -> (H + 2 KVH) * D
    qkv_bias: torch.Tensor | None
    o_proj: Weight
    post_norm: torch.Tensor
    gate_up: Weight  # hidden -> 2 * intermediate
    down: Weight
    # Qwen3: RMSNorm of each Q and K head ([head_dim] weights) after the projection, before RoPE.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> contiguous [in, out]: on CPUs ``x @ w_t`` beats ``F.linear(x, w)``
    for small batches (measured 1.2-2x on the decode shapes of SmolLM2)."""
    return weight.t().contiguous()


def make_weight(weight: torch.Tensor, blocks: bool) -> Weight:
    """``weight`` [out, in] in exact blocks when asked and possible, else transposed.

    Blocks hold the same values in 6 (Q4_1) or 9 (Q8_0) bits instead of 32 (float32
    scales included), so a decode step, which reads every weight once, moves 3.5-5.3x
    fewer bytes.
    """
    packed = pack_exact(weight) if blocks else None
    return packed if packed is not None else transposed(weight)


def project(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W (+ bias)`` for either form of ``W``."""
    if isinstance(w, torch.Tensor):
        return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)
    out = cpu_matmul.matmul(x, w)
    return out if bias is None else out.add_(bias)


def project_add(h: torch.Tensor, x: torch.Tensor, w: Weight, reduce: Reduce | None = None) -> torch.Tensor:
    """``h + x @ W``: the residual add rides on the GEMM (in place into ``h`` for blocks).

    ``reduce``: ``W`` is row-parallel (``parallel/``): ``x @ W`` is this rank's partial sum,
    reduced over the ranks before the residual is added (once, not once per rank)."""
    if reduce is not None:
        return h.add_(reduce(project(x, w)))
    if isinstance(w, torch.Tensor):
        return torch.addmm(h, x, w)
    return cpu_matmul.matmul(x, w, out=h, accumulate=True)


def qk_norm_(qk: torch.Tensor, num_heads: int, layer: LayerWeights, eps: float, norm: Norm) -> None:
    """Qwen3's per-head RMSNorm, in place, of ``qk`` [T, heads + kv_heads, head_dim] (Q heads
    first), a view into the fused QKV output: rotary then runs on it as on any model's."""
    if layer.q_norm is None or layer.k_norm is None:
        return
    qk[:, :num_heads] = norm(qk[:, :num_heads], layer.q_norm, eps)
    qk[:, num_heads:] = norm(qk[:, num_heads:], layer.k_norm, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 like the reference implementation, then cast back."""
    if x.dtype == torch.float32:  # one fused op, the same arithmetic
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
