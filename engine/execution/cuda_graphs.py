"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode step of a small model on a GPU is mostly kernel launches: ~10 per layer,
each costing the CPU a few microseconds. A captured graph replays all of them in one
call. Graphs fix every shape and address, so a step copies its inputs into static
buffers sized for the largest batch, pads the batch up to the next captured size,
and reads the logits of its own rows. Padding rows write no KV (slot -1) and attend
one token of page 0, so they cannot disturb real rows; their logits are dropped.

``capture`` is a parameter so the same bookkeeping runs on the CPU in tests, where
"capturing" keeps the function and "replaying" calls it again on the same buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from trillm.engine.execution.backends import KernelMetadata, KVCache
from trillm.engine.execution.model import DecoderModel
from trillm.engine.step import StepMetadata

log = logging.getLogger("trillm.engine")

# (function) -> replay, which reruns the function's work on the same buffers and
# returns its output tensor.
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every 8 up to ``max_batch`` (and it)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def cuda_capture(pool: Any) -> Capture:
    """Capture into one memory pool shared by all sizes (their steps never overlap).

    ``pool`` is ``torch.cuda.graph_pool_handle()`` (its type is private to torch)."""

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles and autotunes outside the graph
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def eager_capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The CPU stand-in: replay runs the function again on the static buffers."""
    return fn


class DecodeGraphs:
    """Static input buffers and one replayable decode step per bucket size."""

    def __init__(
        self, model: DecoderModel, kv_cache: KVCache, max_batch: int, max_pages_per_seq: int, capture: Capture
    ) -> None:
        if not model.backend.supports_cuda_graphs:
            raise ValueError(
                f"decode graphs need the kernel forward (kernels triton or reference), not {model.backend.name}"
            )
        device = model.device
        self.model = model
        self.max_batch = max_batch
        self.max_pages = max_pages_per_seq
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(max_batch, max_pages_per_seq, dtype=torch.int32, device=device)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        starts = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        rows = torch.arange(max_batch, dtype=torch.long, device=device)
        self.buckets = batch_buckets(max_batch)
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        for size in reversed(self.buckets):  # largest first: smaller ones reuse its pool memory
            meta = KernelMetadata(self.slots[:size], self.tables[:size], starts[: size + 1], self.lens[:size], True)

            def step(size: int = size, meta: KernelMetadata = meta) -> torch.Tensor:
                with torch.inference_mode():
                    return model.forward(self.input_ids[:size], self.positions[:size], kv_cache, meta, rows[:size])

            self.replays[size] = capture(step)

    def fits(self, input_ids: torch.Tensor, meta: StepMetadata, logits_rows: torch.Tensor) -> bool:
        """A decode step of at most ``max_batch`` rows, each sampled, within the table width."""
        n = input_ids.shape[0]
        return (
            isinstance(meta, KernelMetadata)
            and meta.decode_only
            and 0 < n <= self.max_batch
            and logits_rows.shape[0] == n
            and meta.block_tables.shape[1] <= self.max_pages
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """Logits [n, vocab] of a decode step that ``fits``; inputs may be on the CPU."""
        assert isinstance(meta, KernelMetadata)
        n = input_ids.shape[0]
        size = next(b for b in self.buckets if b >= n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.lens[:n].copy_(meta.context_lens, non_blocking=True)
        if size > n:  # rows left by a larger batch before: make them padding again
            self.slots[n:size].fill_(-1)
            self.tables[n:size].zero_()
            self.lens[n:size].fill_(1)
        return self.replays[size]()[:n]
