"""``POST /v1/chat/completions``: the prompt from the chat template, the reply's shapes.

Streaming and cancellation are shared with completions (``api/streaming.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, TypeVar

import attrs
from jinja2 import TemplateError

from trillm.api import logprobs
from trillm.api.endpoint import GenerationEndpoint, ServerContext
from trillm.api.errors import ApiError
from trillm.api.gateway import EngineHandle
from trillm.api.input_limits import check_text, message_texts
from trillm.api.reasoning import END, START, THINKING, ChoiceSplitter, request_style
from trillm.api.responses import new_completion_id, usage
from trillm.api.schemas.chat import ChatCompletionBody, ChatRequest, parse_chat_request
from trillm.api.submission import collect, submit_choices
from trillm.api.tools.formats import ToolFormat, choose
from trillm.api.tools.generic import Imitation
from trillm.api.tools.prompt import has_tool_turns, renders_tools, template_messages
from trillm.api.tools.stream import ToolStream
from trillm.engine import RequestOutput, SamplingParams

IMITATION = Imitation()


Req = TypeVar("Req", bound=ChatRequest)  # chat's, or a request served as chat (Responses, Messages)
TAGGED = ("deepseek_r1", "qwen3")  # the reasoning styles whose thinking sits between <think> tags


def bind(engine: EngineHandle, req: Req, ctx: ServerContext) -> Req:
    """Choose the tool-call format (setting, else the chat template) and, with tools, the
    grammar that forces or constrains calls (it takes the place of ``response_format``).
    Without tools, after tool turns the generic format rendered as text, a reply that imitates
    the generic JSON anyway is unwrapped.
    Under a reasoning parser, a grammar holds the answer only: the thinking before it is free."""
    if req.tools is not None:
        fmt = choose(ctx.tool_call_parser, getattr(engine.tokenizer, "chat_template", None))
        if req.common.grammar is not None:
            raise ApiError(
                "cannot be combined with 'tools' (they constrain the output themselves)", param=req.common.grammar[1]
            )
        grammar = fmt.grammar(req.tools)
        common = attrs.evolve(req.common, grammar=(grammar, "tools") if grammar is not None else None)
        req = attrs.evolve(req, common=common, tool_format=fmt)
    elif req.common.grammar is None and req.messages and has_tool_turns(req.messages):
        if not renders_tools(getattr(engine.tokenizer, "chat_template", None)):
            req = attrs.evolve(req, tool_format=IMITATION)  # unwrap a reply that imitates the generic JSON
    if req.prediction is not None:  # OpenAI's Predicted Outputs: speculation proposes from these tokens
        check_text(engine, [req.prediction], "prediction")
        predicted = tuple(engine.tokenizer(req.prediction, add_special_tokens=False)["input_ids"])
        params = attrs.evolve(req.common.params, prediction=predicted)
        req = attrs.evolve(req, common=attrs.evolve(req.common, params=params))
    style = request_style(ctx.reasoning_parser, req.chat_template_kwargs)
    if style == "gpt_oss":  # the harmony markers are special tokens: the parser reads them
        params = attrs.evolve(req.common.params, skip_special_tokens=False)
        req = attrs.evolve(req, common=attrs.evolve(req.common, params=params))
    if style in TAGGED and req.thinking_budget is not None:
        req = attrs.evolve(req, common=attrs.evolve(req.common, params=budgeted(engine, req, style)))
    if style is not None and req.common.grammar is not None:
        spec, param = req.common.grammar
        req = attrs.evolve(req, common=attrs.evolve(req.common, grammar=(spec.after_thinking(THINKING[style]), param)))
    return req


def budgeted(engine: EngineHandle, req: Req, style: str) -> SamplingParams:
    """The request's parameters with its thinking budget: counted from the first token (a template
    that opens ``<think>`` itself, ``deepseek_r1``) or from the ``<think>`` the reply opens with
    (``qwen3``); closed by ``</think>`` and the blank line templates put after it."""

    def ids(text: str) -> tuple[int, ...]:
        return tuple(engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    return attrs.evolve(
        req.common.params,
        thinking_budget=req.thinking_budget,
        thinking_start_ids=ids(START) if style == "qwen3" else (),
        thinking_end_ids=ids(END),
        thinking_after_ids=ids("\n\n"),
        speculative=False,
    )


def prompt_ids(engine: EngineHandle, req: ChatRequest) -> list[list[int]]:
    """The prompt's token ids: the chat template over the messages, or the raw prompt. Synchronous and
    slow for a big input: the app calls it in a worker thread."""
    tok = engine.tokenizer
    if req.messages is not None:
        template = getattr(tok, "chat_template", None)
        if not template:
            raise ApiError("this model has no chat template; send 'prompt' instead", param="messages")
        check_text(engine, message_texts(req.messages), "messages")  # before paying for the template
        fmt = req.tool_format or choose("auto", template)
        messages, tools = template_messages(template, list(req.messages), req.tools, fmt)
        extra = req.chat_template_kwargs or {}
        try:
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **extra)
        except TemplateError as exc:  # the template's own raise_exception, or a variable it cannot use
            param = "chat_template_kwargs" if extra else "messages"
            raise ApiError(f"the chat template failed: {exc}", param=param) from None
        except TypeError as exc:  # a name of apply_chat_template's own that a newer transformers added
            if not extra:
                raise
            raise ApiError(f"chat_template_kwargs: {exc}", param="chat_template_kwargs") from None
        return [tok(text, add_special_tokens=False)["input_ids"]]
    check_text(engine, [req.prompt or ""], "prompt")
    return [tok(req.prompt)["input_ids"]]


def _message(req: ChatRequest, parts: dict[str, Any], finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice from its split ``parts`` (content, and
    reasoning_content with a reasoning parser), with calls parsed out of the content when tools are on."""
    if req.tool_format is None:
        return {"role": "assistant", **parts}, finish_reason
    parsed = req.tool_format.parse(parts["content"] or "")
    message: dict[str, Any] = {"role": "assistant", **parts, "content": parsed.content}
    if parsed.calls and req.tools is not None and req.tools.legacy:  # OpenAI's older shape: one function_call
        message["function_call"] = {"name": parsed.calls[0].name, "arguments": parsed.calls[0].arguments}
        if finish_reason == "stop":
            finish_reason = "function_call"
    elif parsed.calls:
        message["tool_calls"] = [call.openai() for call in parsed.calls]
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return message, finish_reason


def finished_message(
    req: ChatRequest, text: str, finish_reason: str | None, reasoning_parser: str | None = None
) -> tuple[dict[str, Any], str | None]:
    """A finished choice's assistant message (thinking split off, calls parsed out) and its finish
    reason (``tool_calls`` where calls ended it); the Messages API writes it in its own shape."""
    return _message(req, _splitter(reasoning_parser, req).message(text), finish_reason)


def _prediction(params: SamplingParams, accepted: list[int]) -> tuple[int, int] | None:
    """(prediction tokens, accepted) for ``usage`` over the choices, where the request predicted."""
    if not params.prediction:
        return None
    return len(params.prediction) * len(accepted), sum(accepted)


def _logprobs(engine: EngineHandle, params: SamplingParams, items: Any) -> dict[str, Any] | None:
    if params.logprobs is None:
        return None
    return {"content": logprobs.chat_content(engine.tokenizer, items)}


async def complete(
    engine: EngineHandle,
    model: str,
    req: ChatRequest,
    prompts: list[list[int]],
    deadline: float,
    reasoning_parser: str | None = None,
) -> dict[str, Any]:
    """Run every choice to its end and return the ``chat.completion`` body.

    If the handler is cancelled (client gone, deadline), the requests are
    aborted on the way out and their pages freed.
    """
    params, n = req.common.params, req.common.n
    request_ids, outputs = submit_choices(engine, prompts, params, n)
    done = await collect(engine, request_ids, outputs, [""] * n, deadline)
    return {
        "id": new_completion_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": message,
                "logprobs": _logprobs(engine, params, done.logprobs[i]),
                "finish_reason": finish_reason,
            }
            for i in range(n)
            for message, finish_reason in [
                finished_message(req, done.texts[i], done.last[i].finish_reason, reasoning_parser)
            ]
        ],
        "usage": usage(
            len(prompts[0]),
            sum(o.num_output_tokens for o in done.last),
            done.last[0].num_cached_tokens,
            _prediction(params, [o.accepted_prediction_tokens for o in done.last]),
        ),
    }


@attrs.frozen
class ChatChunks:
    """A role chunk per choice, content chunks, then a finish chunk per choice."""

    engine: EngineHandle
    params: SamplingParams
    n: int
    split: ChoiceSplitter = attrs.field(factory=lambda: ChoiceSplitter(None))  # thinking vs answer
    tool_format: ToolFormat | None = None
    object: str = "chat.completion.chunk"
    streams: dict[int, ToolStream] = attrs.field(factory=dict)  # per choice, with tools
    id_prefix: str = "chatcmpl"
    generates: bool = True
    legacy: bool = False  # the request sent ``functions``: one call, as ``function_call`` deltas

    def _choice(self, index: int, delta: dict[str, Any], finish_reason: str | None, lps: Any = ()) -> dict[str, Any]:
        return {
            "index": index,
            "delta": delta,
            "logprobs": _logprobs(self.engine, self.params, lps) if lps else None,
            "finish_reason": finish_reason,
        }

    def opening(self) -> Iterable[dict[str, Any]]:
        return [self._choice(index, {"role": "assistant", "content": ""}, None) for index in range(self.n)]

    def pieces(self, out: RequestOutput) -> Iterable[dict[str, Any]]:
        delta = self.split.delta(out.index, out.text, bool(out.finish_reason))
        if self.tool_format is not None:
            yield from self._tool_pieces(out, delta)
            return
        if any(delta.values()) or out.logprobs:
            yield self._choice(out.index, delta, None, out.logprobs)
        if out.finish_reason:
            yield self._choice(out.index, {}, out.finish_reason)

    def _tool_pieces(self, out: RequestOutput, split: dict[str, str]) -> Iterable[dict[str, Any]]:
        """Reasoning as it comes; content until a call may start, then the calls as ``tool_calls`` deltas."""
        assert self.tool_format is not None
        stream = self.streams.setdefault(out.index, ToolStream(self.tool_format))
        deltas: list[dict[str, Any]] = (
            [{"reasoning_content": split["reasoning_content"]}] if split.get("reasoning_content") else []
        )
        deltas += stream.feed(split.get("content", ""))
        finish_reason = out.finish_reason
        if finish_reason:
            deltas += stream.finish()
            if stream.calls and finish_reason == "stop":
                finish_reason = "function_call" if self.legacy else "tool_calls"
        if self.legacy:
            deltas = [_legacy_delta(d) for d in deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]
        if out.logprobs and not deltas:
            deltas = [{"content": ""}]  # the tokens' logprobs, without their text (markup) yet
        for i, delta in enumerate(deltas):
            yield self._choice(out.index, delta, None, out.logprobs if i == 0 else ())
        if finish_reason:
            yield self._choice(out.index, {}, finish_reason)

    def cut(self, index: int) -> dict[str, Any]:
        return self._choice(index, self.split.flush(index), "length")


def _legacy_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A ``tool_calls`` delta of the first call in OpenAI's older shape (``function_call``)."""
    if "tool_calls" not in delta:
        return delta
    function = delta["tool_calls"][0]["function"]
    return {"function_call": {k: function[k] for k in ("name", "arguments") if k in function}}


def endpoint(reasoning_parser: str | None = None) -> GenerationEndpoint:
    """The chat endpoint; ``reasoning_parser`` (the server's setting) splits thinking from the answer."""
    return GenerationEndpoint(
        parse=parse_chat_request,
        prompt_ids=prompt_ids,
        prompt_param=lambda req: "messages" if req.messages is not None else "prompt",
        complete=lambda engine, model, req, prompts, deadline: complete(
            engine, model, req, prompts, deadline, reasoning_parser
        ),
        renderer=lambda engine, req, prompts: chunks(engine, req, reasoning_parser),
        bind=bind,
        schema=ChatCompletionBody,
    )


def chunks(engine: EngineHandle, req: ChatRequest, reasoning_parser: str | None = None) -> ChatChunks:
    """The stream's deltas of ``req`` (the Responses API translates them into its own events)."""
    legacy = req.tools is not None and req.tools.legacy
    return ChatChunks(
        engine, req.common.params, req.common.n, _splitter(reasoning_parser, req), req.tool_format, legacy=legacy
    )


def _splitter(reasoning_parser: str | None, req: ChatRequest) -> ChoiceSplitter:
    return ChoiceSplitter(request_style(reasoning_parser, req.chat_template_kwargs))
