"""One request's state inside the scheduler; everything else is derived from it."""

from __future__ import annotations

from typing import Any

import attrs

from trillm.engine.sampling_params import SamplingParams
from trillm.engine.step import PENDING


@attrs.define(eq=False)
class Sequence:
    """Tokens, pages and progress of one request (a ``step.ScheduledSequence`` to the runner).

    ``num_computed`` counts the tokens whose K/V is in the cache or is being
    written by a step in flight. Whatever lies beyond it is scheduled next: many
    tokens while prefilling, exactly one (the last sampled token) while decoding.
    ``num_settled`` counts those whose step has returned: only they may be shared
    through the prefix cache. Preemption sets both back to zero.

    ``output_ids`` may end with ``PENDING`` tokens (at most two: one per step in
    flight); ``pending_sample`` is the row of the newest one among the samples of
    its step, which the model runner reads to fill it in.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + output may never exceed this (context or pool limit)
    eos_ids: frozenset[int]
    arrival_time: float = 0.0
    output_ids: list[int] = attrs.field(factory=list)
    pages: list[int] = attrs.field(factory=list)
    # Leading pages given back because every layer's sliding window has passed them (their places
    # in ``pages`` hold DROPPED_PAGE, a valid index the kernels never weigh: they mask or skip it).
    dropped_pages: int = 0
    num_computed: int = 0
    num_settled: int = 0
    pending_sample: int = -1
    finish_reason: str | None = None
    num_preemptions: int = 0
    admitted: bool = False  # has it ever been scheduled (preemption does not reset this)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    generator: Any = None  # the request's own torch.Generator when it has a seed
    matcher: Any = None  # its grammar state (``structured.Matcher``), advanced by the runner thread only
    thinking: Any = None  # its thinking budget (``structured.ThinkingBudget``), the runner thread's too
    spec: Any = None  # its ``speculation.SequenceSpeculation`` while speculation is on
    verifying: bool = False  # a step in flight scores proposed tokens: its next tokens are unknown
    # Another choice of the same prompt: this one waits for its prefill and
    # then shares its full prompt pages instead of computing them again.
    leader: Sequence | None = attrs.field(default=None, repr=False)
    # An embedding request's pooled hidden states so far (``SamplingParams.pooling``): their sum
    # and how many prompt rows it holds. Preemption starts them over with the prompt.
    pooled: Any = attrs.field(default=None, repr=False)
    num_pooled: int = 0
    token_scores: tuple[float, ...] | None = None  # ``SamplingParams.score_ids``' log-probabilities, once known

    @property
    def reuses_prefix(self) -> bool:
        """Whether it may start from cached pages: not when it needs every prompt row computed
        (prompt logprobs, an embedding pooled over more than its last token)."""
        return self.params.prompt_logprobs is None and self.params.pooling in (None, "last")

    def pool(self, rows: Any, count: int) -> None:
        """Add a step's pooled rows (a float32 vector: their sum, or the one row)."""
        self.pooled = rows if self.pooled is None else self.pooled + rows
        self.num_pooled += count

    @property
    def embedding(self) -> Any:
        """The pooled vector once the prompt has been computed (the mean: the sum over its rows)."""
        if self.pooled is None:
            return None
        return self.pooled / self.num_pooled if self.params.pooling == "mean" else self.pooled

    @property
    def banned_ids(self) -> tuple[int, ...]:
        """Tokens the sampler must not pick yet: stops before ``min_tokens`` is reached."""
        p = self.params
        if len(self.output_ids) >= p.min_tokens or p.grammar is not None:
            return ()  # a grammar decides where the output ends
        eos = () if p.ignore_eos else tuple(sorted(self.eos_ids))
        return eos + p.stop_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache; 1 means a plain decode step."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def token_ids(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:
            return self.output_ids[start - n_prompt : end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]

    @property
    def num_known_outputs(self) -> int:
        """Output tokens sampled by steps that have returned."""
        n = len(self.output_ids)
        while n and self.output_ids[n - 1] == PENDING:
            n -= 1
        return n

    def reaches_length(self, num_outputs: int) -> bool:
        """Whether the sequence ends by length once it has ``num_outputs`` output tokens."""
        max_tokens = self.params.max_tokens
        return (max_tokens is not None and num_outputs >= max_tokens) or len(
            self.prompt_ids
        ) + num_outputs >= self.max_len

    @property
    def awaits_last_token(self) -> bool:
        """A step in flight samples its last token: it ends by length then, so it must not run again."""
        return bool(self.output_ids) and self.output_ids[-1] == PENDING and self.reaches_length(len(self.output_ids))

    def settle_token(self, index: int, token: int) -> None:
        """Put a sampled token in place of ``output_ids[index]`` and decide whether the
        sequence is done; a done sequence drops the tokens scheduled after it."""
        self.output_ids[index] = token
        p = self.params
        constrained = p.grammar is not None  # its mask allows EOS only where the grammar is complete
        may_stop = index >= p.min_tokens or constrained
        if may_stop and (token in p.stop_token_ids or (token in self.eos_ids and (constrained or not p.ignore_eos))):
            self.finish_reason = "stop"
        elif self.reaches_length(index + 1):
            self.finish_reason = "length"
        if self.finish_reason is not None:
            del self.output_ids[index + 1 :]

    def drop_pending(self) -> None:
        """Forget tokens still in flight: the sequence ends without them."""
        del self.output_ids[self.num_known_outputs :]
