"""``POST /v1/chat/completions``: the prompt from the chat template, the reply's shapes.

Streaming and cancellation are shared with completions (``api/streaming.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import attrs

from trillm.api import logprobs
from trillm.api.endpoint import GenerationEndpoint
from trillm.api.errors import ApiError
from trillm.api.gateway import EngineHandle
from trillm.api.responses import new_completion_id, usage
from trillm.api.schemas.chat import ChatRequest, parse_chat_request
from trillm.api.submission import collect, submit_choices
from trillm.engine.outputs import RequestOutput
from trillm.engine.sampling_params import SamplingParams


def prompt_ids(engine: EngineHandle, req: ChatRequest) -> list[list[int]]:
    tok = engine.tokenizer
    if req.messages is not None:
        if not getattr(tok, "chat_template", None):
            raise ApiError("this model has no chat template; send 'prompt' instead", param="messages")
        text = tok.apply_chat_template(list(req.messages), add_generation_prompt=True, tokenize=False)
        return [tok(text, add_special_tokens=False)["input_ids"]]
    return [tok(req.prompt)["input_ids"]]


def _logprobs(engine: EngineHandle, params: SamplingParams, items: Any) -> dict[str, Any] | None:
    if params.logprobs is None:
        return None
    return {"content": logprobs.chat_content(engine.tokenizer, items)}


async def complete(
    engine: EngineHandle, model: str, req: ChatRequest, prompts: list[list[int]], deadline: float
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
                "message": {"role": "assistant", "content": done.texts[i]},
                "logprobs": _logprobs(engine, params, done.logprobs[i]),
                "finish_reason": done.last[i].finish_reason,
            }
            for i in range(n)
        ],
        "usage": usage(len(prompts[0]), sum(o.num_output_tokens for o in done.last), done.last[0].num_cached_tokens),
    }


@attrs.frozen
class ChatChunks:
    """A role chunk per choice, content chunks, then a finish chunk per choice."""

    engine: EngineHandle
    params: SamplingParams
    n: int
    object: str = "chat.completion.chunk"
    id_prefix: str = "chatcmpl"
    generates: bool = True

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
        if out.text or out.logprobs:
            yield self._choice(out.index, {"content": out.text}, None, out.logprobs)
        if out.finish_reason:
            yield self._choice(out.index, {}, out.finish_reason)

    def cut(self, index: int) -> dict[str, Any]:
        return self._choice(index, {}, "length")


ENDPOINT = GenerationEndpoint(
    parse=parse_chat_request,
    prompt_ids=prompt_ids,
    prompt_param=lambda req: "messages" if req.messages is not None else "prompt",
    complete=complete,
    renderer=lambda engine, req, prompts: ChatChunks(engine, req.common.params, req.common.n),
)
