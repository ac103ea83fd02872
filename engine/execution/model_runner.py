"""The model runner: owns the weights and the KV cache tensors, runs one step.

``prepare`` turns a scheduled batch into tensors on the event loop (a snapshot,
so an abort that frees pages mid-step cannot race the worker thread);
``execute`` runs the forward pass and the sampler and is meant for a worker
thread. Grad mode is per thread, so ``execute`` enters inference mode itself.

A batch may be prepared while the step before it runs, before that step's
tokens are known: those inputs are ``PENDING`` in the snapshot, and ``execute``
fills them in from the tokens it sampled last (steps run one at a time, in order).
"""

from __future__ import annotations

import logging
import time

import attrs
import torch

from trillm.engine.execution.attention import AttentionMetadata, DecodeGroup, DecodeRows, KernelMetadata, PrefillSpan
from trillm.engine.execution.cuda_graphs import Capture, DecodeGraphs, cuda_capture, eager_capture
from trillm.engine.execution.llama import LlamaModel
from trillm.engine.execution.sampler import SampleRow, Sampled, sample_with_logprobs
from trillm.engine.scheduling.scheduler import Batch, ScheduledChunk
from trillm.engine.scheduling.sequence import PENDING, Sequence
from trillm.kernels import cpu_decode, cpu_forward

log = logging.getLogger("trillm.engine")


@attrs.frozen
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata | KernelMetadata
    logits_rows: torch.Tensor
    rows: tuple[SampleRow, ...]
    # (input row, sample of the previous step) for each PENDING input token, and
    # (sample row, sample of the previous step) for each PENDING token in a row's history
    pending_inputs: tuple[tuple[int, int], ...] = ()
    pending_history: tuple[tuple[int, int], ...] = ()


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


def padded_tables(tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Page tables as one [rows, longest] tensor, short rows padded with page 0
    (never read: every reader stops at the row's context length)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype)


def _pending_offset(seq: Sequence, start: int, end: int) -> int | None:
    """Where in tokens ``start:end`` of ``seq`` the token in flight sits, if there."""
    position = len(seq.prompt_ids) + seq.num_known_outputs
    if position < seq.num_tokens and start <= position < end:
        return position - start
    return None


def _fill_pending(inputs: StepInputs, previous: list[int] | None) -> tuple[SampleRow, ...]:
    """Put the previous step's samples in place of the ``PENDING`` inputs; returns the
    sample rows with their histories filled in too. Without them (that step failed,
    and so did its sequences) the inputs get token 0: those rows are thrown away."""
    take = (lambda sample: previous[sample]) if previous is not None else (lambda sample: 0)
    for row, sample in inputs.pending_inputs:
        inputs.input_ids[row] = take(sample)
    rows = list(inputs.rows)
    for i, sample in inputs.pending_history:
        history = tuple(take(sample) if t == PENDING else t for t in rows[i].output_ids)
        rows[i] = attrs.evolve(rows[i], output_ids=history)
    return tuple(rows)


def _sample_row(seq: Sequence) -> SampleRow:
    """What the sampler needs of ``seq``, copied now: the scheduler may change it mid-step."""
    p = seq.params
    return SampleRow(
        p,
        seq.generator,
        seq.prompt_ids if p.repetition_penalty != 1.0 else (),
        tuple(seq.output_ids) if p.needs_history else (),
        seq.banned_ids,
    )


class ModelRunner:
    def __init__(self, model: LlamaModel, num_pages: int, page_size: int, num_threads: int | None = None,
                 use_c_decode: bool = True, graph_batch: int = 0, max_model_len: int = 0) -> None:
        """``graph_batch`` > 0 replays decode steps of up to that many rows from
        captured graphs (kernel forward only; CUDA graphs on a GPU, eager replay of the
        same static buffers elsewhere, for tests)."""
        self.model = model
        self.num_threads = num_threads or torch.get_num_threads()
        self.page_size = page_size
        s = model.shape
        shape = (num_pages, page_size, s.num_kv_heads, s.head_dim)
        zeros = lambda: torch.zeros(shape, dtype=model.dtype, device=model.device)  # noqa: E731
        self.kv_cache = [(zeros(), zeros()) for _ in range(s.num_layers)]
        # The C decode kernel (float32, CPU); without a compiler, gather + SDPA.
        self.c_decode = (
            model.cpu_float32(model.kernels, model.dtype, model.device) and use_c_decode and cpu_decode.available()
        )
        self._last_sampled: list[int] | None = None  # the tokens of the step that ran last
        self._decode_layers: cpu_forward.DecodeLayers | None = None  # the C layer loop, made on first use
        self.graphs: DecodeGraphs | None = None
        if graph_batch > 0:
            self.graphs = self._capture(graph_batch, -(-(max_model_len or s.max_position_embeddings) // page_size))

    def _capture(self, max_batch: int, max_pages: int) -> DecodeGraphs | None:
        """Decode graphs, or None (logged) where capture fails: eager steps still work."""
        capture: Capture = eager_capture
        if self.model.device.type == "cuda":
            capture = cuda_capture(torch.cuda.graph_pool_handle())
        started = time.perf_counter()
        try:
            graphs = DecodeGraphs(self.model, self.kv_cache, max_batch, max_pages, capture)
        except Exception:
            if self.model.device.type != "cuda":
                raise
            log.exception("capturing decode graphs failed; decode steps run eagerly")
            return None
        log.info("decode graphs for batch sizes %s captured in %.1f s", graphs.buckets, time.perf_counter() - started)
        return graphs

    def prepare(self, batch: Batch) -> StepInputs:
        if self.model.kernels is not None:
            return self._prepare_flat(batch)
        ps = self.page_size
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        logits_rows: list[int] = []
        rows: list[SampleRow] = []
        pending_inputs: list[tuple[int, int]] = []
        pending_history: list[tuple[int, int]] = []
        row = 0
        for chunk in batch.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.length
            end = start + n
            ids += seq.token_ids(start, end)
            self._note_pending(seq, chunk, row, len(rows), pending_inputs, pending_history)
            pos = torch.arange(start, end)
            positions.append(pos)
            table = seq.pages[: -(-end // ps)]
            slot_mapping.append(torch.tensor(table)[pos // ps] * ps + pos % ps)
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                mask = None
                if start > 0:  # causal within the chunk, everything cached before it
                    mask = torch.arange(end).unsqueeze(0) <= pos.unsqueeze(1)
                prefills.append(PrefillSpan(row, row + n, torch.tensor(table), end, mask))
            row += n
            if chunk.samples:
                logits_rows.append(row - 1)
                rows.append(_sample_row(seq))
        if self.c_decode and decode_rows:
            meta = AttentionMetadata(
                slot_mapping=torch.cat(slot_mapping),
                decodes=(),
                prefills=tuple(prefills),
                decode_rows=DecodeRows(
                    None if len(decode_rows) == len(ids) else torch.tensor(decode_rows, dtype=torch.long),
                    padded_tables(decode_tables, torch.int32),
                    torch.tensor(decode_lens, dtype=torch.int32),
                ),
            )
        else:
            meta = AttentionMetadata(
                slot_mapping=torch.cat(slot_mapping),
                decodes=self._decode_groups(decode_rows, decode_tables, decode_lens),
                prefills=tuple(prefills),
            )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.cat(positions),
            meta=meta,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long),
            rows=tuple(rows),
            pending_inputs=tuple(pending_inputs),
            pending_history=tuple(pending_history),
        )

    @staticmethod
    def _note_pending(seq: Sequence, chunk: ScheduledChunk, row: int, sample_row: int,
                      inputs: list[tuple[int, int]], history: list[tuple[int, int]]) -> None:
        """Record where ``chunk`` (at input ``row``) reads the token the step in flight samples."""
        if seq.num_known_outputs == len(seq.output_ids):
            return  # nothing in flight: the common case, and every case without overlap
        offset = _pending_offset(seq, chunk.start, chunk.end)
        if offset is not None:
            inputs.append((row + offset, seq.pending_sample))
        if chunk.samples and seq.params.needs_history:
            history.append((sample_row, seq.pending_sample))

    def _prepare_flat(self, batch: Batch) -> StepInputs:
        """The kernels' form: a padded block table, query offsets and context lengths."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        starts = [0]
        lens: list[int] = []
        logits_rows: list[int] = []
        rows: list[SampleRow] = []
        pending_inputs: list[tuple[int, int]] = []
        pending_history: list[tuple[int, int]] = []
        for chunk in batch.chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.length
            table = seq.pages[: -(-end // ps)]
            self._note_pending(seq, chunk, len(ids), len(rows), pending_inputs, pending_history)
            ids += seq.token_ids(start, end)
            positions += range(start, end)
            slots += (table[p // ps] * ps + p % ps for p in range(start, end))
            tables.append(table)
            starts.append(starts[-1] + chunk.length)
            lens.append(end)
            if chunk.samples:
                logits_rows.append(starts[-1] - 1)
                rows.append(_sample_row(seq))
        meta = KernelMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=padded_tables(tables, torch.int32),
            query_starts=torch.tensor(starts, dtype=torch.int32),
            context_lens=torch.tensor(lens, dtype=torch.int32),
            decode_only=all(chunk.length == 1 for chunk in batch.chunks),
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            meta=meta,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long),
            rows=tuple(rows),
            pending_inputs=tuple(pending_inputs),
            pending_history=tuple(pending_history),
        )

    def _decode_groups(self, rows: list[int], tables: list[list[int]], lens: list[int]) -> tuple[DecodeGroup, ...]:
        """Rows sorted by context length, cut where padding would more than double a
        group's work: a 4,000-token context decoding beside 16 short ones made every
        row attend 4,000 padded slots (1.36 s per step instead of 0.08 s, measured)."""
        ps = self.page_size
        order = sorted(range(len(rows)), key=lambda i: lens[i])
        groups: list[list[int]] = []
        for i in order:
            if groups and lens[i] <= 2 * lens[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        out = []
        for members in groups:
            pages = padded_tables([tables[i] for i in members], torch.long)
            width = pages.shape[1]
            group_lens = torch.tensor([lens[i] for i in members], dtype=torch.long)
            mask = (torch.arange(width * ps).unsqueeze(0) < group_lens.unsqueeze(1)).view(len(members), 1, 1, -1)
            out.append(DecodeGroup(torch.tensor([rows[i] for i in members], dtype=torch.long), pages, mask))
        return tuple(out)

    def execute_logits(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass alone: float32 logits of the sampling rows, on the model's device."""
        device = self.model.device
        if self.graphs is not None and isinstance(inputs.meta, KernelMetadata) and self.graphs.fits(
                inputs.input_ids, inputs.meta, inputs.logits_rows):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        meta = inputs.meta.to(device) if isinstance(inputs.meta, KernelMetadata) else inputs.meta
        fused = None
        if self.model.fuse_decode:  # read each step: tests switch it off to compare
            if self._decode_layers is None:
                self._decode_layers = self.model.decode_layers(self.kv_cache)
            fused = self._decode_layers
        with torch.inference_mode():
            return self.model.forward(
                inputs.input_ids.to(device, non_blocking=True), inputs.positions.to(device, non_blocking=True),
                self.kv_cache, meta, inputs.logits_rows, fused,
            )

    def execute(self, inputs: StepInputs) -> Sampled:
        """Forward + sample; one token per sampling chunk, in batch order.

        Steps must run in the order they were prepared: the ``PENDING`` inputs of
        one are the samples of the one before."""
        if torch.get_num_threads() != self.num_threads:  # OpenMP settings are per calling thread
            torch.set_num_threads(self.num_threads)
        previous, self._last_sampled = self._last_sampled, None
        rows = _fill_pending(inputs, previous)
        logits = self.execute_logits(inputs)
        with torch.inference_mode():
            sampled = sample_with_logprobs(logits, list(rows), self.model.kernels) if rows else Sampled([], [])
        self._last_sampled = sampled.tokens
        return sampled
