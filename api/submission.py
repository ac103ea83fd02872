"""Submitting the choices of one API call to the engine, with errors in the OpenAI shape."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import trio

from trillm.api.errors import ApiError, context_length_error
from trillm.api.front_door import current_request_id
from trillm.api.gateway import EngineHandle
from trillm.api.schemas.generation import CommonFields
from trillm.engine import (
    ChoiceTotals,
    GrammarCompilerBusy,
    GrammarError,
    OutputMailbox,
    PromptTooLong,
    RequestOutput,
    RequestRejected,
    SamplingParams,
    TokenLogprobs,
    choice_params,
)

log = logging.getLogger("trillm.api")


def check_prompt(engine: EngineHandle, ids: list[int], param: str, common: CommonFields) -> None:
    """Reject up front what the engine would reject, so the client gets a 400, not a broken stream.

    Over the context is a 400 ``context_length_exceeded`` in OpenAI's words, naming ``param``
    (``messages``, ``prompt`` or ``input``) when the prompt alone leaves no room for one generated token,
    ``max_tokens`` (``max_output_tokens``) when the client set one that cannot fit beside the prompt; a default limit
    is clamped to the context instead.
    """
    wanted = common.params.max_tokens if common.max_tokens_given else None
    where = param if param in ("messages", "input") else "prompt"
    try:
        engine.check_prompt(ids)
    except PromptTooLong as exc:
        raise context_length_error(exc.max_model_len, len(ids), wanted or 1, where, param) from None
    except RequestRejected as exc:  # the same refusal, naming the field the client sent
        raise RequestRejected(str(exc), param, exc.code) from None
    if wanted is not None and len(ids) + wanted > engine.max_model_len:
        raise context_length_error(engine.max_model_len, len(ids), wanted, where, common.max_tokens_param)


def check_prefill_prompt(engine: EngineHandle, ids: list[int], param: str, too_long: str) -> None:
    """A prompt that is only prefilled (embeddings, relevance scoring): room in the context for the
    one token its request samples, and ids in the vocabulary; else a 400 naming ``param``
    (``context_length_exceeded`` in OpenAI's words, then ``too_long`` with ``{tokens}`` filled in)."""
    limit = engine.max_model_len
    if len(ids) >= limit:
        message = f"This model's maximum context length is {limit} tokens. However, " + too_long.format(tokens=len(ids))
        raise ApiError(message, param=param, code="context_length_exceeded")
    try:
        engine.check_prompt(ids)
    except RequestRejected as exc:
        raise ApiError(str(exc), param=param, code=exc.code) from None


async def with_grammar(engine: EngineHandle, req: Any) -> Any:
    """``req`` with its output constraint compiled into its sampling parameters (in a worker
    process, cached, time-limited); an invalid, empty, too large or too slow one is a 400 naming
    the field that held it; one that only waited for a busy compiler is a 503 with ``Retry-After``."""
    spec, param = req.common.grammar
    try:
        grammar = await engine.compile_grammar(spec)
    except GrammarCompilerBusy as exc:
        raise ApiError(
            f"the grammar compiler is busy: {exc}",
            503,
            code="grammar_compiler_busy",
            headers={"Retry-After": str(exc.retry_after)},
        ) from None
    except GrammarError as exc:
        what = {"json_schema": "JSON schema", "regex": "regex", "ebnf": "grammar"}.get(spec.kind, "constraint")
        raise ApiError(f"'{param}': invalid {what}: {exc}", param=param, code="invalid_grammar") from None
    params = attrs.evolve(req.common.params, grammar=grammar)
    return attrs.evolve(req, common=attrs.evolve(req.common, params=params))


def submit_choices(
    engine: EngineHandle, prompts: list[list[int]], params: SamplingParams, n: int
) -> tuple[list[str], OutputMailbox]:
    """Every prompt n times; output ``index`` = prompt_index * n + j, as OpenAI orders choices.

    Raises the engine's ``RequestRejected``, ``EngineOverloaded`` or ``EngineNotRunning``."""
    requests = [(ids, p) for ids in prompts for p in choice_params(params, n)]
    ids, outputs = engine.submit_many(requests)  # the engine's refusals become HTTP errors in ``errors.from_engine``
    log.info("request %s: engine requests %s", current_request_id.get(), " ".join(ids))  # X-Request-Id -> engine
    return ids, outputs


@attrs.define
class ChoiceProgress:
    """What a stream has seen of each of its ``total`` choices."""

    total: int
    generated: list[int] = attrs.field(init=False)
    cached: list[int] = attrs.field(init=False)
    finished: set[int] = attrs.field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        self.generated = [0] * self.total
        self.cached = [0] * self.total

    def record(self, out: RequestOutput) -> None:
        self.generated[out.index] = out.num_output_tokens
        self.cached[out.index] = out.num_cached_tokens
        if out.finish_reason:
            self.finished.add(out.index)

    def unfinished(self) -> list[int]:
        return sorted(set(range(self.total)) - self.finished)


class RequestTimedOut(Exception):
    """The server-side deadline (``TRILLM_REQUEST_TIMEOUT``) passed."""


async def receive_until(outputs: OutputMailbox, deadline: float) -> RequestOutput | None:
    """The next output, or None when every choice has ended.

    The cancel scope covers only this one receive, never a ``yield`` of a
    streaming generator. Raises ``RequestTimedOut`` at ``deadline`` (trio time).
    """
    with trio.move_on_at(deadline):
        try:
            return await outputs.receive()
        except trio.EndOfChannel:
            return None
    raise RequestTimedOut


def timeout_error() -> ApiError:
    return ApiError(
        "the request ran past the server's time limit (TRILLM_REQUEST_TIMEOUT)",
        504,
        code="request_timeout",
        type="timeout_error",
    )


def abort_all(engine: EngineHandle, request_ids: list[str]) -> None:
    """Synchronous, so it is safe in ``finally`` under ``trio.Cancelled`` or ``GeneratorExit``."""
    for request_id in request_ids:
        engine.abort(request_id)


@attrs.frozen
class Collected:
    """Every choice of a finished call: text, per-token logprobs, last output, prompt logprobs."""

    texts: list[str]
    logprobs: list[list[TokenLogprobs]]
    last: list[RequestOutput]
    prompt_logprobs: list[tuple[TokenLogprobs, ...]]  # empty where not asked for


async def collect(
    engine: EngineHandle,
    request_ids: list[str],
    outputs: OutputMailbox,
    prefixes: list[str],
    deadline: float,
) -> Collected:
    """Read every choice to its end (texts start from ``prefixes``, e.g. echoed prompts).

    If the caller is cancelled (client gone, deadline), every request is
    aborted on the way out and its pages freed. A call the server ended
    early (shutdown) is a 503; one past its deadline a 504.
    """
    totals = ChoiceTotals.starting(prefixes)
    try:
        with outputs:
            while (out := await receive_until(outputs, deadline)) is not None:
                totals.add(out)
    except RequestTimedOut:
        raise timeout_error() from None
    finally:
        abort_all(engine, request_ids)
    last = totals.last
    for index, out in sorted(last.items()):
        if out.finish_reason == "error" and out.error:  # the request's own fault (its grammar's dead end)
            raise ApiError(f"choice {index}: {out.error}", code="invalid_grammar")
    n = len(prefixes)
    if len(last) != n or any(o.finish_reason in ("abort", "error") for o in last.values()):
        raise ApiError("the server stopped this request before it finished", 503, code="request_aborted")
    prompt_logprobs = [p or () for p in totals.prompt_logprobs]
    return Collected(totals.texts, totals.logprobs, [last[i] for i in range(n)], prompt_logprobs)
