"""Submitting the choices of one API call to the engine, with errors in the OpenAI shape."""

from __future__ import annotations

import attrs
import trio

from engine.sampler import TokenLogprobs

from api.errors import ApiError
from engine.engine import Engine, EngineNotRunning, RequestOutput, RequestRejected
from engine.sampling_params import SamplingParams


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """``n`` samples of one prompt; with a seed, choice j uses seed + j so they differ but repeat."""
    if params.seed is None:
        return [params] * n
    return [attrs.evolve(params, seed=params.seed + j) for j in range(n)]


def submit_choices(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, n: int
) -> tuple[list[str], trio.MemoryReceiveChannel[RequestOutput]]:
    """Every prompt n times; output ``index`` = prompt_index * n + j, as OpenAI orders choices."""
    requests = [(ids, p) for ids in prompts for p in choice_params(params, n)]
    try:
        return engine.submit_many(requests)
    except RequestRejected as exc:
        raise ApiError(str(exc), param=exc.param, code=exc.code) from None
    except EngineNotRunning:
        raise ApiError("the engine is not serving (starting or shutting down)", 503, code="engine_unavailable") from None


def abort_all(engine: Engine, request_ids: list[str]) -> None:
    """Synchronous, so it is safe in ``finally`` under ``trio.Cancelled`` or ``GeneratorExit``."""
    for request_id in request_ids:
        engine.abort(request_id)


@attrs.frozen
class Collected:
    """Every choice of a finished call: text, per-token logprobs, last output."""

    texts: list[str]
    logprobs: list[list[TokenLogprobs]]
    last: list[RequestOutput]


async def collect(
    engine: Engine,
    request_ids: list[str],
    outputs: trio.MemoryReceiveChannel[RequestOutput],
    prefixes: list[str],
) -> Collected:
    """Read every choice to its end (texts start from ``prefixes``, e.g. echoed prompts).

    If the caller is cancelled (client gone, deadline), every request is
    aborted on the way out and its pages freed. A call the server ended
    early (shutdown) is a 503.
    """
    texts = list(prefixes)
    logprobs: list[list[TokenLogprobs]] = [[] for _ in texts]
    last: dict[int, RequestOutput] = {}
    try:
        with outputs:
            async for out in outputs:
                texts[out.index] += out.text
                logprobs[out.index] += out.logprobs
                last[out.index] = out
    finally:
        abort_all(engine, request_ids)
    if len(last) != len(texts) or any(o.finish_reason in ("abort", "error") for o in last.values()):
        raise ApiError("the server stopped this request before it finished", 503, code="request_aborted")
    return Collected(texts, logprobs, [last[i] for i in range(len(texts))])
