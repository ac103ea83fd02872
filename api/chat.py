"""``POST /v1/chat/completions``: prompt building, SSE streaming and the one-shot reply.

Cancellation: a streaming reply is an async generator that Quart-Trio cancels
(``trio.Cancelled``) or closes (``GeneratorExit``) when the client goes away;
its ``finally`` closes the output channel and aborts the request with
synchronous calls only, so the scheduler frees the pages within one step.
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator

import trio

from api.chat_schema import ChatRequest
from api.errors import ApiError
from api.responses import new_completion_id, sse, usage
from engine.engine import Engine, EngineNotRunning, RequestOutput, RequestRejected
from engine.sampling_params import SamplingParams

log = logging.getLogger("trillm.api")


def prompt_ids(engine: Engine, req: ChatRequest) -> list[int]:
    tok = engine.tokenizer
    if req.messages is not None:
        if not getattr(tok, "chat_template", None):
            raise ApiError("this model has no chat template; send 'prompt' instead", param="messages")
        text = tok.apply_chat_template(list(req.messages), add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(req.prompt)["input_ids"]


def check_prompt(engine: Engine, ids: list[int], param: str) -> None:
    """Reject up front what the engine would reject, so the client gets a 400, not a broken stream."""
    try:
        engine.check_prompt(ids)
    except RequestRejected as exc:
        raise ApiError(str(exc), param=param, code=exc.code) from None


def submit(engine: Engine, ids: list[int], params: SamplingParams) -> tuple[str, trio.MemoryReceiveChannel[RequestOutput]]:
    try:
        return engine.submit(ids, params)
    except RequestRejected as exc:
        raise ApiError(str(exc), param=exc.param, code=exc.code) from None
    except EngineNotRunning:
        raise ApiError("the engine is not serving (starting or shutting down)", 503, code="engine_unavailable") from None


async def complete(engine: Engine, model: str, ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """Run to the end and return the ``chat.completion`` body.

    If the handler is cancelled (client gone, deadline), the request is aborted
    on the way out and its pages freed.
    """
    request_id, outputs = submit(engine, ids, params)
    text: list[str] = []
    last: RequestOutput | None = None
    try:
        with outputs:
            async for out in outputs:
                text.append(out.text)
                last = out
    finally:
        engine.abort(request_id)
    if last is None or last.finish_reason in ("abort", "error"):
        raise ApiError("the server stopped this request before it finished", 503, code="request_aborted")
    return {
        "id": new_completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(text)},
                "logprobs": None,
                "finish_reason": last.finish_reason,
            }
        ],
        "usage": usage(last.num_prompt_tokens, last.num_output_tokens),
    }


async def stream(
    engine: Engine, model: str, ids: list[int], params: SamplingParams, include_usage: bool
) -> AsyncIterator[bytes]:
    """Yield SSE events: a role chunk, content chunks, a finish chunk, [usage], [DONE]."""
    completion_id, created = new_completion_id(), int(time.time())

    def chunk(delta: dict[str, Any], finish_reason: str | None) -> bytes:
        body: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }
        if include_usage:
            body["usage"] = None
        return sse(body)

    try:
        request_id, outputs = submit(engine, ids, params)
    except ApiError as exc:
        yield sse(exc.body())
        yield sse("[DONE]")
        return
    try:
        with outputs:
            yield chunk({"role": "assistant", "content": ""}, None)
            last: RequestOutput | None = None
            async for out in outputs:
                last = out
                if out.text:
                    yield chunk({"content": out.text}, None)
            finish = last.finish_reason if last else "abort"
            yield chunk({}, finish)
            if include_usage:
                totals = usage(len(ids), last.num_output_tokens if last else 0)
                yield sse({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": [], "usage": totals})
            yield sse("[DONE]")
    except Exception as exc:  # a bug must end the stream cleanly, not cut the connection
        log.exception("stream failed")
        yield sse(ApiError(f"internal error: {type(exc).__name__}", 500).body())
        yield sse("[DONE]")
    finally:
        # Runs on normal end, on trio.Cancelled and on GeneratorExit alike; no awaits here.
        engine.abort(request_id)
