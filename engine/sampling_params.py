"""Per-request sampling parameters, validated once at the engine boundary."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from trillm.engine.structured import CompiledGrammar

# What ``torch.Generator.manual_seed`` takes (a negative seed is read as its 64-bit two's complement).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Priorities are bounded so that aging (priority x seconds) stays exact in a float.
MAX_PRIORITY = 1_000_000
GREEDY_TEMPERATURE = 1e-5  # below it, a temperature is taken as 0
POOLING = ("mean", "cls", "last")


@attrs.frozen
class SamplingParams:
    """What one request asks of the sampler, the stop checks and the scheduler (``priority``).

    ``max_tokens`` of None means "until EOS or the context is full".
    Penalties follow OpenAI (presence/frequency, over generated tokens) and
    vLLM (repetition, over prompt and generated tokens).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the top k
    # None: off; k: each prompt token's logprob given the tokens before it, and the top k there
    # (``RequestOutput.prompt_logprobs``). Costs logits for every prompt row, and such a
    # request reuses no prefix-cache pages nor another choice's prompt: those rows are computed.
    prompt_logprobs: int | None = None
    # Every output token must keep the text inside this grammar; it ends the sequence ("stop")
    # when complete. ``min_tokens`` and ``ignore_eos`` do not hold back its end.
    grammar: CompiledGrammar | None = attrs.field(default=None, eq=False)
    # Lower is sooner (as vLLM); read only under the ``priority`` scheduling policy. It rides here,
    # not beside the params, so that each of ``n`` choices and every entry point carries it as is.
    priority: int = 0
    # The text keeps the tokenizer's special tokens (vLLM's ``skip_special_tokens=false``): gpt-oss's
    # harmony markers are special tokens, and its parser reads them (``api/harmony.py``).
    skip_special_tokens: bool = True
    # Speculation (``--speculative``) may propose tokens for this request; False opts it out.
    speculative: bool = True
    # OpenAI's Predicted Outputs: the tokens the client expects (a file being edited), proposed first.
    prediction: tuple[int, ...] = ()
    # An embedding request (``/v1/embeddings``): the prompt's final-normed hidden states pooled
    # ("mean", "cls": the first token's, "last": the last token's) come back on the finished
    # output (``RequestOutput.embedding``); its one sampled token is dropped. "mean" and "cls"
    # reuse no prefix-cache pages: every prompt row is computed.
    pooling: str | None = None
    # The model's own log-probabilities (log-softmax of the raw logits: no bias, penalty or
    # temperature) of these tokens where it samples its first token (``RequestOutput.token_scores``):
    # what ``/v1/rerank`` reads a "yes" or "no" from.
    score_ids: tuple[int, ...] = ()
    # OpenAI's ``prompt_cache_key``: under ``--dp`` requests with the same key go to the same replica
    # (whose prefix cache holds what they share), as the prefix itself routes them otherwise.
    prompt_cache_key: str | None = None
    # A thinking budget (Anthropic's ``thinking.budget_tokens``): after this many tokens of thinking
    # the reply is made to close it, ``thinking_end_ids`` (the closing tag) then ``thinking_after_ids``
    # (the blank line templates put after it) forced one by one (``ThinkingBudget``). Thinking opens
    # at the first output token, or, given ``thinking_start_ids``, where the output opens with them;
    # the closing tag written by the model ends it too. A request with a budget is not speculated on.
    thinking_budget: int | None = None
    thinking_start_ids: tuple[int, ...] = ()
    thinking_end_ids: tuple[int, ...] = ()
    thinking_after_ids: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        floats = (self.temperature, self.top_p, self.min_p, self.presence_penalty, self.frequency_penalty)
        if not all(map(math.isfinite, (*floats, self.repetition_penalty, *(b for _, b in self.logit_bias)))):
            raise ValueError("sampling parameters must be finite numbers")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.pooling is not None and self.pooling not in POOLING:
            raise ValueError(f"pooling must be one of {', '.join(POOLING)}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.thinking_budget is not None and (self.thinking_budget < 0 or not self.thinking_end_ids):
            raise ValueError("a thinking budget is >= 0 and needs the tokens that end thinking")
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_TEMPERATURE`` are greedy too (as vLLM): dividing float32
        logits by them overflows to inf and the draw would read NaNs."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def needs_history(self) -> bool:
        """True when the sampler must see the tokens generated so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """``n`` samples of one prompt; with a seed, choice j uses seed + j so they differ but repeat
    (the HTTP API's ``n`` and the offline ``LLM``'s alike)."""
    if params.seed is None:
        return [params] * n
    return [attrs.evolve(params, seed=params.seed + j) for j in range(n)]
