"""A set of kernels (``kernels/``: Triton, or the plain-torch references) as a backend.

Every hot spot of a layer goes through the set: the residual add fused into each
RMSNorm, K/V stored by slot, attention read straight from the pages by a split-K
decode kernel or an extend kernel. The metadata is flat and fixed in form (one
block-table row per sequence), so decode steps can be captured as CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from trillm.engine.execution.backends.base import (
    Backend,
    KVCache,
    ModelWeights,
    StepRows,
    padded_tables,
    slots,
)
from trillm.engine.execution.experts import moe_mlp
from trillm.engine.execution.layers import gated_activation, project
from trillm.engine.execution.sampler import SamplingKernel
from trillm.engine.step import Batch, ScheduledSequence, StepInputs
from trillm.kernels import Kernels


@attrs.frozen
class KernelMetadata:
    """The flat form the kernels in ``kernels/`` take: one row of the block table per
    sequence, its new tokens at ``query_starts[i]:query_starts[i + 1]`` of the batch."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_pages] int32, padded with page 0
    query_starts: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor  # [S] int32, cached plus new tokens
    decode_only: bool  # every sequence adds one token: the split-K decode kernel applies

    def to(self, device: torch.device) -> KernelMetadata:
        if device.type == "cpu":
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return KernelMetadata(
            move(self.slot_mapping),
            move(self.block_tables),
            move(self.query_starts),
            move(self.context_lens),
            self.decode_only,
        )


class KernelBackend(Backend):
    """The layers through one ``Kernels`` set; its name is the set's (triton, reference)."""

    supports_cuda_graphs = True

    def __init__(self, device: torch.device, dtype: torch.dtype, kernels: Kernels) -> None:
        super().__init__(device, dtype)
        self.kernels = kernels
        self.name = kernels.name

    @property
    def sampling_kernel(self) -> SamplingKernel:
        return self.kernels.sample_top_k_top_p

    def prepare(self, batch: Batch[ScheduledSequence], page_size: int) -> StepInputs:
        """The kernels' form: a padded block table, query offsets and context lengths."""
        ps = page_size
        step = StepRows()
        positions: list[int] = []
        slot_mapping: list[int] = []
        tables: list[list[int]] = []
        starts = [0]
        lens: list[int] = []
        for index, chunk in enumerate(batch.chunks):
            start, end = chunk.start, chunk.end
            table = chunk.seq.pages[: -(-end // ps)]
            step.add(index, chunk)
            positions += range(start, end)
            slot_mapping += slots(table, start, end, ps)
            # a verification chunk: one query of one token per position, each its own context
            query = 1 if chunk.draft else chunk.length
            for context in range(start + query, end + 1, query):
                tables.append(table)
                starts.append(starts[-1] + query)
                lens.append(context)
        meta = KernelMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
            block_tables=padded_tables(tables, torch.int32),
            query_starts=torch.tensor(starts, dtype=torch.int32),
            context_lens=torch.tensor(lens, dtype=torch.int32),
            decode_only=all(chunk.decode_rows for chunk in batch.chunks),
        )
        return step.inputs(torch.tensor(positions, dtype=torch.long), meta)

    def run_layers(
        self,
        model: ModelWeights,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: KernelMetadata,
        logits_rows: torch.Tensor,
        bound: Any = None,
    ) -> torch.Tensor:
        """The residual stream is carried apart from each layer's output (``delta``) so
        every add rides on the next RMSNorm kernel."""
        ops, s = self.kernels, model.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        delta, residual = h, None

        def act(gate_up: torch.Tensor) -> torch.Tensor:
            return gated_activation(gate_up, s.activation, s.swiglu_alpha, s.swiglu_limit)

        for i, (layer, (k_cache, v_cache)) in enumerate(zip(model.layers, kv_cache)):
            x, residual = ops.add_rms_norm(delta, residual, layer.input_norm, s.rms_norm_eps)
            qkv = project(x, layer.qkv, layer.qkv_bias)
            q = qkv[:, :q_size].view(-1, s.num_heads, s.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(-1, s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size :].view(-1, s.num_kv_heads, s.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:  # Qwen3, Gemma 3: each head normed
                q = self._head_norm(q, layer.q_norm, s.rms_norm_eps)
                k = self._head_norm(k, layer.k_norm, s.rms_norm_eps)
            local = s.local_rope(i)
            q, k = ops.rotary(
                q, k, positions, model.local_cos if local else model.cos, model.local_sin if local else model.sin
            )
            ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            window, sinks, cap = s.window(i), layer.sinks, s.attn_logit_softcap or 0.0
            if meta.decode_only:
                attn = ops.decode_attention(
                    q, k_cache, v_cache, meta.block_tables, meta.context_lens, model.scale, window, sinks, cap
                )
            else:
                attn = ops.extend_attention(
                    q,
                    k_cache,
                    v_cache,
                    meta.block_tables,
                    meta.query_starts,
                    meta.context_lens,
                    model.scale,
                    window,
                    sinks,
                    cap,
                )
            delta = model.tp.all_reduce(project(attn.reshape(-1, q_size), layer.o_proj))
            if layer.o_bias is not None:  # gpt-oss: once, after the all-reduce
                delta = delta + layer.o_bias
            if layer.attn_out_norm is not None:  # Gemma: the block's output normed before the residual add
                delta = self._norm(delta, layer.attn_out_norm, s.rms_norm_eps)
            x, residual = ops.add_rms_norm(delta, residual, layer.post_norm, s.rms_norm_eps)

            if layer.moe is not None:
                delta = moe_mlp(x, layer.moe, act, model.tp.all_reduce, ops.grouped_matmul)
            else:
                assert layer.gate_up is not None and layer.down is not None
                delta = model.tp.all_reduce(project(act(project(x, layer.gate_up)), layer.down))
            if layer.mlp_out_norm is not None:
                delta = self._norm(delta, layer.mlp_out_norm, s.rms_norm_eps)
        assert residual is not None, "a model has at least one layer"
        rows = logits_rows.to(delta.device)
        h, _ = ops.add_rms_norm(
            delta.index_select(0, rows), residual.index_select(0, rows), model.final_norm, s.rms_norm_eps
        )
        return h

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each head of ``x`` [T, heads, D] through the set's norm kernel (no residual)."""
        return self._norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the rows of ``x`` through the set's norm kernel, no residual."""
        return self.kernels.add_rms_norm(x, None, weight, eps)[0]
