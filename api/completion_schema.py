"""The body of ``POST /v1/completions`` (legacy): prompts in any of OpenAI's four forms."""

from __future__ import annotations

from typing import Any

import attrs

from api.fields import CommonFields, bad, boolean, integer, parse_common

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


def parse_completion_request(body: Any) -> CompletionRequest:
    common = parse_common(body)
    if body.get("prompt") is None:
        raise bad("prompt", "is required")
    prompts = _prompts(body["prompt"])
    if body.get("suffix"):
        raise bad("suffix", "suffix (fill-in-the-middle) is not supported")
    echo = boolean(body, "echo", False)
    if body.get("logprobs") is not None:
        if echo:
            raise bad("logprobs", "logprobs together with echo (prompt logprobs) are not supported")
        k = integer(body, "logprobs", 0, 0, MAX_LOGPROBS)
        common = attrs.evolve(common, params=attrs.evolve(common.params, logprobs=k))
    if integer(body, "best_of", 1, 1) != 1:
        raise bad("best_of", "only best_of=1 is supported")
    if len(prompts) * common.n > MAX_CHOICES:
        raise bad("n", f"prompts x n must be at most {MAX_CHOICES}, got {len(prompts)} x {common.n}")
    return CompletionRequest(common, prompts, echo)
