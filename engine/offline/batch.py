"""One ``generate`` call inside the engine's loop: every prompt submitted, its choices gathered.

Each prompt is one ``submit_many`` of its ``n`` choices (as one HTTP call is), so its
outputs share a mailbox and each finished prompt goes back to the calling thread at
once (the progress bar moves). Prompts beyond the engine's waiting room
(``max_waiting``) are submitted as earlier ones finish rather than refused. However
the batch ends (done, a refusal, cancelled by Ctrl-C, the engine stopping) its
requests are aborted and their pages freed before the caller hears of it.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from trillm.engine.errors import EngineOverloaded
from trillm.engine.mailbox import OutputMailbox
from trillm.engine.offline.params import SamplingParams
from trillm.engine.offline.results import Gathered, RequestOutput
from trillm.engine.sampling_params import SamplingParams as EngineSamplingParams
from trillm.engine.structured import CompiledGrammar

SETTLE_SECONDS = 10.0  # how long a cancelled batch waits for the engine to have freed its requests


@attrs.frozen
class Prompt:
    text: str | None  # None when given as token ids
    ids: list[int]
    params: SamplingParams


@attrs.frozen
class Ended:
    """The batch's last message: ``error`` is what stopped it, if anything did."""

    error: BaseException | None


class Batch:
    """Runs in the loop (``run``); the calling thread reads ``done`` and may cancel ``scope``."""

    def __init__(self, engine: Any, prompts: Sequence[Prompt]) -> None:
        self.engine = engine
        self.prompts = prompts
        self.done: queue.SimpleQueue[tuple[int, RequestOutput] | Ended] = queue.SimpleQueue()
        self.scope = trio.CancelScope()
        self._open = 0  # prompts submitted and not yet ended
        self._progress = trio.Event()  # set (and replaced) each time one ends

    async def run(self) -> None:
        error: BaseException | None = None
        try:
            with self.scope:
                await self._run()
        except Exception as exc:  # a refusal (or a failure) is the caller's to raise, not the loop's
            error = exc
        except BaseException as exc:  # the loop stopping: the caller is told, the loop goes on stopping
            error = exc
            raise
        finally:
            if error is not None or self.scope.cancelled_caught:
                with trio.CancelScope(shield=True):
                    await self._settle()
            self.done.put(Ended(error))

    async def _run(self) -> None:
        requests = [await self._requests(p) for p in self.prompts]
        for reqs in requests:  # one refusal refuses the call before anything is submitted
            self.engine.check_prompt(reqs[0][0])
            for _, params in reqs:
                self.engine.check_params(params)
        async with trio.open_nursery() as nursery:
            for index, reqs in enumerate(requests):
                request_ids, mailbox = await self._submit(reqs)
                self._open += 1
                nursery.start_soon(self._gather, index, request_ids, mailbox)

    async def _requests(self, prompt: Prompt) -> list[tuple[list[int], EngineSamplingParams]]:
        choices = prompt.params.choices()
        spec = prompt.params.grammar_spec()
        if spec is not None:  # the engine's compiler caches by spec: one schema compiles once a batch
            grammar: CompiledGrammar = await self.engine.compile_grammar(spec)
            choices = [attrs.evolve(p, grammar=grammar) for p in choices]
        return [(prompt.ids, p) for p in choices]

    async def _submit(self, reqs: list[tuple[list[int], EngineSamplingParams]]) -> tuple[list[str], OutputMailbox]:
        while True:
            try:
                result: tuple[list[str], OutputMailbox] = self.engine.submit_many(reqs)
                return result
            except EngineOverloaded:
                if not self._open:  # nothing of ours will make room
                    raise
                await self._progress.wait()

    async def _gather(self, index: int, request_ids: list[str], mailbox: OutputMailbox) -> None:
        prompt = self.prompts[index]
        gathered = Gathered(
            request_ids[0], prompt.text, prompt.ids, len(request_ids), prompt.params.logprobs is not None
        )
        try:
            with mailbox:
                async for out in mailbox:
                    gathered.add(out)
        finally:
            for request_id in request_ids:  # idempotent: a finished request is no longer there
                self.engine.abort(request_id)
            self._open -= 1
            self._progress.set()
            self._progress = trio.Event()
        self.done.put((index, gathered.result()))

    async def _settle(self) -> None:
        """After a cancel: wait until the engine has dropped every open request (its pages are free)."""
        with trio.move_on_after(SETTLE_SECONDS):
            while self.engine.stats().num_open_requests:
                await trio.sleep(0.01)
