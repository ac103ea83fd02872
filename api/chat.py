"""``POST /v1/chat/completions``: prompt building, SSE streaming and the one-shot reply.

Cancellation: a streaming reply is an async generator that Quart-Trio cancels
(``trio.Cancelled``) or closes (``GeneratorExit``) when the client goes away;
its ``finally`` closes the output channel and aborts the request with
synchronous calls only, so the scheduler frees the pages within one step.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from trillm.api.chat_schema import ChatRequest
from trillm.api import logprobs
from trillm.api.errors import ApiError
from trillm.api.responses import new_completion_id, sse, stream_end, stream_failure, usage
from trillm.api.submission import ChoiceProgress, RequestTimedOut, abort_all, collect, receive_until, submit_choices
from trillm.engine.engine import Engine
from trillm.engine.sampling_params import SamplingParams

def prompt_ids(engine: Engine, req: ChatRequest) -> list[int]:
    tok = engine.tokenizer
    if req.messages is not None:
        if not getattr(tok, "chat_template", None):
            raise ApiError("this model has no chat template; send 'prompt' instead", param="messages")
        text = tok.apply_chat_template(list(req.messages), add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(req.prompt)["input_ids"]


def _logprobs(engine: Engine, params: SamplingParams, items: Any) -> dict[str, Any] | None:
    if params.logprobs is None:
        return None
    return {"content": logprobs.chat_content(engine.tokenizer, items)}


async def complete(
    engine: Engine, model: str, ids: list[int], params: SamplingParams, n: int, deadline: float
) -> dict[str, Any]:
    """Run every choice to its end and return the ``chat.completion`` body.

    If the handler is cancelled (client gone, deadline), the requests are
    aborted on the way out and their pages freed.
    """
    request_ids, outputs = submit_choices(engine, [ids], params, n)
    done = await collect(engine, request_ids, outputs, [""] * n, deadline)
    return {
        "id": new_completion_id(),
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
        "usage": usage(len(ids), sum(o.num_output_tokens for o in done.last), done.last[0].num_cached_tokens),
    }


async def stream(
    engine: Engine, model: str, ids: list[int], params: SamplingParams, n: int, include_usage: bool, deadline: float
) -> AsyncIterator[bytes]:
    """SSE: a role chunk per choice, content chunks, a finish chunk per choice, [usage], [DONE].

    At the deadline every unfinished choice gets a final chunk with
    ``finish_reason: "length"`` and the stream ends normally.
    """
    completion_id, created = new_completion_id(), int(time.time())

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None, lps: Any = ()) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": _logprobs(engine, params, lps) if lps else None,
                  "finish_reason": finish_reason}
        body: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        return sse(body)

    try:
        request_ids, outputs = submit_choices(engine, [ids], params, n)
    except ApiError as exc:
        yield sse(exc.body())
        yield sse("[DONE]")
        return
    try:
        with outputs:
            for index in range(n):
                yield chunk(index, {"role": "assistant", "content": ""}, None)
            progress = ChoiceProgress(n)
            try:
                while (out := await receive_until(outputs, deadline)) is not None:
                    progress.record(out)
                    if out.text or out.logprobs:
                        yield chunk(out.index, {"content": out.text}, None, out.logprobs)
                    if out.finish_reason:
                        yield chunk(out.index, {}, out.finish_reason)
            except RequestTimedOut:
                for index in progress.unfinished():
                    yield chunk(index, {}, "length")
            totals = usage(len(ids), sum(progress.generated), progress.cached[0]) if include_usage else None
            for event in stream_end("chat.completion.chunk", completion_id, created, model, totals):
                yield event
    except Exception as exc:
        for event in stream_failure(exc):
            yield event
    finally:
        # Runs on normal end, on trio.Cancelled and on GeneratorExit alike; no awaits here.
        abort_all(engine, request_ids)
