"""The one model-execution interface: a ``Backend`` prepares a batch and runs the layers.

The model (``llama.py``) holds the weights, the embedding and the LM head; how the
decoder layers run over the paged KV cache, and which metadata they need for that,
belongs to a backend: the CPU fast path (``cpu.py``) or a set of kernels, Triton or
the torch references (``kernel.py``). The runner asks the backend to prepare a step
and the model to run it, and asks the backend what it supports; it never branches on
which backend it holds. After mini-sglang's ``python/minisgl/attention/base.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

import attrs
import torch

from trillm.engine.execution.sampler import SampleRow, SamplingKernel
from trillm.engine.scheduling.scheduler import Batch, ScheduledChunk
from trillm.engine.scheduling.sequence import Sequence

if TYPE_CHECKING:
    from trillm.engine.execution.llama import LlamaModel

# One (K, V) pair per layer, each [num_pages, page_size, kv_heads, head_dim].
KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class StepMetadata(Protocol):
    """What every backend's metadata offers the runner; the rest is the backend's own."""

    @property
    def slot_mapping(self) -> torch.Tensor:
        """[T]: where each new token's K/V is written."""

    def to(self, device: torch.device) -> Self: ...


@attrs.frozen
class PromptSpan:
    """Logits rows whose log-softmax a request asked for (``SamplingParams.prompt_logprobs``):
    the rows of positions ``start``, ``start + 1``, ... of chunk ``chunk`` of the batch, each
    scoring the prompt token after it (``targets``). They follow the sampling rows in
    ``logits_rows``, from ``offset`` on."""

    chunk: int  # index in ``batch.chunks``
    start: int  # position of the first row; it scores prompt token ``start + 1``
    targets: tuple[int, ...]
    top: int  # alternatives per token
    offset: int  # first row among the prompt rows (after the sampling rows)


@attrs.define
class PromptRows:
    """Collects the prompt-logprob rows of a step while a backend prepares it."""

    rows: list[int] = attrs.field(factory=list)  # input rows, in order
    spans: list[PromptSpan] = attrs.field(factory=list)

    def add(self, index: int, chunk: ScheduledChunk, row: int) -> None:
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


@attrs.frozen
class StepInputs:
    """One prepared step: a snapshot of the batch, so the scheduler may change it meanwhile."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: StepMetadata  # the preparing backend's own type
    logits_rows: torch.Tensor
    rows: tuple[SampleRow, ...]
    # (input row, sample of the previous step) for each PENDING input token, and
    # (sample row, sample of the previous step) for each PENDING token in a row's history
    pending_inputs: tuple[tuple[int, int], ...] = ()
    pending_history: tuple[tuple[int, int], ...] = ()
    # rows of ``logits_rows`` after the sampling rows whose log-softmax a request asked for
    prompt_spans: tuple[PromptSpan, ...] = ()


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

    def add(self, index: int, chunk: ScheduledChunk) -> int:
        """Chunk ``index`` of the batch, appended; returns the input row it starts at."""
        row, seq = len(self.ids), chunk.seq
        self.prompt.add(index, chunk, row)
        note_pending(seq, chunk, row, len(self.rows), self.pending_inputs, self.pending_history)
        self.ids += seq.token_ids(chunk.start, chunk.end)
        if chunk.samples:
            self.logits_rows.append(len(self.ids) - 1)
            self.rows.append(sample_row(seq))
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
    def prepare(self, batch: Batch, page_size: int) -> StepInputs:
        """Tensors for ``batch`` in this backend's metadata (runs on the event loop)."""

    @abstractmethod
    def run_layers(
        self,
        model: LlamaModel,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: Any,
        logits_rows: torch.Tensor,
        bound: Any = None,
    ) -> torch.Tensor:
        """Every decoder layer on the embedded batch ``h`` [T, hidden], storing this step's
        K/V; returns the final-normed hidden states of ``logits_rows`` [S, hidden]."""

    def bind(self, model: LlamaModel, kv_cache: KVCache) -> Any:
        """Per-cache state ``run_layers`` may reuse as ``bound`` (made once by the runner that
        owns ``kv_cache``); None where the backend needs none."""
        return None


def padded_tables(tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Page tables as one [rows, longest] tensor, short rows padded with page 0
    (never read: every reader stops at the row's context length)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype)


def pending_offset(seq: Sequence, start: int, end: int) -> int | None:
    """Where in tokens ``start:end`` of ``seq`` the token in flight sits, if there."""
    position = len(seq.prompt_ids) + seq.num_known_outputs
    if position < seq.num_tokens and start <= position < end:
        return position - start
    return None


def note_pending(
    seq: Sequence,
    chunk: ScheduledChunk,
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


def sample_row(seq: Sequence) -> SampleRow:
    """What the sampler needs of ``seq``, copied now: the scheduler may change it mid-step."""
    p = seq.params
    return SampleRow(
        p,
        seq.generator,
        seq.prompt_ids if p.repetition_penalty != 1.0 else (),
        tuple(seq.output_ids) if p.needs_history else (),
        seq.banned_ids,
        seq.matcher,
    )
