"""One admission path: the checks a request passes before it is queued.

``Engine`` and ``ReplicaSet`` (``replicas/front.py``) both guard their ``submit_many`` and
answer the API's early checks (``check_prompt``, ``check_params``, ``check_capacity``) with
these functions, so the two cannot drift: each only says what admission reads from it
(``Admits``), and the rules and their words live here.
"""

from __future__ import annotations

from typing import Protocol

from trillm.engine.errors import EngineNotRunning, EngineOverloaded, PromptTooLong, RequestRejected
from trillm.engine.sampling_params import SamplingParams


class Admits(Protocol):
    """What admission reads from the engine it guards, at the moment of each call."""

    @property
    def is_running(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def num_queued(self) -> int:
        """Requests submitted and not yet running."""
        ...

    def max_queued(self) -> int:
        """How many requests may wait to run."""
        ...


def check_prompt(engine: Admits, prompt_ids: list[int]) -> None:
    """Raise ``RequestRejected`` for a prompt that can never run: empty, too long, or holding ids
    outside the vocabulary."""
    if not prompt_ids:
        raise RequestRejected("the prompt is empty", "prompt")
    if len(prompt_ids) >= engine.max_model_len:
        raise PromptTooLong(len(prompt_ids), engine.max_model_len)
    vocab_size = engine.vocab_size
    if max(prompt_ids) >= vocab_size or min(prompt_ids) < 0:
        raise RequestRejected(f"prompt token ids must be in [0, {vocab_size - 1}]", "prompt")


def check_params(engine: Admits, params: SamplingParams) -> None:
    """Raise ``RequestRejected`` for sampling parameters this model cannot honour: ``logit_bias``
    token ids outside the vocabulary."""
    vocab_size = engine.vocab_size
    if any(not 0 <= token < vocab_size for token, _ in params.logit_bias):
        raise RequestRejected(f"logit_bias: token ids must be in [0, {vocab_size - 1}]", "logit_bias")


def check_capacity(engine: Admits, count: int) -> None:
    """Raise ``EngineOverloaded`` if ``count`` more requests would overfill the waiting queue."""
    queued, limit = engine.num_queued(), engine.max_queued()
    if queued + count > limit:
        raise EngineOverloaded(f"{queued} requests are already waiting (the limit is {limit})")


def admit(engine: Admits, requests: list[tuple[list[int], SamplingParams]]) -> None:
    """Every check of one ``submit_many`` call, in the order callers see refusals: not running,
    no room for them all, then each request's prompt and parameters. All pass or it raises."""
    if not engine.is_running:
        raise EngineNotRunning("the engine is not running")
    check_capacity(engine, len(requests))
    for prompt_ids, params in requests:
        check_prompt(engine, prompt_ids)
        check_params(engine, params)
