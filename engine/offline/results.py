"""What ``LLM.generate`` returns: one ``RequestOutput`` per prompt, in prompt order (vLLM's shape).

The engine speaks in deltas (``trillm.engine.outputs.RequestOutput``, one per step and
choice); ``Gathered`` adds them up for one prompt, as the server's non-streaming
reply does, and ``result`` freezes the total.
"""

from __future__ import annotations

import attrs

from trillm.engine.outputs import ChoiceTotals, TokenLogprobs
from trillm.engine.outputs import RequestOutput as EngineOutput


@attrs.frozen
class CompletionOutput:
    """One of a prompt's ``n`` completions."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    logprobs: tuple[TokenLogprobs, ...] | None = None  # with SamplingParams.logprobs: one per token
    error: str | None = None  # with finish_reason "error": why (e.g. the grammar allowed no token)


@attrs.frozen
class RequestOutput:
    """A prompt and its completions."""

    request_id: str
    prompt: str | None  # None for a prompt given as token ids
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # with SamplingParams.prompt_logprobs
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    embedding: tuple[float, ...] | None = None  # with SamplingParams.pooling: the pooled vector, as pooled

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@attrs.define
class Gathered:
    """One prompt's choices so far, summed from the engine's deltas (``ChoiceTotals``, as the
    server's non-streaming reply sums them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    want_logprobs: bool
    totals: ChoiceTotals = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.totals = ChoiceTotals.starting([""] * self.n)

    def add(self, out: EngineOutput) -> None:
        self.totals.add(out)

    def result(self) -> RequestOutput:
        """The finished total; a choice the engine never answered ends as "abort"."""
        totals = self.totals
        outputs = []
        for j in range(self.n):
            last = totals.last.get(j)
            outputs.append(
                CompletionOutput(
                    j,
                    totals.texts[j],
                    tuple(totals.token_ids[j]),
                    last.finish_reason if last is not None else "abort",
                    tuple(totals.logprobs[j]) if self.want_logprobs else None,
                    last.error if last is not None else None,
                )
            )
        cached = max((o.num_cached_tokens for o in totals.last.values()), default=0)
        prompt_logprobs = next((p for p in totals.prompt_logprobs if p is not None), None)
        first = totals.last.get(0)
        embedding = None if first is None or first.embedding is None else tuple(first.embedding.tolist())
        return RequestOutput(
            self.request_id,
            self.prompt,
            tuple(self.prompt_token_ids),
            tuple(outputs),
            prompt_logprobs,
            cached,
            embedding,
        )
