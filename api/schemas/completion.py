"""The body of ``POST /v1/completions`` (legacy): prompts in any of OpenAI's four forms."""

from __future__ import annotations

from typing import Annotated, Any

import attrs
from pydantic import Field, model_validator

from trillm.api.schemas.base import Unsupported, invalid
from trillm.api.schemas.describe import parse
from trillm.api.schemas.generation import CommonFields, GenerationBody, TokenId

MAX_PROMPTS = 64
MAX_CHOICES = 128
MAX_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for this endpoint (chat has none)

_Tokens = Annotated[list[TokenId], Field(min_length=1)]


@attrs.frozen
class CompletionRequest:
    """A validated completion request in the terms the handler uses."""

    common: CommonFields
    prompts: tuple[str | tuple[int, ...], ...]  # each a text or token ids; one choice set each
    echo: bool
    echo_only: bool = False  # max_tokens 0 with echo: the prompt (and its logprobs) alone, nothing generated


class CompletionBody(GenerationBody):
    """The body of ``POST /v1/completions`` (published as ``CompletionRequest``)."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | _Tokens
        | Annotated[list[_Tokens], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(
        description=f"a string, strings, token ids, or lists of token ids; up to {MAX_PROMPTS} prompts; `n` choices "
        f"per prompt, `index` = prompt position x n + j; prompts x n <= {MAX_CHOICES}"
    )
    max_tokens: int | None = Field(
        DEFAULT_MAX_TOKENS,
        ge=0,
        description=f"most tokens to generate; {DEFAULT_MAX_TOKENS} by default (OpenAI's default for this endpoint; "
        "the server's `--default-max-tokens` may lower it). 0 only with `echo: true`: the reply is the prompt "
        "alone (with `logprobs`, its scores), nothing is generated. Over the context: as for chat",
    )
    echo: bool = Field(
        False,
        description="the prompt text is prepended to each choice (streaming: sent first); with `logprobs`, the "
        "prompt's tokens get entries too",
    )
    suffix: Annotated[str, Unsupported("suffix (fill-in-the-middle) is not supported")] | None = Field(
        None, description="not supported: a non-empty value is a 400"
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="legacy log-probabilities with this many alternatives: `choices[].logprobs = {tokens, "
        "token_logprobs, top_logprobs, text_offset}`. With `echo`, every prompt token has an entry first (the "
        "first one's `token_logprobs` and `top_logprobs` are null): the model's log-softmax at each prompt "
        "position, as lm-eval's `local-completions` scores likelihoods; such a request computes its whole "
        "prompt (no prefix-cache reuse)",
    )
    best_of: int = Field(1, ge=1, le=1, description="only 1")

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionBody:
        if self.max_tokens == 0 and not self.echo:
            raise invalid("0 is only allowed with 'echo': true (scoring the prompt)", "max_tokens")
        count = len(self.prompts())
        if count * self.n > MAX_CHOICES:
            raise invalid(f"prompts x n must be at most {MAX_CHOICES}, got {count} x {self.n}", "n")
        return self

    def prompts(self) -> tuple[str | tuple[int, ...], ...]:
        """Each prompt a text or token ids, whichever of the four forms came."""
        p = self.prompt
        if isinstance(p, str):
            return (p,)
        if all(isinstance(t, int) for t in p):
            return (tuple(p),)  # type: ignore[arg-type]
        return tuple(x if isinstance(x, str) else tuple(x) for x in p)  # type: ignore[arg-type]

    def request(self) -> CompletionRequest:
        common = self.common()
        if self.logprobs is not None:
            prompt_logprobs = self.logprobs if self.echo else None
            params = attrs.evolve(common.params, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs)
            common = attrs.evolve(common, params=params)
        return CompletionRequest(common, self.prompts(), self.echo, self.max_tokens == 0)


def parse_completion_request(body: Any) -> CompletionRequest:
    """A decoded JSON body -> ``CompletionRequest``, or a 400 ``ApiError`` naming the field."""
    return parse(CompletionBody, body).request()
