"""A draft model (``--draft-model``): a smaller model of the same vocabulary that proposes each
verification's tokens, greedily, in the same worker thread just before the target's forward.

Its K/V lives in tensors of its own laid out over the target pool's pages (same page count and
size): a sequence's page table indexes both, so the prefix cache, preemption and page freeing
need nothing more. To keep its K/V whole, it runs over every token the target computes: each
step's tokens first (a verification contributes its last known token, whose logits give the first
proposal), then one decode pass per further proposal. A kept proposal's K/V is the right one (the
draft computed it from that very token); the rest is overwritten later, as the target's is.

Everything the passes need is prepared on the event loop with the target's step (``prepare``):
the worker fills in only the tokens (the ones the step in flight samples, and the proposals as
they come), as it does for the target. On a CPU the passes use all the forward's threads, one
after the other with the target's: the draft never runs beside it.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from trillm.engine.config import EngineConfig
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.native_memory import lazy_zeros
from trillm.engine.execution.sampler import greedy
from trillm.engine.execution.verify import chunk_rows
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.step import PENDING, Batch, ScheduledChunk, ScheduledSequence, StepInputs, fill_pending

_GREEDY = SamplingParams(max_tokens=None, temperature=0.0)


def _settings(config: EngineConfig) -> EngineConfig:
    """The draft's own settings: the target's, for another model that does not speculate itself
    (``--speculative draft`` kept with no draft model would refuse the settings)."""
    assert config.draft_model is not None
    return attrs.evolve(
        config, model=config.draft_model, tp=1, dp=1, nnodes=1, draft_model=None, tokenizer=None, speculative="off"
    )


def load_draft_model(config: EngineConfig) -> DecoderModel:
    """``--draft-model``, in this process, with the target's dtype and device choices (slow). Its
    tokenizer is checked against the target's first, before any weight is read: a draft must
    speak the same tokens."""
    from trillm.engine.execution.loading import load_model, load_tokenizer

    try:
        target = load_tokenizer(config)[0]
        draft = load_tokenizer(_settings(config))[0]
        if target.get_vocab() != draft.get_vocab():
            raise ValueError(
                f"its tokenizer's vocabulary differs from the model's ({len(draft.get_vocab())} against "
                f"{len(target.get_vocab())} tokens); a draft must share it"
            )
        return load_model(_settings(config))[0]
    except (ValueError, OSError) as exc:  # the refusal's one line, said of the draft
        raise type(exc)(f"--draft-model {config.draft_model}: {exc}") from exc


@attrs.frozen
class DraftInputs:
    """The draft's passes for one step, and where their proposals go in the target's inputs.

    ``first`` is the step with each verification cut to its last known token (its logits give the
    first proposal); ``passes[j - 1]`` runs proposal j of every verification proposing at least j
    tokens (giving proposal j + 1, and the K/V of proposal j, which may be kept). ``chunks`` lists,
    per verification: its sampling chunk's index, the input row its proposals start at in the
    target's step, and its row in each pass (``first``'s among its sampling rows, then one per
    proposal)."""

    first: StepInputs
    passes: tuple[StepInputs, ...]
    chunks: tuple[tuple[int, int, tuple[int, ...]], ...]


@attrs.define(eq=False)
class _Position:
    """A verification's position j, as a one-token chunk's sequence: its token is a proposal the
    worker fills in (``PENDING`` until then), its pages the sequence's."""

    pages: list[int]
    params: SamplingParams = _GREEDY
    prompt_ids: list[int] = attrs.field(factory=list)
    output_ids: list[int] = attrs.field(factory=list)
    num_computed: int = 0
    num_preemptions: int = 0
    pending_sample: int = -1
    generator: Any = None
    matcher: Any = None
    thinking: Any = None
    banned_ids: tuple[int, ...] = ()
    num_known_outputs: int = 0

    @property
    def num_tokens(self) -> int:
        return 0

    def token_ids(self, start: int, end: int) -> list[int]:
        return [PENDING] * (end - start)


class DraftModel:
    """The draft model, its K/V over the target pool's pages, and its backend's state."""

    def __init__(self, model: DecoderModel, num_pages: int, page_size: int) -> None:
        self.model = model
        self.page_size = page_size
        s = model.shape
        shape = (num_pages, page_size, s.num_kv_heads, s.head_dim)
        zeros = lambda: lazy_zeros(shape, model.kv_dtype, model.device)  # noqa: E731  (resident as written)
        self.kv_cache = [(zeros(), zeros()) for _ in range(s.num_layers)]
        self.bound = model.backend.bind(model, self.kv_cache)

    def prepare(self, batch: Batch[ScheduledSequence], target: StepInputs) -> DraftInputs:
        """The passes of ``batch`` (on the event loop, after the target's ``prepare`` made
        ``target``, which a step with no verification shares: the same tokens, the same rows)."""
        backend = self.model.backend
        if not any(c.draft for c in batch.chunks):
            return DraftInputs(target, (), ())
        cut = tuple(attrs.evolve(c, length=c.length - len(c.draft), draft=()) if c.draft else c for c in batch.chunks)
        first = backend.prepare(Batch(cut), self.page_size)
        longest = max((len(c.draft) for c in batch.chunks), default=0)
        passes = []
        rows_in_pass: dict[int, list[int]] = {}
        for j in range(1, longest + 1):  # the last proposal's pass only stores its K/V (it may be kept)
            chunks: list[ScheduledChunk[Any]] = []
            for index, c in enumerate(batch.chunks):
                if len(c.draft) >= j:
                    rows_in_pass.setdefault(index, []).append(len(chunks))
                    chunks.append(ScheduledChunk(_Position(list(c.seq.pages)), c.start + j, 1, True))
            passes.append(backend.prepare(Batch(tuple(chunks)), self.page_size))
        plans = []
        sample, row = 0, 0
        for index, c in enumerate(batch.chunks):
            if c.draft:
                first_row = row + c.length - len(c.draft)
                plans.append((sample, first_row, (sample, *rows_in_pass.get(index, []))))
            if c.samples:
                sample += 1
            row += c.length
        return DraftInputs(first, tuple(passes), tuple(plans))

    def propose(self, draft: DraftInputs, previous: list[int] | None) -> list[tuple[int, ...]]:
        """Each verification's proposals (greedy), computing the draft's K/V as it goes.
        ``previous``: the samples of the step before (for the tokens still ``PENDING``)."""
        fill_pending(draft.first, previous)
        proposals: list[list[int]] = [[] for _ in draft.chunks]
        with torch.inference_mode():
            logits = self._forward(draft.first)
            best = greedy(logits).tolist()
            for i, (sample, _, _) in enumerate(draft.chunks):
                proposals[i].append(best[sample])
            for j, step in enumerate(draft.passes, start=1):
                for i, (_, _, rows) in enumerate(draft.chunks):
                    if len(rows) > j:
                        step.input_ids[rows[j]] = proposals[i][j - 1]
                best = greedy(self._forward(step)).tolist()
                for i, (_, _, rows) in enumerate(draft.chunks):
                    if len(rows) > j + 1:  # rows: the first pass's, then one per proposal
                        proposals[i].append(best[rows[j]])
        return [tuple(p) for p in proposals]

    @staticmethod
    def fill(inputs: StepInputs, draft: DraftInputs, proposals: list[tuple[int, ...]]) -> StepInputs:
        """The target's step with the proposals in place of its placeholders: the input tokens,
        the verification rows' histories (penalties read them) and ``drafts``."""
        drafts = list(inputs.drafts)
        rows = list(inputs.rows)
        starts = chunk_rows(inputs.drafts)
        for (sample, first_row, _), proposed in zip(draft.chunks, proposals):
            for j, token in enumerate(proposed):
                inputs.input_ids[first_row + j] = token
            drafts[sample] = proposed
            for j in range(len(proposed) + 1):
                row = rows[starts[sample] + j]
                if row.output_ids:  # penalties: the history ends with the proposals before this row
                    known = row.output_ids[: len(row.output_ids) - j]
                    rows[starts[sample] + j] = attrs.evolve(row, output_ids=(*known, *proposed[:j]))
        return attrs.evolve(inputs, drafts=tuple(drafts), rows=tuple(rows))

    def _forward(self, step: StepInputs) -> torch.Tensor:
        device = self.model.device
        return self.model.forward(
            step.input_ids.to(device),
            step.positions.to(device),
            self.kv_cache,
            step.meta.to(device),
            step.logits_rows,
            self.bound,
        )
