"""The body of ``POST /v1/chat/completions``: messages (or a raw prompt) plus the shared fields."""

from __future__ import annotations

from typing import Any, Literal

import attrs
from pydantic import Field, model_validator

from trillm.api.errors import ApiError
from trillm.api.schemas.base import RequestModel, invalid
from trillm.api.schemas.describe import parse
from trillm.api.schemas.generation import CommonFields, GenerationBody
from trillm.api.schemas.messages import MESSAGES_DESCRIPTION, AnyMessage, Content, text_of
from trillm.api.schemas.tools import ToolFields
from trillm.api.tools.formats import ToolFormat
from trillm.api.tools.spec import ToolSet

MAX_TOP_LOGPROBS = 20
# apply_chat_template's own parameters (and the template's ``messages``): template variables
# of these names would override what the server passes, or change what the call returns.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "self",
        "conversation",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "chat_template",
        "tools",
        "documents",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


@attrs.frozen
class ChatRequest:
    """A validated chat request in the terms the handler uses."""

    common: CommonFields
    messages: tuple[dict[str, Any], ...] | None
    prompt: str | None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: ToolSet | None = None
    tool_format: ToolFormat | None = None  # decided by ``chat.bind`` from the template and the settings
    prediction: str | None = None  # Predicted Outputs' text, tokenized by ``chat.bind``


class PredictedOutput(RequestModel):
    type: Literal["content"] = Field(description='only `"content"`, as OpenAI')
    content: Content = Field(description="the expected text: a string, or text parts")


class ChatCompletionBody(GenerationBody, ToolFields):
    """The body of ``POST /v1/chat/completions`` (published as ``ChatCompletionRequest``)."""

    messages: list[AnyMessage] | None = Field(None, min_length=1, description=MESSAGES_DESCRIPTION)
    prompt: str | None = Field(
        None, description="raw text, no chat template; give exactly one of `messages` / `prompt`"
    )
    logprobs: bool = Field(
        False,
        description="return log-probabilities: `choices[].logprobs.content[]` = `{token, logprob, bytes, "
        "top_logprobs[]}`, one entry per generated token (the EOS token included, although it "
        "adds no text); streamed chunks carry the entries of their tokens",
    )
    top_logprobs: int = Field(
        0, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token; only with `logprobs: true`"
    )
    prediction: PredictedOutput | None = Field(
        None,
        description="OpenAI's Predicted Outputs: text the reply is expected to repeat largely (a file being edited). "
        "Speculative decoding proposes its tokens, and the model keeps those it agrees with, so the reply is what it "
        "would be without it, sooner; `usage.completion_tokens_details` then counts `accepted_prediction_tokens` "
        "(verified into the reply) and `rejected_prediction_tokens` (the rest). No effect with "
        "`--speculative off` or `speculative: false`",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description='extra variables for the chat template, e.g. `{"enable_thinking": false}` (with a raw `prompt` '
        "there is no template, but `enable_thinking: false` still turns the reasoning parser off); names the "
        "server passes itself (`add_generation_prompt`, `tokenize`, `tools`, ...) are a 400",
    )

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionBody:
        if (self.messages is None) == (self.prompt is None):
            raise invalid("give exactly one of 'messages' or 'prompt'", "messages")
        if "top_logprobs" in self.model_fields_set and not self.logprobs:
            raise invalid("needs 'logprobs': true", "top_logprobs")
        if self.chat_template_kwargs is not None:
            taken = sorted(RESERVED_TEMPLATE_KWARGS & self.chat_template_kwargs.keys())
            if taken:
                raise invalid(f"{', '.join(taken)} cannot be set here: the server passes it", "chat_template_kwargs")
        return self

    def request(self) -> ChatRequest:
        common = self.common()
        if self.logprobs:
            common = attrs.evolve(common, params=attrs.evolve(common.params, logprobs=self.top_logprobs))
        messages = None if self.messages is None else tuple(m.for_template() for m in self.messages)
        tools = self.tool_set()
        if tools is not None and self.prompt is not None:
            raise ApiError("'tools' need 'messages' (a raw 'prompt' has no template)", param="tools")
        prediction = None if self.prediction is None else text_of(self.prediction.content)
        return ChatRequest(
            common, messages, self.prompt, self.chat_template_kwargs, tools, prediction=prediction or None
        )


def parse_chat_request(body: Any) -> ChatRequest:
    """A decoded JSON body -> ``ChatRequest``, or a 400 ``ApiError`` naming the field."""
    return parse(ChatCompletionBody, body).request()
