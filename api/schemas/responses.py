"""The body of ``POST /v1/responses`` (OpenAI's Responses API, served statelessly).

The request is turned into a chat request (``ResponsesBody.request``): the input
items become chat messages, the function tools a ``ToolSet``, ``text.format`` the
output constraint. Generation, tool calls and reasoning then run the chat path;
``api/responses_api.py`` writes the result in the Responses shape.
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

import attrs
from pydantic import Discriminator, Field, Tag, model_validator
from pydantic.fields import FieldInfo

from trillm.api.schemas.base import RequestModel, Unsupported, invalid
from trillm.api.schemas.chat import ChatRequest, Effort, with_effort
from trillm.api.schemas.describe import parse
from trillm.api.schemas.generation import CommonFields, GenerationBody
from trillm.api.schemas.messages import AssistantMessage, FunctionCall, ToolCall, ToolMessage
from trillm.api.schemas.structured import JsonObjectFormat, JsonSchema, TextFormat
from trillm.api.schemas.tools import MAX_TOOLS, FunctionDefinition, tool_set_of
from trillm.api.tools.spec import ToolSet
from trillm.engine import GrammarError, GrammarSpec, SamplingParams

MAX_METADATA = 16
NO_STATE = "this server keeps no responses (stateless): send the whole conversation in 'input'"


def _shared(name: str) -> Any:
    """A field declared once for chat and completions, reused here as it is."""
    field: FieldInfo = copy.copy(GenerationBody.model_fields[name])
    return field


def _invalid_item(message: str) -> dict[str, Any]:
    return {
        "custom_error_type": "invalid",
        "custom_error_message": "{message}",
        "custom_error_context": {"message": message, "param": None},
    }


class TextContent(RequestModel):
    type: Literal["input_text", "output_text"] = Field(
        description="text parts only (`input_image`, `input_file`, ... are a 400)"
    )
    text: str


_Content = str | list[TextContent]


def _text(content: _Content) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(RequestModel):
    type: Literal["message"] = Field("message", description="may be left out")
    role: Literal["user", "system", "developer", "assistant"] = Field(description="`developer` is `system`")
    content: _Content = Field(description='a string or `{"type": "input_text" | "output_text", "text"}` parts')

    def for_template(self) -> dict[str, Any]:
        return {"role": "system" if self.role == "developer" else self.role, "content": _text(self.content)}


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, description="answered by a `function_call_output` with the same id")
    name: str = Field(min_length=1)
    arguments: str = Field(description="the arguments as a JSON text, as the response gave them")

    def for_template(self) -> dict[str, Any]:
        call = ToolCall(id=self.call_id, function=FunctionCall(name=self.name, arguments=self.arguments))
        return AssistantMessage(role="assistant", content=None, tool_calls=[call]).for_template()


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: _Content = Field(description="the function's result")

    def for_template(self) -> dict[str, Any]:
        return ToolMessage(role="tool", content=_text(self.output), tool_call_id=self.call_id).for_template()


class ReasoningItem(RequestModel):
    type: Literal["reasoning"] = Field(description="an earlier response's thinking; left out of the prompt")


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


_Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Field(
        discriminator=Discriminator(
            _item_kind,
            **_invalid_item(
                'must be a message (`{"role", "content"}`) or an item of type function_call, '
                "function_call_output or reasoning"
            ),
        )
    ),
]
_Input = Annotated[
    Annotated[str, Tag("text")] | Annotated[Annotated[list[_Item], Field(min_length=1)], Tag("items")],
    Field(discriminator=Discriminator(lambda v: "text" if isinstance(v, str) else "items")),
]


class FunctionTool(FunctionDefinition):
    type: Literal["function"] = Field(description="only function tools")


_Tool = Annotated[FunctionTool, Field(discriminator="type")]


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: str


class JsonSchemaTextFormat(JsonSchema):
    type: Literal["json_schema"] = Field(description="JSON matching `schema`")


_TextFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaTextFormat, Field(discriminator="type")]


class ReasoningConfig(RequestModel):
    effort: Effort | None = Field(None, description="as chat's `reasoning_effort`")
    summary: str | None = Field(None, description="accepted; thinking comes back whole, as a reasoning item")


class TextConfig(RequestModel):
    format: _TextFormat | None = Field(
        None,
        description='`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "name", "schema", '
        '"strict"}`: the output is guaranteed to match, as `response_format` on chat',
    )


@attrs.frozen
class ResponsesRequest(ChatRequest):
    """A Responses call as the chat request that serves it, with what the response echoes back."""

    echo: dict[str, Any] = attrs.field(factory=dict)


class ResponsesBody(RequestModel):
    """The body of ``POST /v1/responses`` (published as ``ResponsesRequest``)."""

    model: str = _shared("model")
    input: _Input = Field(
        description='a string (one user message) or a list of items: messages `{"role", "content"}` (role `user`, '
        "`system`, `developer` or `assistant`; content a string or `input_text` / `output_text` parts), "
        '`{"type": "function_call", "call_id", "name", "arguments"}`, `{"type": "function_call_output", '
        '"call_id", "output"}`, and `{"type": "reasoning"}` items (dropped); a response\'s `output` items can be '
        "sent back as they are"
    )
    instructions: str | None = Field(None, description="a system message put before the input")
    max_output_tokens: int | None = Field(
        None,
        ge=1,
        description="most tokens to generate (thinking included); past the context it is a 400; not given: "
        "until the model stops or the context is full (`--default-max-tokens` caps that), as chat without "
        '`max_tokens`. Cut short: `status: "incomplete"`',
    )
    temperature: float = _shared("temperature")
    top_p: float = _shared("top_p")
    priority: int = _shared("priority")
    stream: bool = Field(False, description="Server-Sent Events, typed as OpenAI sends them (see below)")
    tools: Annotated[list[_Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None,
        description=f'up to {MAX_TOOLS} `{{"type": "function", "name", "description", "parameters", "strict"}}`; '
        "built-in tools (`web_search`, `file_search`, ...) are a 400",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = Field(
        None,
        description='`"auto"` (the default), `"required"` (at least one call), `{"type": "function", "name"}` '
        '(that function), `"none"`; forced calls are guaranteed by a grammar, as on chat',
    )
    parallel_tool_calls: bool = Field(True, description="`false`: at most one call per response")
    text: TextConfig | None = Field(None, description='`{"format": ...}`: structured output')
    reasoning: ReasoningConfig | None = Field(
        None, description="`{effort}`: passed to the chat template, as chat's `reasoning_effort`"
    )
    prompt_cache_key: str | None = Field(None, max_length=1024, description="as on chat: a `--dp` routing key")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="accepted; one tier here"
    )
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=MAX_METADATA)] | None = (
        Field(None, description=f"up to {MAX_METADATA} string pairs, echoed in the response")
    )
    user: str | None = Field(None, description="accepted and echoed; nothing else")
    store: bool | None = Field(
        None,
        description="accepted, but nothing is stored: the response says `store: false` and cannot be "
        "fetched or continued later",
    )
    previous_response_id: Annotated[str, Unsupported(NO_STATE)] | None = Field(
        None, description="not supported (nothing is stored): a 400"
    )
    conversation: Annotated[str | dict[str, Any], Unsupported(NO_STATE)] | None = Field(
        None, description="not supported (nothing is stored): a 400"
    )
    background: Annotated[bool, Unsupported("background responses need stored state: use stream")] | None = Field(
        None, description="`true` is a 400"
    )

    @model_validator(mode="after")
    def _check_responses(self) -> ResponsesBody:
        self.tool_set()
        self.grammar()
        if not self.messages():
            raise invalid("holds nothing for the prompt (reasoning items are left out)", "input")
        return self

    def tool_set(self) -> ToolSet | None:
        choice = self.tool_choice.name if isinstance(self.tool_choice, NamedFunction) else self.tool_choice
        return tool_set_of(list(self.tools or ()), choice, "tool_choice", self.parallel_tool_calls)

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        fmt = self.text.format if self.text is not None else None
        try:
            if isinstance(fmt, JsonObjectFormat):
                return GrammarSpec.json_object(), "text.format"
            if isinstance(fmt, JsonSchemaTextFormat):
                return GrammarSpec.json_schema(fmt.schema_), "text.format"
        except GrammarError as exc:
            raise invalid(str(exc), "text.format") from None
        return None

    def messages(self) -> tuple[dict[str, Any], ...]:
        """The chat messages: the instructions as a system message, then each item; calls that
        follow an assistant turn join it, as one chat turn carries text and tool calls."""
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        items: list[Any] = []
        if isinstance(self.input, str):
            items.append(MessageItem(type="message", role="user", content=self.input))
        else:
            items.extend(self.input)
        for item in items:
            if isinstance(item, ReasoningItem):
                continue
            message = item.for_template()
            last = out[-1] if out else None
            if isinstance(item, FunctionCallItem) and last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*last.get("tool_calls", ()), *message["tool_calls"]]
                continue
            out.append(message)
        return tuple(out)

    def echo(self) -> dict[str, Any]:
        """The request fields every response object repeats."""
        dumped = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        fmt = dumped.get("text", {}).get("format", {"type": "text"})
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": self.temperature,
            "text": {"format": fmt},
            "tool_choice": dumped.get("tool_choice", "auto"),
            "tools": dumped.get("tools", []),
            "top_p": self.top_p,
            "user": self.user,
        }

    def request(self) -> ResponsesRequest:
        given = self.max_output_tokens is not None
        params = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_output_tokens,
            priority=self.priority,
            prompt_cache_key=self.prompt_cache_key,
        )
        common = CommonFields(
            self.model, params, self.stream, False, 1, given, self.grammar(), max_tokens_param="max_output_tokens"
        )
        effort = self.reasoning.effort if self.reasoning is not None else None
        kwargs = with_effort(None, effort)
        return ResponsesRequest(
            common, self.messages(), None, chat_template_kwargs=kwargs, tools=self.tool_set(), echo=self.echo()
        )


def parse_responses_request(body: Any) -> ResponsesRequest:
    """A decoded JSON body -> ``ResponsesRequest``, or a 400 ``ApiError`` naming the field."""
    return parse(ResponsesBody, body).request()
