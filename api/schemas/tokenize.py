"""The bodies of ``POST /tokenize`` and ``POST /detokenize`` (vLLM-compatible)."""

from __future__ import annotations

from pydantic import Field, model_validator

from trillm.api.schemas.base import RequestModel, invalid
from trillm.api.schemas.generation import TokenId
from trillm.api.schemas.messages import MESSAGES_DESCRIPTION, AnyMessage

_MODEL = "if given, must be the served model (else 404)"


class TokenizeBody(RequestModel):
    """The body of ``POST /tokenize`` (published as ``TokenizeRequest``)."""

    model: str | None = Field(None, description=_MODEL)
    prompt: str | None = Field(None, description="text to tokenize; give exactly one of `prompt` / `messages`")
    messages: list[AnyMessage] | None = Field(
        None,
        min_length=1,
        description=MESSAGES_DESCRIPTION + "; tokenized with "
        "the chat template (the count equals chat `usage.prompt_tokens`)",
    )
    add_special_tokens: bool = Field(True, description="with `prompt`: add the tokenizer's special tokens")
    add_generation_prompt: bool = Field(True, description="with `messages`: end with the assistant's turn header")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if self.messages is not None and self.prompt is not None:
            raise invalid("give exactly one of 'messages' or 'prompt'", "messages")
        if self.messages is None and self.prompt is None:
            raise invalid("give 'prompt' (a string) or 'messages'", "prompt")
        return self


class DetokenizeBody(RequestModel):
    """The body of ``POST /detokenize`` (published as ``DetokenizeRequest``)."""

    model: str | None = Field(None, description=_MODEL)
    tokens: list[TokenId] = Field(description="token ids to decode")
