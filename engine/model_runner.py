"""The model runner: owns the weights and the KV cache tensors, runs one step.

``prepare`` turns a scheduled batch into tensors on the event loop (a snapshot,
so an abort that frees pages mid-step cannot race the worker thread);
``execute`` runs the forward pass and the sampler and is meant for a worker
thread. Grad mode is per thread, so ``execute`` enters inference mode itself.
"""

from __future__ import annotations

import time

import attrs
import torch

from engine.attention import AttentionMetadata, PrefillSpan
from engine.llama import LlamaModel
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Batch


@attrs.frozen
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    params: tuple[SamplingParams, ...]


def kv_bytes_per_token(model: LlamaModel) -> int:
    s = model.shape
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.finfo(model.dtype).bits // 8


def choose_dtype() -> torch.dtype:
    """bfloat16 when this CPU multiplies it faster than float32, else float32."""
    if torch.cuda.is_available():
        return torch.bfloat16
    x32, w32 = torch.randn(32, 576), torch.randn(1536, 576)

    def best(dtype: torch.dtype) -> float:
        x, w = x32.to(dtype), w32.to(dtype)
        times = []
        for _ in range(8):
            t = time.perf_counter()
            for _ in range(10):
                torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - t)
        return min(times[2:])

    return torch.bfloat16 if best(torch.bfloat16) < best(torch.float32) else torch.float32


class ModelRunner:
    def __init__(self, model: LlamaModel, num_pages: int, page_size: int) -> None:
        self.model = model
        self.page_size = page_size
        s = model.shape
        num_slots = num_pages * page_size
        self.kv_cache = [
            (
                torch.zeros(num_slots, s.num_kv_heads, s.head_dim, dtype=model.dtype),
                torch.zeros(num_slots, s.num_kv_heads, s.head_dim, dtype=model.dtype),
            )
            for _ in range(s.num_layers)
        ]

    def _slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(pages, dtype=torch.long)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def prepare(self, batch: Batch) -> StepInputs:
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        decode_rows: list[int] = []
        decode_ctx: list[torch.Tensor] = []
        prefills: list[PrefillSpan] = []
        logits_rows: list[int] = []
        params: list[SamplingParams] = []
        row = 0
        for chunk in batch.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.length
            end = start + n
            ids += seq.token_ids(start, end)
            positions.append(torch.arange(start, end))
            context = self._slots(seq.pages, 0, end)
            slot_mapping.append(context[start:])
            if n == 1:
                decode_rows.append(row)
                decode_ctx.append(context)
            else:
                mask = None
                if start > 0:  # causal within the chunk, everything cached before it
                    mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
                prefills.append(PrefillSpan(row, row + n, context, mask))
            row += n
            if chunk.samples:
                logits_rows.append(row - 1)
                params.append(seq.params)
        longest = max((len(c) for c in decode_ctx), default=0)
        decode_slots = torch.zeros(len(decode_ctx), longest, dtype=torch.long)
        decode_mask = torch.zeros(len(decode_ctx), 1, 1, longest, dtype=torch.bool)
        for i, ctx in enumerate(decode_ctx):
            decode_slots[i, : len(ctx)] = ctx
            decode_mask[i, 0, 0, : len(ctx)] = True
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_mapping),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=tuple(prefills),
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.cat(positions),
            meta=meta,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long),
            params=tuple(params),
        )

    def execute(self, inputs: StepInputs) -> list[int]:
        """Forward + sample; one token per sampling chunk, in batch order."""
        with torch.inference_mode():
            logits = self.model.forward(
                inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, inputs.logits_rows
            )
            if not inputs.params:
                return []
            return sample(logits, list(inputs.params))
