"""One request's state inside the scheduler; everything else is derived from it."""

from __future__ import annotations

import attrs

from typing import Any

from engine.sampling_params import SamplingParams


@attrs.define(eq=False)
class Sequence:
    """Tokens, pages and progress of one request.

    ``num_computed`` counts the tokens whose K/V is in the cache. Whatever lies
    beyond it is scheduled next: many tokens while prefilling, exactly one
    (the last sampled token) while decoding. Preemption sets it back to zero.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + output may never exceed this (context or pool limit)
    eos_ids: frozenset[int]
    arrival_time: float = 0.0
    output_ids: list[int] = attrs.field(factory=list)
    pages: list[int] = attrs.field(factory=list)
    num_computed: int = 0
    finish_reason: str | None = None
    num_preemptions: int = 0
    admitted: bool = False  # has it ever been scheduled (preemption does not reset this)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    generator: Any = None  # the request's own torch.Generator when it has a seed
    # Another choice of the same prompt: this one waits for its prefill and
    # then shares its full prompt pages instead of computing them again.
    leader: "Sequence | None" = attrs.field(default=None, repr=False)

    @property
    def banned_ids(self) -> tuple[int, ...]:
        """Tokens the sampler must not pick yet: stops before ``min_tokens`` is reached."""
        p = self.params
        if len(self.output_ids) >= p.min_tokens:
            return ()
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

    def append_token(self, token: int) -> None:
        """Record a sampled token and decide whether the sequence is done."""
        self.output_ids.append(token)
        p = self.params
        may_stop = len(self.output_ids) > p.min_tokens  # the new token's index is >= min_tokens
        if may_stop and (token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)):
            self.finish_reason = "stop"
        elif p.max_tokens is not None and len(self.output_ids) >= p.max_tokens:
            self.finish_reason = "length"
        elif self.num_tokens >= self.max_len:
            self.finish_reason = "length"
