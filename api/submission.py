"""Submitting the choices of one API call to the engine, with errors in the OpenAI shape."""

from __future__ import annotations

import attrs
import trio

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
