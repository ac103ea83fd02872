"""A mixture of experts' MLP (Mixtral, Qwen3-MoE, gpt-oss): the router, and each token's chosen experts.

The router's softmax (float32) picks ``top_k`` experts per token, their weights renormalised where
the family does. A batch runs one pass per expert that any token chose, over its tokens gathered
together (tokens sorted by expert), each output weighed and added into its token's row. A single
token (a decode step of one sequence, the common case on a CPU) runs its experts straight; where
they are a GGUF file's blocks of one type (every expert's rows in one tensor of the file), the
gate and up projections of all of them are one C call and the down projections another
(``cpu_gguf.matmul_grouped``): 2 calls a layer instead of 3 per expert, one quantization of x,
one thread start.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trillm.engine.execution.layers import MoEWeights, Weight, project
from trillm.kernels import cpu_gguf
from trillm.kernels.gguf_blocks import GGUFWeight
from trillm.kernels.reference import align
from trillm.kernels.stacked import Stacked

BLOCK_M = 16  # rows of a grouped launch's program: each expert's pairs padded to a multiple
# The gated activation: [T, 2 I] (gate, then up) -> [T, I]
Activation = Callable[[torch.Tensor], torch.Tensor]


def route(x: torch.Tensor, moe: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in x's dtype, experts [T, top_k]): each token's chosen experts."""
    logits = torch.mm(x, moe.router)
    if moe.router_bias is not None:
        logits = logits + moe.router_bias
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(moe.top_k, dim=-1)
    if moe.normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(x.dtype), experts


def moe_mlp(
    x: torch.Tensor,
    moe: MoEWeights,
    act: Activation,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    grouped: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """The mixture's output for ``x`` [T, hidden] (with Qwen2-MoE's shared expert, gated, added).
    ``reduce``: the experts are this rank's slices
    (``--tp``): their partial sums are all-reduced, and the down projections' biases (gpt-oss)
    added once, after. ``grouped``: a kernel set's grouped matmul (``kernels/moe.py``): dense
    experts then take two launches for the whole batch."""
    weights, experts = route(x, moe)
    if grouped is not None and moe.gate_up_stack is not None and moe.down_stack is not None:
        out = _grouped_launches(x, moe, act, weights, experts, grouped)
    elif x.shape[0] == 1:
        out = _one_token(x, moe, act, weights[0], experts[0].tolist())
    else:
        out = _sorted_by_expert(x, moe, act, weights, experts)
    if moe.shared_gate_up is not None and moe.shared_down is not None and moe.shared_gate is not None:
        gate = torch.sigmoid(torch.mm(x, moe.shared_gate))  # [T, 1]: whole on every rank
        out = out.add_(project(act(project(x, moe.shared_gate_up)), moe.shared_down).mul_(gate))
    if reduce is not None:
        out = reduce(out)
    if moe.down_bias is not None:
        out = out + (weights.unsqueeze(-1) * moe.down_bias[experts]).sum(1)
    return out


def _grouped_launches(
    x: torch.Tensor,
    moe: MoEWeights,
    act: Activation,
    weights: torch.Tensor,
    experts: torch.Tensor,
    grouped: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """Every (token, expert) pair's gate/up in one launch, its down (weighed) in another, over the
    pairs sorted by expert and padded per expert to the kernel's block of rows."""
    assert moe.gate_up_stack is not None and moe.down_stack is not None
    tokens, k = experts.shape
    rows, blocks = align(experts, moe.gate_up_stack.shape[0], BLOCK_M)
    gate_up = grouped(x, moe.gate_up_stack, rows, blocks, tokens * k, a_row_div=k, block_m=BLOCK_M)
    if moe.gate_up_bias is not None:
        gate_up = gate_up + moe.gate_up_bias[experts.flatten()]
    hidden = act(gate_up)
    scale = weights.flatten().contiguous()
    out = grouped(hidden, moe.down_stack, rows, blocks, tokens * k, scale=scale, block_m=BLOCK_M)
    return out.view(tokens, k, -1).sum(1)


def _gate_up(x: torch.Tensor, moe: MoEWeights, expert: int) -> torch.Tensor:
    bias = moe.gate_up_bias[expert] if moe.gate_up_bias is not None else None
    return project(x, moe.gate_up[expert], bias)


def _sorted_by_expert(
    x: torch.Tensor, moe: MoEWeights, act: Activation, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """One pass per expert any token chose, over its tokens gathered together."""
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=len(moe.gate_up)).tolist()
    tokens, weighed = order // moe.top_k, weights.flatten()[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start : start + n]
        y = project(act(_gate_up(x.index_select(0, rows), moe, expert)), moe.down[expert])
        out.index_add_(0, rows, y.mul_(weighed[start : start + n, None]))
        start += n
    return out


def _one_token(
    x: torch.Tensor, moe: MoEWeights, act: Activation, weights: torch.Tensor, chosen: list[int]
) -> torch.Tensor:
    """One token's experts, straight (no sorting); grouped into two C calls where they allow it."""
    grouped = _grouped(x, moe, act, chosen)
    if grouped is not None:
        return (weights.unsqueeze(1) * grouped).sum(0, keepdim=True)
    out = torch.zeros_like(x)
    for weight, expert in zip(weights.tolist(), chosen):
        out.add_(project(act(_gate_up(x, moe, expert)), moe.down[expert]), alpha=weight)
    return out


def blocks_groupable(gate_up: list[Weight], down: list[Weight]) -> bool:
    """Whether a mixture's experts run as ``cpu_gguf.matmul_grouped`` calls: every gate/up two GGUF
    block matrices, and all gates, ups and downs of one type (asked once, at load)."""
    if not all(isinstance(w, Stacked) and len(w.parts) == 2 for w in gate_up):
        return False
    halves = [p for w in gate_up for p in w.parts]  # type: ignore[union-attr]
    return _groupable(halves) and _groupable(down)


def _halves(moe: MoEWeights, chosen: list[int]) -> list[GGUFWeight]:
    gate_ups = [moe.gate_up[e] for e in chosen]
    return [w.parts[0] for w in gate_ups] + [w.parts[1] for w in gate_ups]  # type: ignore[union-attr]


def _grouped(x: torch.Tensor, moe: MoEWeights, act: Activation, chosen: list[int]) -> torch.Tensor | None:
    """[k, hidden]: the chosen experts' outputs through ``cpu_gguf.matmul_grouped``, or None where
    their weights are not GGUF blocks of one type (``MoEWeights.grouped_blocks``)."""
    if not moe.grouped_blocks:
        return None
    halves, downs = _halves(moe, chosen), [moe.down[e] for e in chosen]
    k = len(chosen)
    gate_up = cpu_gguf.matmul_grouped(x, halves, per_group_x=False)  # [1, 2 k I]: the gates, then the ups
    inter = gate_up.shape[1] // (2 * k)
    rows = gate_up.view(2, k, inter).transpose(0, 1).reshape(k, 2 * inter)  # each expert's (gate, up)
    if moe.gate_up_bias is not None:
        rows = rows + moe.gate_up_bias[chosen]
    hidden = act(rows).view(1, k * inter)
    return cpu_gguf.matmul_grouped(hidden, downs, per_group_x=True).view(k, -1)  # type: ignore[arg-type]


def _groupable(weights: list) -> bool:
    return cpu_gguf.available() and all(isinstance(w, GGUFWeight) for w in weights) and cpu_gguf.groupable(weights, 1)
