"""The model runner: owns the KV cache tensors, runs one step through the model's backend.

``prepare`` turns a scheduled batch into tensors on the event loop (a snapshot,
so an abort that frees pages mid-step cannot race the worker thread);
``execute`` runs the forward pass and the sampler and is meant for a worker
thread. Grad mode is per thread, so ``execute`` enters inference mode itself.
What the tensors are, and how the layers run, is the backend's (``backends/``):
the runner never asks which backend it holds, only what it supports.

A batch may be prepared while the step before it runs, before that step's
tokens are known: those inputs are ``PENDING`` in the snapshot, and ``execute``
fills them in from the tokens it sampled last (steps run one at a time, in order).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from trillm.engine.execution.cuda_graphs import Capture, DecodeGraphs, cuda_capture, eager_capture
from trillm.engine.execution.draft import DraftModel
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.native_memory import lazy_zeros
from trillm.engine.execution.parallel.channel import StepChannel
from trillm.engine.execution.parallel.topology import WorkerDied
from trillm.engine.execution.sampler import sample_with_logprobs
from trillm.engine.execution.verify import chunk_rows, with_verifications
from trillm.engine.outputs import TokenLogprobs
from trillm.engine.step import (
    HEARTBEAT,
    Batch,
    Pooled,
    PoolSpan,
    PromptLogprobs,
    PromptSpan,
    RunnerSetup,
    Sampled,
    SampleRow,
    ScheduledSequence,
    StepInputs,
    StepResult,
    fill_pending,
)
from trillm.engine.structured.matcher import GrammarMasks, advance
from trillm.engine.structured.thinking_budget import force_rows

log = logging.getLogger("trillm.engine")

__all__ = ["ModelRunner", "kv_bytes_per_token"]


def prompt_logprobs(logits: torch.Tensor, spans: tuple[PromptSpan, ...]) -> tuple[PromptLogprobs, ...]:
    """Log-softmax of the prompt rows (``logits`` holds exactly those, in ``spans`` order)."""
    out = []
    for span in spans:
        logp = torch.log_softmax(logits[span.offset : span.offset + len(span.targets)], dim=-1)
        targets = torch.tensor(span.targets, device=logp.device).unsqueeze(1)
        chosen = logp.gather(1, targets).squeeze(1).tolist()
        if span.top:
            top = torch.topk(logp, span.top, dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        else:
            tops = [()] * len(chosen)
        entries = tuple(TokenLogprobs(t, lp, top) for t, lp, top in zip(span.targets, chosen, tops))
        out.append(PromptLogprobs(span.chunk, span.start, entries))
    return tuple(out)


def pooled(hidden: torch.Tensor, spans: tuple[PoolSpan, ...]) -> tuple[Pooled, ...]:
    """Each span's rows summed (a mean divides by the prompt's length once it is all in), on the CPU."""
    return tuple(
        Pooled(span.chunk, hidden[span.offset : span.offset + span.count].sum(0).cpu(), span.count) for span in spans
    )


def token_scores(
    logits: torch.Tensor, rows: Sequence[SampleRow], chunks: Sequence[int]
) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """The raw log-probabilities of each row's ``score_ids``, by sampling chunk, where asked."""
    return tuple(
        (chunk, tuple(torch.log_softmax(logits[i].float(), -1)[list(row.params.score_ids)].tolist()))
        for i, (row, chunk) in enumerate(zip(rows, chunks))
        if row.params.score_ids
    )


def kv_bytes_per_token(model: DecoderModel) -> int:
    return model.shape.kv_bytes_per_token(model.kv_dtype)


@attrs.define
class MaskStats:
    """Time the runner spends on grammar masks (fill, apply, advance): the cost of structured outputs."""

    steps: int = 0
    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds


class ModelRunner:
    """One model, its KV cache and its backend's per-cache state; steps run one at a time."""

    def __init__(
        self,
        model: DecoderModel,
        num_pages: int,
        page_size: int,
        num_threads: int | None = None,
        graph_batch: int = 0,
        max_model_len: int = 0,
        draft: DraftModel | None = None,
    ) -> None:
        """``graph_batch`` > 0 replays decode steps of up to that many rows from
        captured graphs (backends that support them; CUDA graphs on a GPU, eager replay
        of the same static buffers elsewhere, for tests)."""
        self.model = model
        self.draft = draft  # ``--draft-model``: proposes the verifications' tokens
        self.backend = model.backend
        self.num_threads = num_threads or torch.get_num_threads()
        self.page_size = page_size
        s = model.shape
        shape = (num_pages, page_size, s.num_kv_heads, s.head_dim)
        zeros = lambda: lazy_zeros(shape, model.kv_dtype, model.device)  # noqa: E731  (resident as written)
        self.kv_cache = [(zeros(), zeros()) for _ in range(s.num_layers)]
        self._bound: Any = self.backend.bind(model, self.kv_cache)  # the backend's state over this cache
        self._last_sampled: list[int] | None = None  # the tokens of the step that ran last
        self.mask_stats = MaskStats()  # written by the runner thread, read by /metrics
        # Rank 0 of a tensor-parallel group sends every step to the other ranks, which run it alike.
        self.steps: StepChannel | None = None
        if model.tp.size > 1 and model.tp.rank == 0:
            self.steps = StepChannel(model.tp.steps)
            self.steps.send(RunnerSetup(num_pages, page_size, graph_batch, max_model_len))
        self.graphs: DecodeGraphs | None = None
        if graph_batch > 0:
            self.graphs = self._capture(graph_batch, -(-(max_model_len or s.max_position_embeddings) // page_size))

    def heartbeat(self) -> None:
        """Show the other tensor-parallel ranks that rank 0 lives (between steps, never during one)."""
        if self.steps is not None:
            self.steps.send(HEARTBEAT)

    def close(self) -> None:
        """Tell the other tensor-parallel ranks to stop (nothing to do alone); call once no step runs."""
        steps, self.steps = self.steps, None
        if steps is not None:
            steps.send(None)

    def _capture(self, max_batch: int, max_pages: int) -> DecodeGraphs | None:
        """Decode graphs, or None (logged) where capture fails: eager steps still work."""
        capture: Capture = eager_capture
        if self.model.device.type == "cuda":
            capture = cuda_capture(torch.cuda.graph_pool_handle())
        started = time.perf_counter()
        try:
            graphs = DecodeGraphs(self.model, self.kv_cache, max_batch, max_pages, capture)
        except Exception:
            if self.model.device.type != "cuda" or self.model.tp.size > 1:  # the ranks' captures must agree
                raise
            log.exception("capturing decode graphs failed; decode steps run eagerly")
            return None
        log.info("decode graphs for batch sizes %s captured in %.1f s", graphs.buckets, time.perf_counter() - started)
        return graphs

    def prepare(self, batch: Batch[ScheduledSequence]) -> StepInputs:
        """The step's tensors, in the backend's own metadata (and the draft model's passes)."""
        inputs = self.backend.prepare(batch, self.page_size)
        if self.draft is not None:
            inputs = attrs.evolve(inputs, draft=self.draft.prepare(batch, inputs))
        return inputs

    def execute_logits(self, inputs: StepInputs) -> torch.Tensor:
        """The forward pass alone: float32 logits of the sampling rows, on the model's device."""
        return self.execute_forward(inputs)[0]

    def execute_forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward pass: the logits, and the hidden states of ``inputs.hidden_rows`` (embeddings)."""
        if self.steps is not None:  # what the other ranks need to run the same forward, no more
            self.steps.send(
                attrs.evolve(inputs, rows=(), pending_inputs=(), pending_history=(), draft=None, hidden_rows=None)
            )
        device = self.model.device
        replay = not inputs.prompt_spans and inputs.hidden_rows is None  # a graph computes the batch's rows, no more
        if replay and self.graphs is not None and self.graphs.fits(inputs.input_ids, inputs.meta, inputs.logits_rows):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta), None
        meta = inputs.meta.to(device)
        hidden_rows = inputs.hidden_rows.to(device) if inputs.hidden_rows is not None else None
        with torch.inference_mode():
            return self.model.forward_with_hidden(
                inputs.input_ids.to(device, non_blocking=True),
                inputs.positions.to(device, non_blocking=True),
                self.kv_cache,
                meta,
                inputs.logits_rows,
                hidden_rows,
                self._bound,
            )

    def execute(self, inputs: StepInputs) -> StepResult:
        """Forward + sample; one token per sampling chunk, in batch order, and the prompt
        log-probabilities of ``inputs.prompt_spans``.

        Steps must run in the order they were prepared: the ``PENDING`` inputs of
        one are the samples of the one before."""
        if torch.get_num_threads() != self.num_threads:  # OpenMP settings are per calling thread
            torch.set_num_threads(self.num_threads)
        began = time.perf_counter()
        previous, self._last_sampled = self._last_sampled, None
        rows = fill_pending(inputs, previous)
        if inputs.draft is not None and self.draft is not None:  # the draft model proposes, then the target scores
            inputs = self.draft.fill(
                attrs.evolve(inputs, rows=rows), inputs.draft, self.draft.propose(inputs.draft, previous)
            )
            rows = inputs.rows
        try:
            logits, hidden = self.execute_forward(inputs)
        except Exception as exc:
            if self.model.tp.size > 1:  # a collective failed, or a rank's forward: the group is out of step
                raise WorkerDied(f"a tensor-parallel step failed: {exc}") from exc
            raise
        n = len(rows)
        starts = chunk_rows(inputs.drafts) if inputs.drafts else range(n)
        plain = [c for c, draft in enumerate(inputs.drafts) if not draft] if inputs.drafts else range(n)
        plain_rows = [rows[starts[c]] for c in plain]
        plain_logits = logits[:n] if len(plain_rows) == n else logits[[starts[c] for c in plain]]
        # On a GPU the forward is still running: the grammar masks are filled meanwhile.
        matchers = [row.matcher for row in plain_rows]  # a verification's masks are its own (``verify``)
        started = time.perf_counter()
        masks = GrammarMasks.fill(matchers, logits.shape[-1], self.num_threads)
        budgets = [row.thinking for row in plain_rows]
        forced = [(i, token) for i, b in enumerate(budgets) if b is not None and (token := b.next_forced()) is not None]
        if forced:  # a spent thinking budget: the row may only close the thinking
            masks = masks or GrammarMasks.empty(len(plain_rows), logits.shape[-1])
            force_rows(masks.bitmask, forced)
            masks.rows = sorted({*masks.rows, *(i for i, _ in forced)})
        mask_seconds = time.perf_counter() - started
        with torch.inference_mode():
            kernel = self.backend.sampling_kernel
            sampled = sample_with_logprobs(plain_logits, plain_rows, kernel, masks) if plain_rows else Sampled([], [])
            if inputs.drafts:
                sampled = with_verifications(sampled, logits, rows, inputs.drafts)
            prompt = prompt_logprobs(logits[n:], inputs.prompt_spans) if inputs.prompt_spans else ()
        for budget, c in zip(budgets, plain):
            if budget is not None:
                budget.took(sampled.tokens[c])
        if masks is not None and any(m is not None for m in matchers):  # a grammar's cost (not a budget's)
            started = time.perf_counter()
            advance(matchers, [sampled.tokens[c] for c in plain])
            self.mask_stats.add(mask_seconds + masks.apply_seconds + time.perf_counter() - started)
        self._last_sampled = sampled.tokens
        return StepResult(
            sampled.tokens,
            sampled.logprobs,
            sampled.accepted,
            sampled.accepted_logprobs,
            prompt,
            time.perf_counter() - began,
            pooled(hidden, inputs.pool_spans) if hidden is not None else (),
            token_scores(plain_logits, plain_rows, plain),
        )
