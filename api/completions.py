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
from trillm.api.input_limits import check_text
from trillm.api.responses import new_completion_id, usage
from trillm.api.schemas.completion import CompletionBody, CompletionRequest, parse_completion_request
from trillm.api.submission import collect, submit_choices
from trillm.engine import RequestOutput, TokenLogprobs


def prompt_ids(engine: EngineHandle, req: CompletionRequest) -> list[list[int]]:
    """Each prompt's token ids (text tokenized, ids as given); the app calls it in a worker thread."""
    tok = engine.tokenizer
    for p in req.prompts:
        if isinstance(p, str):
            check_text(engine, [p], "prompt")
    return [list(p) if isinstance(p, tuple) else tok(p)["input_ids"] for p in req.prompts]


def _echo_texts(engine: EngineHandle, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    if not req.echo:
        return [""] * len(prompts)
    cut = req.common.truncate_prompt_tokens is not None  # then the text the model saw: its last tokens
    return [
        p if isinstance(p, str) and not cut else engine.tokenizer.decode(ids) for p, ids in zip(req.prompts, prompts)
    ]


def _finish(req: CompletionRequest, reason: str | None) -> str | None:
    """With ``max_tokens`` 0 the token the engine sampled is dropped: the choice ends by length."""
    return "length" if req.echo_only and reason in ("stop", "length") else reason


@attrs.frozen
class _Scored:
    """The echoed prompt's legacy logprobs: its first token (no score), then the rest, scored."""

    first: int
    rest: tuple[TokenLogprobs, ...]


def _legacy(
    engine: EngineHandle, req: CompletionRequest, items: list[TokenLogprobs], offset: int, prompt: _Scored | None
) -> Any:
    if req.common.params.logprobs is None:
        return None
    if prompt is None:
        return logprobs.legacy(engine.tokenizer, items, offset)
    return logprobs.legacy(engine.tokenizer, [*prompt.rest, *items], offset, head=prompt.first)


async def complete(
    engine: EngineHandle, model: str, req: CompletionRequest, prompts: list[list[int]], deadline: float
) -> dict[str, Any]:
    """Run every choice to its end and return the ``text_completion`` body."""
    n = req.common.n
    request_ids, outputs = submit_choices(engine, prompts, req.common.params, n)
    echoes = [echo for echo in _echo_texts(engine, req, prompts) for _ in range(n)]
    done = await collect(engine, request_ids, outputs, echoes, deadline)
    scored = req.common.params.prompt_logprobs is not None
    choices = []
    for i in range(len(done.texts)):
        text, items = (echoes[i], []) if req.echo_only else (done.texts[i], done.logprobs[i])
        prompt = _Scored(prompts[i // n][0], done.prompt_logprobs[i]) if scored else None
        choices.append(
            {
                "index": i,
                "text": text,
                "logprobs": _legacy(engine, req, items, 0, prompt),
                "finish_reason": _finish(req, done.last[i].finish_reason),
            }
        )
    return {
        "id": new_completion_id(),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(
            sum(len(p) for p in prompts),
            0 if req.echo_only else sum(o.num_output_tokens for o in done.last),
            sum(o.num_cached_tokens for o in done.last[::n]),
        ),
    }


@attrs.define
class CompletionChunks:
    """[Echoed prompts], text pieces as they come (the finish on the last one).

    An echo with prompt logprobs waits for the choice's first output, which brings them."""

    engine: EngineHandle
    req: CompletionRequest
    prompts: list[list[int]]
    object: str = "text_completion"
    id_prefix: str = "cmpl"
    offsets: dict[int, int] = attrs.field(factory=dict)  # characters sent so far per choice, for text_offset
    echoes: list[str] = attrs.field(init=False)  # per prompt

    def __attrs_post_init__(self) -> None:
        self.echoes = _echo_texts(self.engine, self.req, self.prompts)

    @property
    def generates(self) -> bool:
        return not self.req.echo_only

    def _choice(
        self, index: int, text: str, finish_reason: str | None, lps: Any = (), prompt: _Scored | None = None
    ) -> dict[str, Any]:
        offset = self.offsets.get(index, 0)
        lp = _legacy(self.engine, self.req, list(lps), offset, prompt) if lps or prompt else None
        self.offsets[index] = offset + len(text)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}

    def opening(self) -> Iterable[dict[str, Any]]:
        if self.req.common.params.prompt_logprobs is not None:
            return  # sent with each choice's first output
        n = self.req.common.n
        for index, text in enumerate(self.echoes):
            for j in range(n):
                if text:
                    yield self._choice(index * n + j, text, None)

    def pieces(self, out: RequestOutput) -> Iterable[dict[str, Any]]:
        if out.prompt_logprobs is not None:
            p = out.index // self.req.common.n
            scored = _Scored(self.prompts[p][0], out.prompt_logprobs)
            yield self._choice(out.index, self.echoes[p], None, prompt=scored)
        if self.req.echo_only:
            if out.finish_reason:
                yield self._choice(out.index, "", _finish(self.req, out.finish_reason))
        elif out.text or out.finish_reason or out.logprobs:
            yield self._choice(out.index, out.text, out.finish_reason, out.logprobs)

    def cut(self, index: int) -> dict[str, Any]:
        return self._choice(index, "", "length")


ENDPOINT = GenerationEndpoint(
    parse=parse_completion_request,
    prompt_ids=prompt_ids,
    prompt_param=lambda req: "prompt",
    complete=complete,
    renderer=CompletionChunks,
    schema=CompletionBody,
)
