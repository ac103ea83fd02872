"""The offline API's ``SamplingParams``: the HTTP API's request fields, as vLLM users write them.

It is a thin front over the engine's own ``SamplingParams``: ``engine_params()`` builds
that record (which validates every value, so a bad one fails here, at construction), and
what sits above the engine on the server sits above it here too, done by the same
functions: ``n`` choices with seeds ``seed + j`` (``choice_params``), ``stop`` strings
and logprobs travel inside the engine's params as the server's do, and
``response_format`` becomes the same ``GrammarSpec`` the server compiles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trillm.engine.sampling_params import SamplingParams as EngineSamplingParams
from trillm.engine.sampling_params import choice_params
from trillm.engine.structured import GrammarSpec


def _stop(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """One stop string or several, as the server takes them (empty strings dropped, as there)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    return tuple(s for s in items if s)


def _bias(value: Mapping[int, float] | Sequence[tuple[int, float]] | None) -> tuple[tuple[int, float], ...]:
    items = value.items() if isinstance(value, Mapping) else value or ()
    return tuple((int(token), float(bias)) for token, bias in items)


@attrs.frozen
class SamplingParams:
    """How to sample one prompt's ``n`` completions (vLLM's names and defaults: 16 tokens at most).

    ``stop``: a string or a list; generation ends before it (not returned), ``finish_reason`` "stop".
    ``logprobs``: None (off) or k, the chosen token's logprob and the k most likely per token.
    ``response_format``: OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"schema": {...}}}``; ``grammar``: any ``GrammarSpec`` (regex, choice, EBNF).
    """

    n: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    skip_special_tokens: bool = True  # False: the text keeps the tokenizer's special tokens
    speculative: bool = True  # False: this request opts out of speculative decoding
    prediction: tuple[int, ...] = attrs.field(default=(), converter=tuple)  # token ids the output is expected to be
    response_format: Mapping[str, Any] | None = attrs.field(default=None, eq=False)
    grammar: GrammarSpec | None = None
    pooling: str | None = None  # "mean", "cls", "last": the result carries the pooled vector (``LLM.embed``)
    score_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)  # raw logprobs of these where it answers
    prompt_cache_key: str | None = None  # under dp: one replica per key
    # a thinking budget: after so many tokens of thinking its closing tag (then the "after" ids) is forced
    thinking_budget: int | None = None
    thinking_start_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)  # (): thinking from the start
    thinking_end_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    thinking_after_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        self.choices()  # every value checked now, by the engine's own rules (choice j's seed too)
        self.grammar_spec()

    def engine_params(self) -> EngineSamplingParams:
        """The engine's record of everything but ``n`` and the constraint (compiled later)."""
        names = {f.name for f in attrs.fields(EngineSamplingParams)} - {"grammar"}
        return EngineSamplingParams(**{name: getattr(self, name) for name in names})

    def choices(self) -> list[EngineSamplingParams]:
        """The engine params of each of the ``n`` choices, as the server makes them."""
        return choice_params(self.engine_params(), self.n)

    def grammar_spec(self) -> GrammarSpec | None:
        """The output constraint, from ``grammar`` or ``response_format`` (not both)."""
        fmt = self.response_format
        if fmt is None or fmt.get("type") == "text":
            return self.grammar
        if self.grammar is not None:
            raise ValueError("give either response_format or grammar, not both")
        if fmt.get("type") == "json_object":
            return GrammarSpec.json_object()
        if fmt.get("type") == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if schema is None:
                raise ValueError("response_format: json_schema needs {'json_schema': {'schema': ...}}")
            return GrammarSpec.json_schema(schema)
        raise ValueError(f"response_format: unknown type {fmt.get('type')!r} (text, json_object or json_schema)")
