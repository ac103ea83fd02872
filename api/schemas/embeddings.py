"""The body of ``POST /v1/embeddings`` (OpenAI's shape; vLLM's and llama.cpp's too)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from trillm.api.schemas.base import RequestModel
from trillm.api.schemas.describe import parse
from trillm.engine import MAX_PRIORITY

MAX_INPUTS = 2048  # as OpenAI

_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class EmbeddingsBody(RequestModel):
    """The body of ``POST /v1/embeddings`` (published as ``EmbeddingRequest``)."""

    model: str = Field(
        min_length=1, description="must equal the served model id (see `/v1/models`), else 404 `model_not_found`"
    )
    input: (
        _Text
        | Annotated[list[_Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | _Ids
        | Annotated[list[_Ids], Field(min_length=1, max_length=MAX_INPUTS)]
    ) = Field(
        description=f"a string, a list of up to {MAX_INPUTS} strings, a list of token ids, or a list of such lists; "
        "no input may be empty. Each is tokenized as the model's tokenizer does by default (special tokens "
        "added) and must fit the context"
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="`base64`: each vector as little-endian float32 bytes, base64 (what the OpenAI SDKs ask)"
    )
    dimensions: int | None = Field(
        None,
        ge=1,
        description="keep the first `dimensions` components (then normalize again): only for a model whose "
        "config says it was trained for it (`is_matryoshka` / `matryoshka_dimensions`), else a 400 unless it is "
        "the model's own size",
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        description="vLLM's: embed only the last N tokens of each input (left truncation); -1: as many as the "
        "context holds; 0 is refused",
    )
    user: str | None = Field(None, description="accepted; nothing else")
    priority: int = Field(
        0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="trillm's extension, as on chat: lower is served first"
    )

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be -1 or at least 1")
        return value

    def texts_or_ids(self) -> list[str] | list[list[int]]:
        value: Any = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]
        return list(value)


def parse_embeddings_request(body: Any) -> EmbeddingsBody:
    """A decoded JSON body -> ``EmbeddingsBody``, or a 400 ``ApiError`` naming the field."""
    result: EmbeddingsBody = parse(EmbeddingsBody, body)
    return result
