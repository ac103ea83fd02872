"""The step vocabulary: the records the two halves of the engine hand each other, declared once.

``scheduling/`` and ``execution/`` never import each other; they meet here, below both.
One step goes down and comes back up:

- the scheduler hands the runner a ``Batch`` of ``ScheduledChunk``s (each over a sequence
  that offers what ``ScheduledSequence`` names; ``Sequence`` does); the runner snapshots it
  into ``StepInputs`` (a ``Step`` is the batch beside its inputs);
- the runner hands back a ``StepResult``: the ``Sampled`` tokens (one ``SampleRow`` each
  went in) and the ``PromptLogprobs`` asked for;
- rank 0 sends the other tensor-parallel ranks a ``RunnerSetup`` once, then each step's
  ``StepInputs``, a ``HEARTBEAT`` while idle, and ``None`` to stop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

import attrs
import torch

from trillm.engine.outputs import TokenLogprobs
from trillm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from trillm.engine.structured.matcher import Matcher
    from trillm.engine.structured.thinking_budget import ThinkingBudget

# An output token that a step in flight samples: scheduling runs one step ahead
# of the sampled tokens, so the next step is built before this one's arrive.
PENDING = -1


# -- what the scheduler hands the runner ---------------------------------------------------


class ScheduledSequence(Protocol):
    """What the runner's side reads of a scheduled sequence to prepare its step (read-only)."""

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def output_ids(self) -> list[int]: ...  # may end with ``PENDING`` tokens

    @property
    def params(self) -> SamplingParams: ...

    @property
    def pages(self) -> list[int]: ...

    @property
    def num_computed(self) -> int: ...

    @property
    def num_preemptions(self) -> int: ...

    @property
    def pending_sample(self) -> int: ...  # the newest ``PENDING`` token's row among its step's samples

    @property
    def generator(self) -> Any: ...  # its own torch.Generator when it has a seed

    @property
    def matcher(self) -> Any: ...  # its grammar state (``structured.Matcher``), if any

    @property
    def thinking(self) -> Any: ...  # its thinking budget (``structured.ThinkingBudget``), if any

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_known_outputs(self) -> int: ...

    @property
    def banned_ids(self) -> tuple[int, ...]: ...

    def token_ids(self, start: int, end: int) -> list[int]: ...


S = TypeVar("S", bound=ScheduledSequence, covariant=True)  # a scheduler's own sequence type
T = TypeVar("T", bound=ScheduledSequence)
Inputs = TypeVar("Inputs")


@attrs.frozen
class ScheduledChunk(Generic[S]):
    """``length`` tokens of ``seq`` starting at position ``start``.

    A verification chunk (``draft`` not empty) is the sequence's last token followed by the
    proposed tokens; every position samples, and the sampler keeps the proposals it agrees with.

    ``samples`` is fixed when scheduled: the chunk reaches the end of the known
    tokens, so the step samples a new one after it. ``generation`` is the
    sequence's preemption count then: a chunk of an older generation wrote
    pages the sequence no longer holds.
    """

    seq: S
    start: int
    length: int
    samples: bool
    generation: int = 0
    draft: tuple[int, ...] = ()  # tokens proposed after the sequence's last one: its last positions

    def token_ids(self) -> list[int]:
        """The chunk's input tokens: the sequence's, then the proposed ones."""
        known = self.end - len(self.draft)
        return self.seq.token_ids(self.start, known) + list(self.draft)

    @staticmethod
    def next_for(seq: T, length: int) -> ScheduledChunk[T]:
        """The next ``length`` tokens ``seq`` has not computed."""
        return ScheduledChunk(
            seq, seq.num_computed, length, seq.num_computed + length == seq.num_tokens, seq.num_preemptions
        )

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def decode_rows(self) -> int:
        """How many one-token decode rows the chunk runs as: each position of a verification
        (their K/V all stored before any row attends, each row sees the proposals before it: the
        same arithmetic as decoding them one by one), 1 for a decode, 0 for a prefill chunk."""
        if self.draft:
            return self.length
        return 1 if self.length == 1 else 0


@attrs.frozen
class Batch(Generic[S]):
    chunks: tuple[ScheduledChunk[S], ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class StepMetadata(Protocol):
    """What every backend's metadata offers the runner; the rest is the backend's own."""

    @property
    def slot_mapping(self) -> torch.Tensor:
        """[T]: where each new token's K/V is written."""

    def to(self, device: torch.device) -> Self: ...


@attrs.frozen
class SampleRow:
    """What the sampler needs about one row; a snapshot taken before the step."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: tuple[int, ...] | list[int] = ()
    output_ids: tuple[int, ...] = ()
    banned_ids: tuple[int, ...] = ()  # EOS and stop ids while min_tokens is not reached
    matcher: Matcher | None = None  # the row's grammar state, when it has one
    thinking: ThinkingBudget | None = None  # the row's thinking budget, when it has one


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


@attrs.frozen
class PoolSpan:
    """Rows of ``hidden_rows`` an embedding request pools (``SamplingParams.pooling``): ``count``
    rows from ``offset`` on, of chunk ``chunk`` of the batch (every prompt row for "mean", the first
    or the last prompt row for "cls" and "last")."""

    chunk: int
    offset: int
    count: int


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
    # per sampling chunk, its proposed tokens (a verification: ``len + 1`` consecutive sampling
    # rows), () for one row; all () -- the common case -- as an empty tuple
    drafts: tuple[tuple[int, ...], ...] = ()
    # with a draft model: its passes (``execution.draft.DraftInputs``), which propose the
    # verifications' tokens (``PENDING`` in ``drafts`` and the inputs until then)
    draft: Any = None
    # input rows whose final-normed hidden states embedding requests pool (``pool_spans`` say whose)
    hidden_rows: torch.Tensor | None = None
    pool_spans: tuple[PoolSpan, ...] = ()


@attrs.frozen
class Step(Generic[Inputs]):
    """A launched batch and the inputs prepared for it (a snapshot the worker may read)."""

    batch: Batch[Any]
    inputs: Inputs


def fill_pending(inputs: StepInputs, previous: list[int] | None) -> tuple[SampleRow, ...]:
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


# -- what the runner hands back ------------------------------------------------------------


@attrs.frozen
class Sampled:
    """Per sampling chunk: the token sampled after it (after the accepted proposals, for a
    verification), its logprobs (None where not asked for), and the proposals accepted before it
    with theirs."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    accepted: list[tuple[int, ...]] = attrs.field(factory=list)  # empty: no chunk verified
    accepted_logprobs: list[tuple[TokenLogprobs | None, ...]] = attrs.field(factory=list)

    def emitted_logprobs(self, sample: int) -> tuple[TokenLogprobs | None, ...]:
        accepted = self.accepted_logprobs[sample] if self.accepted_logprobs else ()
        return (*accepted, self.logprobs[sample])


@attrs.frozen
class PromptLogprobs:
    """Prompt tokens ``start + 1``, ``start + 2``, ... of chunk ``chunk`` of the step's batch, each
    with its log-probability given the tokens before it (the model's raw log-softmax: no
    temperature, bias or penalty) and the ``top`` most likely tokens there."""

    chunk: int
    start: int
    entries: tuple[TokenLogprobs, ...]


@attrs.frozen
class Pooled:
    """What chunk ``chunk`` of the step's batch adds to its embedding: the sum of ``count`` pooled
    rows (float32, on the CPU)."""

    chunk: int
    rows: torch.Tensor
    count: int


@attrs.frozen
class StepResult(Sampled):
    """A step's samples, plus the prompt log-probabilities and pooled rows its requests asked for."""

    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
    seconds: float = 0.0  # what the forward and the sampling took (speculation's cost model reads it)
    pooled: tuple[Pooled, ...] = ()
    # (sampling chunk, the raw log-probabilities of its ``SamplingParams.score_ids``), where asked
    scores: tuple[tuple[int, tuple[float, ...]], ...] = ()


# -- what goes between tensor-parallel ranks -------------------------------------------------


@attrs.frozen
class RunnerSetup:
    """What the workers' runners must agree on with rank 0's: the KV pool and the graphs."""

    num_pages: int
    page_size: int
    graph_batch: int
    max_model_len: int


# Sent by an idle rank 0 every ``dist_timeout / 4``: the others' wait for the next step would time
# out otherwise, and a rank that died is noticed even while no request runs.
HEARTBEAT = "heartbeat"
