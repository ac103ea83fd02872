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

_Tokens = Annotated[list[TokenId], Field(min_length=1)]


@attrs.frozen
class CompletionRequest:
    """A validated completion request in the terms the handler uses."""

    common: CommonFields
    prompts: tuple[str | tuple[int, ...], ...]  # each a text or token ids; one choice set each
    echo: bool


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
    echo: bool = Field(False, description="the prompt text is prepended to each choice (streaming: sent first)")
    suffix: Annotated[str, Unsupported("suffix (fill-in-the-middle) is not supported")] | None = Field(
        None, description="not supported: a non-empty value is a 400"
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="legacy log-probabilities with this many alternatives: `choices[].logprobs = {tokens, "
        "token_logprobs, top_logprobs, text_offset}`; not together with `echo` (prompt logprobs are not "
        "supported)",
    )
    best_of: int = Field(1, ge=1, le=1, description="only 1")

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionBody:
        if self.logprobs is not None and self.echo:
            raise invalid("logprobs together with echo (prompt logprobs) are not supported", "logprobs")
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
            common = attrs.evolve(common, params=attrs.evolve(common.params, logprobs=self.logprobs))
        return CompletionRequest(common, self.prompts(), self.echo)


def parse_completion_request(body: Any) -> CompletionRequest:
    """A decoded JSON body -> ``CompletionRequest``, or a 400 ``ApiError`` naming the field."""
    return parse(CompletionBody, body).request()
