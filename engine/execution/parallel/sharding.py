"""Which part of every layer a tensor-parallel rank holds, and the checkpoint weights cut to it.

Attention splits by whole GQA groups (a KV head and the query heads that read it), so every
rank's attention is an ordinary smaller attention: Q/K/V are column-parallel (each rank
projects its heads), O is row-parallel (each rank multiplies its heads' columns; an
all-reduce sums the partial outputs). The MLP splits the same way: gate/up by columns,
down by rows; in a mixture of experts, every expert's MLP so (each rank runs every expert on
its slice; the router is whole on every rank). The embedding and the LM head split by vocabulary rows.

Groups need not divide evenly: SmolLM2-135M has 3 KV heads, so at ``--tp 2`` rank 0 holds
two groups (6 query heads) and rank 1 one (3), where vLLM refuses. With fewer KV heads
than ranks, each KV head is replicated on ``size / kv_heads`` ranks that split its query
heads, as vLLM does. Splits of the intermediate size fall on multiples of 32, so weights
that are exact GGUF blocks stay blocks on every rank.
"""

from __future__ import annotations

import attrs
import torch

from trillm.engine.execution.shape import ModelShape

BLOCK = 32  # GGUF block width: row-parallel splits of the input dimension fall on its multiples


def even_ranges(n: int, parts: int, align: int = 1) -> list[range]:
    """``range(n)`` cut into ``parts`` contiguous pieces as even as ``align``-sized units allow
    (the first pieces one unit longer; units of one where ``n`` has too few); the last piece
    ends at ``n`` whatever ``align`` is."""
    if -(-n // align) < parts:
        align = 1
    units = -(-n // align)
    if units < parts:
        raise ValueError(f"{n} cannot be split over {parts} ranks")
    bounds = [min(n, align * (i * (units // parts) + min(i, units % parts))) for i in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@attrs.frozen
class Partition:
    """What rank ``rank`` of ``size`` holds, in global indices."""

    rank: int
    size: int
    heads: range  # query heads
    kv_heads: range
    intermediate: range  # MLP columns
    vocab: range  # rows of the embedding and of the LM head
    expert_intermediate: range = range(0)  # each expert's MLP columns (a mixture of experts)
    shared_intermediate: range = range(0)  # the shared expert's columns (Qwen2-MoE)


def partition(shape: ModelShape, size: int, rank: int) -> Partition:
    """Rank ``rank``'s part of a model of ``shape``; ValueError where heads cannot be split."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    heads, kv = shape.num_heads, shape.num_kv_heads
    if heads % kv:
        raise ValueError(f"{heads} query heads do not form groups over {kv} KV heads")
    group = heads // kv
    if kv >= size:
        kv_range = even_ranges(kv, size)[rank]
        head_range = range(kv_range.start * group, kv_range.stop * group)
    else:
        if size % kv or group % (size // kv):
            raise ValueError(
                f"--tp {size} cannot split {kv} KV heads with {group} query heads each: "
                f"the ranks must divide by the KV heads and each KV head's query heads by the ranks that share it"
            )
        sharing = size // kv
        kv_head, part = divmod(rank, sharing)
        kv_range = range(kv_head, kv_head + 1)
        start = kv_head * group + part * (group // sharing)
        head_range = range(start, start + group // sharing)
    return Partition(
        rank=rank,
        size=size,
        heads=head_range,
        kv_heads=kv_range,
        intermediate=even_ranges(shape.intermediate_size, size, BLOCK)[rank],
        vocab=even_ranges(shape.vocab_size, size)[rank],
        expert_intermediate=(
            even_ranges(shape.expert_intermediate_size, size, BLOCK)[rank] if shape.num_experts else range(0)
        ),
        shared_intermediate=(
            even_ranges(shape.shared_expert_intermediate_size, size, BLOCK)[rank]
            if shape.shared_expert_intermediate_size
            else range(0)
        ),
    )


def local_shape(shape: ModelShape, part: Partition) -> ModelShape:
    """The shape one rank's layers compute with (the vocabulary stays whole: logits are gathered)."""
    return attrs.evolve(
        shape,
        num_heads=len(part.heads),
        num_kv_heads=len(part.kv_heads),
        intermediate_size=len(part.intermediate),
        expert_intermediate_size=len(part.expert_intermediate),
        shared_expert_intermediate_size=len(part.shared_intermediate),
    )


def _rows(t: torch.Tensor, r: range, per: int = 1) -> torch.Tensor:
    return t[r.start * per : r.stop * per].clone()


def _cols(t: torch.Tensor, r: range, per: int = 1) -> torch.Tensor:
    return t[:, r.start * per : r.stop * per].clone()


def shard_weights(weights: dict[str, torch.Tensor], shape: ModelShape, part: Partition) -> dict[str, torch.Tensor]:
    """Checkpoint-named weights cut to ``part`` (copies: the whole ones may be freed). Norms are
    whole on every rank; a tied LM head is the embedding's shard."""
    if part.size == 1:
        return weights
    d = shape.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        kind = name.rsplit(".", 1)[-1]  # weight or bias
        inter = (
            part.expert_intermediate
            if ".experts." in name
            else part.shared_intermediate
            if ".shared_expert." in name
            else part.intermediate
        )
        if leaf == "q_proj":
            out[name] = _rows(w, part.heads, d)
        elif leaf in ("k_proj", "v_proj"):
            out[name] = _rows(w, part.kv_heads, d)
        elif leaf == "o_proj":
            out[name] = _cols(w, part.heads, d) if kind == "weight" else w
        elif leaf in ("gate_proj", "up_proj"):
            out[name] = _rows(w, inter)
        elif leaf == "down_proj":
            out[name] = _cols(w, inter) if kind == "weight" else w
        elif name.endswith(".self_attn.sinks"):  # gpt-oss: one per query head
            out[name] = _rows(w, part.heads)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _rows(w, part.vocab)
        else:
            out[name] = w
    return out
