"""What the engine tells its callers: per-request outputs and engine-wide counters."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class TokenLogprobs:
    """The chosen token's log-probability and the ``k`` most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@attrs.frozen
class RequestOutput:
    """One step's news for one request: new tokens, their text, maybe the end."""

    request_id: str
    index: int  # which of the requests sharing a channel (``submit_many``)
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token in ``token_ids`` when asked for
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With ``SamplingParams.prompt_logprobs``, on the first output only: prompt tokens 1, 2, ...
    # each with its log-probability given the tokens before it (the first token has none).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    error: str | None = None  # with finish_reason "error": what ended it, when the request is at fault
    stop_string: str | None = None  # with finish_reason "stop": the stop string that ended the text, if one did
    accepted_prediction_tokens: int = 0  # of ``SamplingParams.prediction``, tokens verified into the output so far
    # An embedding request's (``SamplingParams.pooling``) pooled vector, float32, on its last output
    embedding: Any = attrs.field(default=None, eq=False, repr=False)
    # ``SamplingParams.score_ids``' raw log-probabilities where the first token was sampled, on the last output
    token_scores: tuple[float, ...] | None = None


@attrs.define
class ChoiceTotals:
    """Each choice of one call summed from its ``RequestOutput`` deltas: what a reply that is not
    streamed is made of (the server's ``collect``, the offline ``LLM``'s results)."""

    texts: list[str]  # each starts from its prefix (an echoed prompt, or "")
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs]]
    prompt_logprobs: list[tuple[TokenLogprobs, ...] | None]
    last: dict[int, RequestOutput]  # the newest output of each choice heard from

    @classmethod
    def starting(cls, prefixes: list[str]) -> ChoiceTotals:
        n = len(prefixes)
        return cls(list(prefixes), [[] for _ in range(n)], [[] for _ in range(n)], [None] * n, {})

    def add(self, out: RequestOutput) -> None:
        self.texts[out.index] += out.text
        self.token_ids[out.index] += out.token_ids
        self.logprobs[out.index] += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[out.index] = out.prompt_logprobs
        self.last[out.index] = out


@attrs.frozen
class SpeculationCounts:
    """Speculative decoding's counters for one way of proposing (``/metrics``)."""

    method: str  # "ngram": the request's own tokens; "prediction": its predicted output
    drafts: int  # verifications run
    draft_tokens: int  # tokens proposed
    accepted_tokens: int  # of which the model kept
    emitted_tokens: int  # tokens the verifications produced (kept + the model's own after them)

    @staticmethod
    def added(counts: list[SpeculationCounts]) -> tuple[SpeculationCounts, ...]:
        """Counts of several engines (``--dp`` replicas) summed per method."""
        totals: dict[str, list[int]] = {}
        for c in counts:
            total = totals.setdefault(c.method, [0, 0, 0, 0])
            for i, value in enumerate((c.drafts, c.draft_tokens, c.accepted_tokens, c.emitted_tokens)):
                total[i] += value
        return tuple(SpeculationCounts(method, *values) for method, values in sorted(totals.items()))


@attrs.frozen
class EngineStats:
    num_running: int
    num_waiting: int
    free_pages: int
    evictable_pages: int  # cached, referenced by no request: reclaimed when needed
    total_pages: int
    num_open_requests: int
    num_aborted: int
    num_stalled: int  # of those, aborted because their consumer took nothing for ``stall_timeout``
    num_merged_outputs: int  # outputs merged into one their consumer had not taken yet (it lagged)
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    grammar_compiles: int = 0  # structured-output constraints compiled (cache misses)
    grammar_compile_seconds: float = 0.0
    grammar_cache_hits: int = 0
    grammar_compile_timeouts: int = 0  # compiles killed at the time limit (a 400 each)
    grammar_compiler_busy: int = 0  # requests that found no free compile worker in time (a 503 each)
    grammar_masked_steps: int = 0  # steps with at least one constrained row
    grammar_mask_seconds: float = 0.0  # filling, applying and advancing their masks
    speculation: tuple[SpeculationCounts, ...] = ()
