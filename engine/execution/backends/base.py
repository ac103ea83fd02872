"""The one model-execution interface: a ``Backend`` prepares a batch and runs the layers.

The model (``model.py``) holds the weights, the embedding and the LM head; how the
decoder layers run over the paged KV cache, and which metadata they need for that,
belongs to a backend: the CPU fast path (``cpu.py``) or a set of kernels, Triton or
the torch references (``kernel.py``). The runner asks the backend to prepare a step
and the model to run it, and asks the backend what it supports; it never branches on
which backend it holds. After mini-sglang's ``python/minisgl/attention/base.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import attrs
import torch

from trillm.engine.execution.layers import LayerWeights, project
from trillm.engine.execution.rope import RotaryTable
from trillm.engine.execution.sampler import SamplingKernel
from trillm.engine.execution.shape import ModelShape
from trillm.engine.step import (
    Batch,
    PoolSpan,
    PromptSpan,
    SampleRow,
    ScheduledChunk,
    ScheduledSequence,
    StepInputs,
    StepMetadata,
)

# One (K, V) pair per layer, each [num_pages, page_size, kv_heads, head_dim].
KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class Collectives(Protocol):
    """The tensor-parallel group a model's layers sum their partial outputs over (``parallel.group``)."""

    @property
    def size(self) -> int: ...

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...


class ModelWeights(Protocol):
    """What a backend reads of the model whose layers it runs (``model.DecoderModel`` offers it):
    the backends never see the model class, so the model may hold any backend."""

    @property
    def shape(self) -> ModelShape: ...  # this rank's own (``parallel.sharding.local_shape``)

    @property
    def layers(self) -> list[LayerWeights]: ...

    @property
    def final_norm(self) -> torch.Tensor: ...

    @property
    def rope(self) -> RotaryTable: ...  # the rotary rows, made as positions are reached (on the CPU)

    @property
    def local_rope(self) -> RotaryTable: ...  # of windowed layers with their own rope base (Gemma 3), else rope

    @property
    def cos(self) -> torch.Tensor: ...  # the whole rotary tables, [max_len, rotated dims]

    @property
    def sin(self) -> torch.Tensor: ...

    @property
    def local_cos(self) -> torch.Tensor: ...  # of windowed layers with their own rope base (Gemma 3), else cos

    @property
    def local_sin(self) -> torch.Tensor: ...

    @property
    def scale(self) -> float: ...  # of the attention scores

    @property
    def tp(self) -> Collectives: ...


@attrs.define
class PromptRows:
    """Collects the prompt-logprob rows of a step while a backend prepares it."""

    rows: list[int] = attrs.field(factory=list)  # input rows, in order
    spans: list[PromptSpan] = attrs.field(factory=list)

    def add(self, index: int, chunk: ScheduledChunk[ScheduledSequence], row: int) -> None:
        """Chunk ``index`` of the batch starts at input ``row``: if its request asks for prompt
        logprobs, every position of the chunk that precedes a prompt token gets a row."""
        seq = chunk.seq
        top = seq.params.prompt_logprobs
        stop = min(chunk.end, len(seq.prompt_ids) - 1)  # the last prompt position predicts the first output
        if top is None or chunk.start >= stop:
            return
        targets = tuple(seq.prompt_ids[chunk.start + 1 : stop + 1])
        self.spans.append(PromptSpan(index, chunk.start, targets, top, len(self.rows)))
        self.rows += range(row, row + stop - chunk.start)


@attrs.define
class PoolRows:
    """Collects the rows embedding requests pool while a backend prepares a step."""

    rows: list[int] = attrs.field(factory=list)  # input rows, in order
    spans: list[PoolSpan] = attrs.field(factory=list)

    def add(self, index: int, chunk: ScheduledChunk[ScheduledSequence], row: int) -> None:
        """Chunk ``index`` of the batch starts at input ``row``: the prompt rows its request pools."""
        seq = chunk.seq
        mode, prompt = seq.params.pooling, len(seq.prompt_ids)
        if mode is None:
            return
        first, stop = chunk.start, min(chunk.end, prompt)
        if mode == "cls":
            stop = min(stop, 1)
        elif mode == "last":
            first = max(first, prompt - 1)
        if first >= stop:
            return
        self.spans.append(PoolSpan(index, len(self.rows), stop - first))
        self.rows += range(row + first - chunk.start, row + stop - chunk.start)


@attrs.define
class StepRows:
    """What every backend collects alike while preparing a step: the input ids, the rows to
    sample, the inputs still in flight (overlap), and the prompt-logprob rows. Each backend
    adds its own positions and attention metadata."""

    ids: list[int] = attrs.field(factory=list)
    logits_rows: list[int] = attrs.field(factory=list)
    rows: list[SampleRow] = attrs.field(factory=list)
    pending_inputs: list[tuple[int, int]] = attrs.field(factory=list)
    pending_history: list[tuple[int, int]] = attrs.field(factory=list)
    prompt: PromptRows = attrs.field(factory=PromptRows)
    pool: PoolRows = attrs.field(factory=PoolRows)
    drafts: list[tuple[int, ...]] = attrs.field(factory=list)  # per sampling chunk

    def add(self, index: int, chunk: ScheduledChunk[ScheduledSequence]) -> int:
        """Chunk ``index`` of the batch, appended; returns the input row it starts at. A
        verification chunk samples at each of its positions, each row with the proposals
        before it in its history."""
        row, seq = len(self.ids), chunk.seq
        self.prompt.add(index, chunk, row)
        self.pool.add(index, chunk, row)
        note_pending(seq, chunk, row, len(self.rows), self.pending_inputs, self.pending_history)
        self.ids += chunk.token_ids()
        if chunk.samples:
            draft = chunk.draft
            first = len(self.ids) - len(draft) - 1
            for j in range(len(draft) + 1):
                self.logits_rows.append(first + j)
                self.rows.append(sample_row(seq, draft[:j]))
            self.drafts.append(draft)
        return row

    def inputs(self, positions: torch.Tensor, meta: StepMetadata) -> StepInputs:
        return StepInputs(
            input_ids=torch.tensor(self.ids, dtype=torch.long),
            positions=positions,
            meta=meta,
            logits_rows=torch.tensor(self.logits_rows + self.prompt.rows, dtype=torch.long),
            rows=tuple(self.rows),
            pending_inputs=tuple(self.pending_inputs),
            pending_history=tuple(self.pending_history),
            prompt_spans=tuple(self.prompt.spans),
            drafts=tuple(self.drafts) if any(self.drafts) else (),
            hidden_rows=torch.tensor(self.pool.rows, dtype=torch.long) if self.pool.rows else None,
            pool_spans=tuple(self.pool.spans),
        )


class Backend(ABC):
    """How the decoder layers of a model run on one device, in one dtype.

    Made by the registry (``backends/__init__.py``) from the ``--kernels`` setting and
    held by the model, which needs it before loading: it decides whether block weights
    can be used at all.
    """

    name: str  # the ``--kernels`` value that selects it
    # Decode steps may be replayed from captured graphs (static shapes, no host sync).
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    @property
    def supports_block_weights(self) -> bool:
        """Whether projections may stay in GGUF blocks (``kernels/block_weights.py``)."""
        return False

    @property
    def sampling_kernel(self) -> SamplingKernel | None:
        """The top-k/top-p/min-p draw on the logits' device; None: the sampler's torch code."""
        return None

    @abstractmethod
    def prepare(self, batch: Batch[ScheduledSequence], page_size: int) -> StepInputs:
        """Tensors for ``batch`` in this backend's metadata (runs on the event loop)."""

    @abstractmethod
    def run_layers(
        self,
        model: ModelWeights,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: Any,
        logits_rows: torch.Tensor,
        bound: Any = None,
    ) -> torch.Tensor:
        """Every decoder layer on the embedded batch ``h`` [T, hidden], storing this step's
        K/V; returns the final-normed hidden states of ``logits_rows`` [S, hidden]."""

    def head(self, h: torch.Tensor, lm_head: Any, kernel_rows: int | None = None) -> torch.Tensor:
        """``h @ lm_head``: the logits' projection (a backend may run it in another precision);
        ``kernel_rows``: ``kernel_rows(meta)`` of the step, where the backend picks kernels by rows."""
        return project(h, lm_head)

    def kernel_rows(self, meta: Any) -> int | None:
        """The rows by which a step's kernels are picked, where not its own (a CPU verification
        step's sequences: ``cpu_attention.DecodeRows``); None: its own."""
        return None

    def bind(self, model: ModelWeights, kv_cache: KVCache) -> Any:
        """Per-cache state ``run_layers`` may reuse as ``bound`` (made once by the runner that
        owns ``kv_cache``); None where the backend needs none."""
        return None


def slots(table: list[int], start: int, end: int, page_size: int) -> Iterator[int]:
    """The cache slots of positions [start, end) of a sequence whose pages are ``table``, a
    page's run at a time."""
    first = start
    while first < end:
        page, offset = divmod(first, page_size)
        last = min(end, (page + 1) * page_size)
        base = table[page] * page_size
        yield from range(base + offset, base + offset + last - first)
        first = last


def padded_tables(tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Page tables as one [rows, longest] tensor, short rows padded with page 0
    (never read: every reader stops at the row's context length)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype)


def pending_offset(seq: ScheduledSequence, start: int, end: int) -> int | None:
    """Where in tokens ``start:end`` of ``seq`` the token in flight sits, if there."""
    position = len(seq.prompt_ids) + seq.num_known_outputs
    if position < seq.num_tokens and start <= position < end:
        return position - start
    return None


def note_pending(
    seq: ScheduledSequence,
    chunk: ScheduledChunk[ScheduledSequence],
    row: int,
    sample_row: int,
    inputs: list[tuple[int, int]],
    history: list[tuple[int, int]],
) -> None:
    """Record where ``chunk`` (at input ``row``) reads the token the step in flight samples."""
    if seq.num_known_outputs == len(seq.output_ids):
        return  # nothing in flight: the common case, and every case without overlap
    offset = pending_offset(seq, chunk.start, chunk.end)
    if offset is not None:
        inputs.append((row + offset, seq.pending_sample))
    if chunk.samples and seq.params.needs_history:
        history.append((sample_row, seq.pending_sample))


def sample_row(seq: ScheduledSequence, proposed: tuple[int, ...] = ()) -> SampleRow:
    """What the sampler needs of ``seq``, copied now: the scheduler may change it mid-step.
    ``proposed``: the proposals before this row's position, part of its history (the scheduler
    proposes only past ``min_tokens``, so the bans are unchanged; a grammar's rows are masked in
    turn by the verification)."""
    p = seq.params
    return SampleRow(
        p,
        seq.generator,
        seq.prompt_ids if p.repetition_penalty != 1.0 else (),
        (*seq.output_ids, *proposed) if p.needs_history else (),
        seq.banned_ids,
        seq.matcher,
        seq.thinking,
    )
