"""``POST /v1/completions``: one choice per prompt, all sharing one engine channel.

Cancellation works as for chat: leaving the handler or the SSE generator
closes the shared channel and aborts every choice synchronously.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from trillm.api.completion_schema import CompletionRequest
from trillm.api import logprobs
from trillm.api.errors import ApiError
from trillm.api.responses import new_completion_id, sse, stream_end, stream_failure, usage
from trillm.api.submission import ChoiceProgress, RequestTimedOut, abort_all, collect, receive_until, submit_choices
from trillm.engine.engine import Engine
from trillm.engine.execution.sampler import TokenLogprobs

def prompt_ids(engine: Engine, req: CompletionRequest) -> list[list[int]]:
    tok = engine.tokenizer
    return [list(p) if isinstance(p, tuple) else tok(p)["input_ids"] for p in req.prompts]


def _logprobs(engine: Engine, req: CompletionRequest, items: list[TokenLogprobs], offset: int) -> Any:
    if req.common.params.logprobs is None:
        return None
    return logprobs.legacy(engine.tokenizer, items, offset)


def _echo_texts(engine: Engine, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    if not req.echo:
        return [""] * len(prompts)
    return [p if isinstance(p, str) else engine.tokenizer.decode(ids) for p, ids in zip(req.prompts, prompts)]


async def complete(
    engine: Engine, model: str, req: CompletionRequest, prompts: list[list[int]], deadline: float
) -> dict[str, Any]:
    """Run every choice to its end and return the ``text_completion`` body."""
    request_ids, outputs = submit_choices(engine, prompts, req.common.params, req.common.n)
    echoes = [echo for echo in _echo_texts(engine, req, prompts) for _ in range(req.common.n)]
    done = await collect(engine, request_ids, outputs, echoes, deadline)
    return {
        "id": new_completion_id(),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": done.texts[i], "logprobs": _logprobs(engine, req, done.logprobs[i], 0),
             "finish_reason": done.last[i].finish_reason}
            for i in range(len(done.texts))
        ],
        "usage": usage(sum(len(p) for p in prompts), sum(o.num_output_tokens for o in done.last),
                       sum(o.num_cached_tokens for o in done.last[:: req.common.n])),
    }


async def stream(
    engine: Engine, model: str, req: CompletionRequest, prompts: list[list[int]], deadline: float
) -> AsyncIterator[bytes]:
    """SSE: [echoed prompts], text pieces as they come, a finish chunk per choice, [usage], [DONE].

    At the deadline every unfinished choice gets a final chunk with ``finish_reason: "length"``.
    """
    completion_id, created = new_completion_id(), int(time.time())
    include_usage = req.common.include_usage

    offsets: dict[int, int] = {}  # characters sent so far per choice, for text_offset

    def chunk(index: int, text: str, finish_reason: str | None, lps: Any = ()) -> bytes:
        lp = _logprobs(engine, req, list(lps), offsets.get(index, 0)) if lps else None
        offsets[index] = offsets.get(index, 0) + len(text)
        body: dict[str, Any] = {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}],
        }
        if include_usage:
            body["usage"] = None
        return sse(body)

    try:
        request_ids, outputs = submit_choices(engine, prompts, req.common.params, req.common.n)
    except ApiError as exc:
        yield sse(exc.body())
        yield sse("[DONE]")
        return
    try:
        with outputs:
            n = req.common.n
            for index, text in enumerate(_echo_texts(engine, req, prompts)):
                for j in range(n):
                    if text:
                        yield chunk(index * n + j, text, None)
            progress = ChoiceProgress(len(prompts) * n)
            try:
                while (out := await receive_until(outputs, deadline)) is not None:
                    progress.record(out)
                    if out.text or out.finish_reason or out.logprobs:
                        yield chunk(out.index, out.text, out.finish_reason, out.logprobs)
            except RequestTimedOut:
                for index in progress.unfinished():
                    yield chunk(index, "", "length")
            prompt_tokens = sum(len(p) for p in prompts)
            totals = usage(prompt_tokens, sum(progress.generated), sum(progress.cached[::n])) if include_usage else None
            for event in stream_end("text_completion", completion_id, created, model, totals):
                yield event
    except Exception as exc:
        for event in stream_failure(exc):
            yield event
    finally:
        abort_all(engine, request_ids)
