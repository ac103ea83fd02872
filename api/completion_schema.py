"""The body of ``POST /v1/completions`` (legacy): prompts in any of OpenAI's four forms."""

from __future__ import annotations

from typing import Any

import attrs

from trillm.api.fields import CommonFields, Field, bad, boolean_field, integer_field, parse_common

MAX_PROMPTS = 64
MAX_CHOICES = 128
MAX_LOGPROBS = 5


@attrs.frozen
class CompletionRequest:
    common: CommonFields
    prompts: tuple[str | tuple[int, ...], ...]  # each a text or token ids; one choice each
    echo: bool


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return (value,)
    if _is_token_list(value):
        return (tuple(value),)
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            prompts: tuple[str | tuple[int, ...], ...] = tuple(value)
        elif all(_is_token_list(p) for p in value):
            prompts = tuple(tuple(p) for p in value)
        else:
            raise bad("prompt", "a list must hold only strings or only non-empty lists of token ids")
        if len(prompts) > MAX_PROMPTS:
            raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        return prompts
    raise bad("prompt", "must be a string, a list of strings, a list of token ids, or a list of those lists")


_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT = Field(
    "prompt",
    {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_PROMPTS},
               _TOKENS, {"type": "array", "items": _TOKENS, "minItems": 1, "maxItems": MAX_PROMPTS}],
     "description": "a string, strings, token ids, or lists of token ids; one choice set per prompt"},
    lambda body: _prompts(body["prompt"]) if body.get("prompt") is not None else None,
)
ECHO = boolean_field("echo", False, "prepend the prompt to each choice")
SUFFIX = Field("suffix", {"type": ["string", "null"], "maxLength": 0, "description": "not supported"}, lambda body: None)
LOGPROBS = integer_field("logprobs", None, 0, MAX_LOGPROBS, "legacy log-probabilities with this many alternatives")
BEST_OF = integer_field("best_of", 1, 1, 1, "only 1")
COMPLETION_FIELDS: tuple[Field, ...] = (PROMPT, ECHO, SUFFIX, LOGPROBS, BEST_OF)


def parse_completion_request(body: Any) -> CompletionRequest:
    common = parse_common(body)
    prompts = PROMPT.parse(body)
    if prompts is None:
        raise bad("prompt", "is required")
    if body.get("suffix"):
        raise bad("suffix", "suffix (fill-in-the-middle) is not supported")
    echo = ECHO.parse(body)
    k = LOGPROBS.parse(body)
    if k is not None:
        if echo:
            raise bad("logprobs", "logprobs together with echo (prompt logprobs) are not supported")
        common = attrs.evolve(common, params=attrs.evolve(common.params, logprobs=k))
    if BEST_OF.parse(body) != 1:
        raise bad("best_of", "only best_of=1 is supported")
    if len(prompts) * common.n > MAX_CHOICES:
        raise bad("n", f"prompts x n must be at most {MAX_CHOICES}, got {len(prompts)} x {common.n}")
    return CompletionRequest(common, prompts, echo)
