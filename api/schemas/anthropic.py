"""The bodies of ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API).

A Messages call becomes a chat request (``MessagesBody.request``): ``system`` a
system message, ``tool_use`` blocks the assistant's tool calls, ``tool_result``
blocks tool messages, ``tools`` a ``ToolSet`` and ``thinking`` the reasoning
parser's switch. Generation, tool calls and the thinking split then run the chat
path; ``api/anthropic_api.py`` writes the result in Anthropic's shape.
Blocks this server cannot read (images, documents, server tools) are a 400 that
names them, never dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import attrs
from pydantic import Field, model_validator

from trillm.api.schemas.base import RequestModel, Unsupported, invalid
from trillm.api.schemas.chat import ChatRequest
from trillm.api.schemas.describe import parse
from trillm.api.schemas.generation import MAX_STOP_LENGTH, CommonFields
from trillm.api.schemas.tools import MAX_TOOLS, FunctionDefinition, tool_set_of
from trillm.api.tools.spec import ToolSet
from trillm.engine import MAX_PRIORITY, GrammarError, GrammarSpec, SamplingParams

MAX_STOP_SEQUENCES = 16
# The request blocks read here; any other ``type`` is a 400 naming it.
READ_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
TEXT_ONLY = "this server reads text, tool_use, tool_result and thinking blocks"
_NO_SERVER_TOOLS = "this server runs no tools itself: give custom tools (`name`, `description`, `input_schema`)"


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(None, description="accepted; the prefix cache is automatic")


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, description="answered by a `tool_result` with this `tool_use_id`")
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(description="the call's arguments")
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = Field(None, description="the tool's result: a string or text blocks")
    is_error: bool | None = Field(None, description="`true`: the result is an error message")
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        content = self.content or ""
        text = content if isinstance(content, str) else "\n".join(block.text for block in content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str = Field(description="an earlier turn's thinking: left out of the prompt, as Anthropic does")
    signature: str | None = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str | None = None


_Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[_Block] = Field(description="a string, or blocks")


class AnthropicTool(RequestModel):
    type: Literal["custom"] | None = Field(None, description="only custom tools (server tools are a 400)")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="letters, digits, `_`, `-`")
    description: str | None = Field(None, description="what the tool does; shown to the model")
    input_schema: dict[str, Any] = Field(description="a JSON Schema of the input object")
    cache_control: dict[str, Any] | None = None


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"] = Field(
        description="`auto`: the model decides; `any`: at least one call; `tool`: the tool `name`; `none`: no call. "
        "Forced calls are guaranteed by a grammar, as on chat"
    )
    name: str | None = Field(None, description="with `tool`: the tool to call")
    disable_parallel_tool_use: bool = Field(False, description="`true`: at most one call")


class ThinkingConfig(RequestModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"] = Field(
        description="`enabled` (and `adaptive`, `between_tools`): under `--reasoning-parser`, the model's thinking "
        "comes back as `thinking` blocks; `disabled`: the template's thinking is turned off "
        "(`enable_thinking: false`)"
    )
    budget_tokens: int | None = Field(
        None,
        ge=1024,
        description="with `enabled`: required, >= 1024 and < `max_tokens` (as Anthropic); not enforced "
        "separately: thinking counts toward `max_tokens`",
    )


class JsonOutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema the reply's text matches")


class OutputConfig(RequestModel):
    format: JsonOutputFormat | None = Field(
        None, description='`{"type": "json_schema", "schema"}`: the text is guaranteed to match (a grammar)'
    )
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = Field(None, description="accepted; nothing else")


class Metadata(RequestModel):
    user_id: str | None = Field(None, max_length=256, description="accepted; nothing else")


def _unreadable(body: Any) -> None:
    """A 400 naming the first block or tool this server cannot serve (before the typed checks,
    which would only say the type is not one of the known ones)."""
    if not isinstance(body, dict):
        return
    places: list[tuple[str, Any]] = []
    if isinstance(body.get("system"), list):
        places += [(f"system[{j}]", block) for j, block in enumerate(body["system"])]
    for i, message in enumerate(body.get("messages") or ()):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for j, block in enumerate(content):
                places.append((f"messages[{i}].content[{j}]", block))
                inner = block.get("content") if isinstance(block, dict) else None
                if isinstance(inner, list):
                    places += [(f"messages[{i}].content[{j}].content[{k}]", b) for k, b in enumerate(inner)]
    for where, block in places:
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in READ_BLOCKS:
            raise invalid(f"{kind!r} blocks are not supported ({TEXT_ONLY})", where)
    for i, tool in enumerate(body.get("tools") or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise invalid(f"the server tool {kind!r} is not supported ({_NO_SERVER_TOOLS})", f"tools[{i}]")


@attrs.frozen
class MessagesRequest(ChatRequest):
    """A Messages call as the chat request that serves it, with what its reply needs."""

    stop_sequences: tuple[str, ...] = ()
    prefill: str = ""  # a last assistant message's text: the reply continues it


class CountTokensBody(RequestModel):
    """The body of ``POST /v1/messages/count_tokens`` (published as ``CountTokensRequest``)."""

    model: str = Field(
        min_length=1, description="must equal the served model id (see `/v1/models`), else 404 `not_found_error`"
    )
    messages: list[AnthropicMessage] = Field(
        min_length=1,
        description='the conversation: `{"role": "user" | "assistant", "content"}`, content a string or blocks: '
        "`text`, `tool_use` (`id`, `name`, `input`), `tool_result` (`tool_use_id`, `content`, `is_error`) and "
        "`thinking` / `redacted_thinking` (left out of the prompt); other blocks (`image`, `document`, ...) are a "
        "400 naming them. Consecutive turns of one role are joined; a last `assistant` turn is a prefill the "
        "reply continues",
    )
    system: str | list[TextBlock] | None = Field(None, description="a system prompt: a string or text blocks")
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = Field(
        None,
        description=f"up to {MAX_TOOLS} custom tools `{{name, description, input_schema}}`; server tools "
        "(`web_search_...`, `bash_...`, ...) are a 400",
    )
    tool_choice: ToolChoice | None = Field(
        None,
        description='`{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}`; `auto` by '
        "default; `any` (at least one call) and `tool` (that one) are guaranteed by a grammar",
    )
    thinking: ThinkingConfig | None = Field(
        None,
        description='`{"type": "enabled", "budget_tokens"}` (>= 1024, < `max_tokens`), `adaptive` or `between_tools`:'
        " the template thinks, and under `--reasoning-parser` the thinking comes back as `thinking` blocks, "
        "`budget_tokens` of it at most (then `</think>` is forced and the answer follows); "
        '`{"type": "disabled"}`: no thinking (`enable_thinking: false`). Absent: the template\'s default',
    )
    mcp_servers: (
        Annotated[list[Any], Unsupported("MCP servers are not supported: give the tools in 'tools'")] | None
    ) = Field(None, description="not supported: a 400")

    @model_validator(mode="before")
    @classmethod
    def _check_blocks(cls, body: Any) -> Any:
        _unreadable(body)
        return body

    @model_validator(mode="after")
    def _check_messages(self) -> CountTokensBody:
        for i, message in enumerate(self.messages):
            _check_turn(message, f"messages[{i}].content")
        self.tool_set()
        self.chat_messages()
        return self

    def tool_set(self) -> ToolSet | None:
        choice = self.tool_choice
        kind = {"any": "required", "tool": choice.name} if choice is not None else {}
        named = None if choice is None else kind.get(choice.type, choice.type)
        if choice is not None and choice.type == "tool" and not choice.name:
            raise invalid('`{"type": "tool"}` needs the tool\'s `name`', "tool_choice")
        defs = [
            FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema, strict=None)
            for t in self.tools or ()
        ]
        parallel = choice is None or not choice.disable_parallel_tool_use
        return tool_set_of(defs, named, "tool_choice", parallel)

    def thinking_kwargs(self) -> dict[str, Any] | None:
        """The chat template's switch: ``disabled`` turns thinking off, the others on."""
        if self.thinking is None:
            return None
        return {"enable_thinking": self.thinking.type != "disabled"}

    def chat_messages(self) -> tuple[tuple[dict[str, Any], ...], str]:
        """The chat messages, and the prefill: the text of a last assistant turn (without tool calls)."""
        out: list[dict[str, Any]] = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else "\n\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": text})
        for message in self.messages:
            content = message.content
            blocks: list[Any] = (
                [TextBlock(type="text", text=content, cache_control=None)]
                if isinstance(content, str)
                else list(content)
            )
            out += _turn(message.role, blocks, out[-1] if out else None)
        prefill = ""
        last = out[-1]
        if last["role"] == "assistant" and not last.get("tool_calls"):
            prefill = last["content"] or ""
            out.pop()
        if not any(m["role"] in ("user", "tool") for m in out):
            raise invalid("needs a user turn (a last assistant turn is a prefill the reply continues)", "messages")
        return tuple(out), prefill


def _check_turn(message: AnthropicMessage, param: str) -> None:
    """What Anthropic refuses in a turn: a user turn with nothing in it, an empty text block there,
    a ``tool_use`` block outside an assistant turn and a ``tool_result`` outside a user turn."""
    content = message.content
    blocks = [] if isinstance(content, str) else content
    if message.role == "user":
        if not content or any(isinstance(b, TextBlock) and not b.text for b in blocks):
            raise invalid("a user turn's content and its text blocks must not be empty", param)
        if any(isinstance(b, ToolUseBlock) for b in blocks):
            raise invalid("`tool_use` blocks belong to assistant turns (their results go in user turns)", param)
    elif any(isinstance(b, ToolResultBlock) for b in blocks):
        raise invalid("`tool_result` blocks belong to user turns", param)


def _turn(role: str, blocks: list[Any], before: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results become tool messages (before
    its text), an assistant turn's ``tool_use`` blocks its calls. A turn of the role before it
    joins that message, as Anthropic joins consecutive turns."""
    texts = [b.text for b in blocks if isinstance(b, TextBlock)]
    new: list[dict[str, Any]] = []
    if role == "user":
        new += [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
            for b in blocks
            if isinstance(b, ToolResultBlock)
        ]
        if texts or not new:
            new.append({"role": "user", "content": "\n\n".join(texts)})
    else:
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        new.append(message)
    first = new[0]
    if before is not None and before["role"] == first["role"] and first["role"] in ("user", "assistant"):
        if first["content"]:
            before["content"] = "\n\n".join(filter(None, [before["content"], first["content"]]))
        if first.get("tool_calls"):
            before["tool_calls"] = [*before.get("tool_calls", ()), *first["tool_calls"]]
        new = new[1:]
    return new


class MessagesBody(CountTokensBody):
    """The body of ``POST /v1/messages`` (published as ``MessagesRequest``)."""

    max_tokens: int = Field(
        ge=1,
        description="required, as Anthropic requires it: most tokens to generate (thinking included); past the "
        'context it is a 400. Cut short: `stop_reason: "max_tokens"`',
    )
    temperature: float = Field(1.0, ge=0.0, le=1.0, description="0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="sample from the `top_k` likeliest tokens; 0 or absent: all")
    stop_sequences: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]], Field(max_length=MAX_STOP_SEQUENCES)
        ]
        | None
    ) = Field(
        None,
        description=f"up to {MAX_STOP_SEQUENCES} strings that end the reply (not included); the one found is the "
        '`stop_sequence` of a `stop_reason: "stop_sequence"` reply',
    )
    stream: bool = Field(False, description="Server-Sent Events in Anthropic's event sequence (see below)")
    metadata: Metadata | None = Field(None, description="`{user_id}`: accepted")
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="accepted; one tier here")
    output_config: OutputConfig | None = Field(None, description="`{format, effort}`: structured output")
    priority: int = Field(
        0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="trillm's extension, as on chat: lower is served first"
    )

    @model_validator(mode="after")
    def _check_thinking(self) -> MessagesBody:
        self.grammar()
        thinking = self.thinking
        if thinking is not None and thinking.type == "enabled":
            if thinking.budget_tokens is None:
                raise invalid('`{"type": "enabled"}` needs `budget_tokens`', "thinking.budget_tokens")
            if thinking.budget_tokens >= self.max_tokens:
                raise invalid("`budget_tokens` must be less than `max_tokens`", "thinking.budget_tokens")
        return self

    def grammar(self) -> tuple[GrammarSpec, str] | None:
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is None:
            return None
        try:
            return GrammarSpec.json_schema(fmt.schema_), "output_config.format"
        except GrammarError as exc:
            raise invalid(str(exc), "output_config.format") from None

    def request(self) -> MessagesRequest:
        params = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or -1,
            max_tokens=self.max_tokens,
            stop=tuple(self.stop_sequences or ()),
            priority=self.priority,
        )
        common = CommonFields(self.model, params, self.stream, False, 1, True, self.grammar())
        messages, prefill = self.chat_messages()
        return MessagesRequest(
            common,
            messages,
            None,
            chat_template_kwargs=self.thinking_kwargs(),
            tools=self.tool_set(),
            stop_sequences=params.stop,
            prefill=prefill,
            thinking_budget=self.thinking.budget_tokens
            if self.thinking is not None and self.thinking.type == "enabled"
            else None,
        )


def parse_messages_request(body: Any) -> MessagesRequest:
    """A decoded JSON body -> ``MessagesRequest``, or a 400 ``ApiError`` naming the field."""
    return parse(MessagesBody, body).request()


def count_tokens_request(body: Any) -> MessagesRequest:
    """The chat request whose prompt ``count_tokens`` counts (``max_tokens`` 1: nothing is generated)."""
    parsed = parse(CountTokensBody, body)
    messages, prefill = parsed.chat_messages()
    common = CommonFields(parsed.model, SamplingParams(max_tokens=1), False, False, 1, True)
    return MessagesRequest(
        common, messages, None, chat_template_kwargs=parsed.thinking_kwargs(), tools=parsed.tool_set(), prefill=prefill
    )


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as ``tool_use``'s ``input`` object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
