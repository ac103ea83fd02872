"""``POST /v1/completions``: one choice per prompt and ``n``, echo, legacy logprobs.

Streaming and cancellation are shared with chat (``api/streaming.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import attrs

from trillm.api import logprobs
from trillm.api.endpoint import GenerationEndpoint
from trillm.api.gateway import EngineHandle
from trillm.api.responses import new_completion_id, usage
from trillm.api.schemas.completion import CompletionRequest, parse_completion_request
from trillm.api.submission import collect, submit_choices
from trillm.engine.execution.sampler import TokenLogprobs
from trillm.engine.outputs import RequestOutput


def prompt_ids(engine: EngineHandle, req: CompletionRequest) -> list[list[int]]:
    tok = engine.tokenizer
    return [list(p) if isinstance(p, tuple) else tok(p)["input_ids"] for p in req.prompts]


def _logprobs(engine: EngineHandle, req: CompletionRequest, items: list[TokenLogprobs], offset: int) -> Any:
    if req.common.params.logprobs is None:
        return None
    return logprobs.legacy(engine.tokenizer, items, offset)


def _echo_texts(engine: EngineHandle, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    if not req.echo:
        return [""] * len(prompts)
    return [p if isinstance(p, str) else engine.tokenizer.decode(ids) for p, ids in zip(req.prompts, prompts)]


async def complete(
    engine: EngineHandle, model: str, req: CompletionRequest, prompts: list[list[int]], deadline: float
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
            {
                "index": i,
                "text": done.texts[i],
                "logprobs": _logprobs(engine, req, done.logprobs[i], 0),
                "finish_reason": done.last[i].finish_reason,
            }
            for i in range(len(done.texts))
        ],
        "usage": usage(
            sum(len(p) for p in prompts),
            sum(o.num_output_tokens for o in done.last),
            sum(o.num_cached_tokens for o in done.last[:: req.common.n]),
        ),
    }


@attrs.define
class CompletionChunks:
    """[Echoed prompts], text pieces as they come (the finish on the last one)."""

    engine: EngineHandle
    req: CompletionRequest
    prompts: list[list[int]]
    object: str = "text_completion"
    offsets: dict[int, int] = attrs.field(factory=dict)  # characters sent so far per choice, for text_offset

    def _choice(self, index: int, text: str, finish_reason: str | None, lps: Any = ()) -> dict[str, Any]:
        lp = _logprobs(self.engine, self.req, list(lps), self.offsets.get(index, 0)) if lps else None
        self.offsets[index] = self.offsets.get(index, 0) + len(text)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}

    def opening(self) -> Iterable[dict[str, Any]]:
        n = self.req.common.n
        for index, text in enumerate(_echo_texts(self.engine, self.req, self.prompts)):
            for j in range(n):
                if text:
                    yield self._choice(index * n + j, text, None)

    def pieces(self, out: RequestOutput) -> Iterable[dict[str, Any]]:
        if out.text or out.finish_reason or out.logprobs:
            yield self._choice(out.index, out.text, out.finish_reason, out.logprobs)

    def cut(self, index: int) -> dict[str, Any]:
        return self._choice(index, "", "length")


ENDPOINT = GenerationEndpoint(
    parse=parse_completion_request,
    prompt_ids=prompt_ids,
    prompt_param=lambda req: "prompt",
    complete=complete,
    renderer=CompletionChunks,
)
