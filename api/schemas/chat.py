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
    thinking_budget: int | None = None  # tokens of thinking before it is closed (``chat.bind``)


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# What each effort is passed to a template as: ``reasoning_effort`` (gpt-oss's names) and, for the
# two that mean "do not think", ``enable_thinking: false`` (Qwen3's switch).
_EFFORT_TEMPLATE = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}


def with_effort(kwargs: dict[str, Any] | None, effort: str | None) -> dict[str, Any] | None:
    """The chat template's variables with OpenAI's ``reasoning_effort`` (the caller's own win)."""
    if effort is None:
        return kwargs
    derived: dict[str, Any] = {"reasoning_effort": _EFFORT_TEMPLATE[effort]}
    if effort in ("none", "minimal"):
        derived["enable_thinking"] = False
    return {**derived, **(kwargs or {})}


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
    reasoning_effort: Effort | None = Field(
        None,
        description="how hard a reasoning model thinks, through its chat template: `reasoning_effort` is passed to "
        "it (gpt-oss's reads low / medium / high; `xhigh` is passed as `high`), and `none` / `minimal` also turn "
        "thinking off (`enable_thinking: false`, as Qwen3's templates read it, passed as `low`); templates that "
        "read neither ignore it. `chat_template_kwargs` win where they set the same names",
    )
    thinking_budget: int | None = Field(
        None,
        ge=0,
        description="trillm's extension (Anthropic's `budget_tokens`, SGLang's thinking budget): under a "
        "`--reasoning-parser` with `<think>` tags, after this many tokens of thinking the reply is made to close it "
        "(`</think>` forced) and the answer follows. Such a request is not speculated on",
    )
    verbosity: Literal["low", "medium", "high"] | None = Field(
        None,
        description="accepted, not honoured: no template here reads it (the reply is as long as the model makes it)",
    )
    modalities: list[Literal["text", "audio"]] | None = Field(
        None, description='`["text"]`; asking for `audio` is a 400: replies are text only'
    )
    audio: dict[str, Any] | None = Field(None, description="audio output parameters: a 400 (replies are text only)")
    web_search_options: dict[str, Any] | None = Field(
        None, description="a 400: this server searches nothing (give function tools in `tools`)"
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
        if "audio" in (self.modalities or ()):
            raise invalid("audio output is not supported: replies are text only (ask for ['text'])", "modalities")
        if self.audio is not None:
            raise invalid("audio output is not supported: replies are text only", "audio")
        if self.web_search_options is not None:
            raise invalid(
                "web search is not supported: this server searches nothing (give function tools in 'tools')",
                "web_search_options",
            )
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
        kwargs = with_effort(self.chat_template_kwargs, self.reasoning_effort)
        return ChatRequest(
            common,
            messages,
            self.prompt,
            kwargs,
            tools,
            prediction=prediction or None,
            thinking_budget=self.thinking_budget,
        )


def parse_chat_request(body: Any) -> ChatRequest:
    """A decoded JSON body -> ``ChatRequest``, or a 400 ``ApiError`` naming the field."""
    return parse(ChatCompletionBody, body).request()
