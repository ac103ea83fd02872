"""Where a request's outputs wait for its consumer: one slot per choice, merged when it lags.

A channel with an unbounded buffer would queue one ``RequestOutput`` per token for a
client that stopped reading (the HTTP handler is parked in a socket send), and the
engine would never notice. Here the engine's ``put`` never blocks and never queues:
if the consumer has not yet taken a choice's previous output, the new one is merged
into it (text, token ids and logprobs concatenated, the latest counts and finish
reason kept), so a lagging consumer costs one pending output per choice, and the
consumer simply receives bigger deltas when it comes back. How long the oldest
pending output has waited (``waiting_for``) tells the engine a consumer has stalled.

The engine side (``add_sender``, ``put``, ``end``) is synchronous, like the
scheduler actor that calls it; the consumer side is a Trio receive channel in
shape (``receive``, ``async for``, ``close``, ``with``). Closing it cancels every
request that sends to it: the engine's next ``put`` returns False.
"""

from __future__ import annotations

import time
from types import TracebackType

import attrs
import trio

from trillm.engine.outputs import RequestOutput, TokenLogprobs


@attrs.define
class _Pending:
    """A choice's outputs not yet taken, kept as parts and joined once when taken."""

    latest: RequestOutput
    texts: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    prompt_logprobs: tuple[TokenLogprobs, ...] | None
    merged: int = 1  # outputs in it

    @classmethod
    def of(cls, out: RequestOutput) -> _Pending:
        return cls(out, [out.text], list(out.token_ids), list(out.logprobs), out.prompt_logprobs)

    def add(self, out: RequestOutput) -> None:
        self.latest = out
        self.texts.append(out.text)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        if self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        self.merged += 1

    def output(self) -> RequestOutput:
        if self.merged == 1:
            return self.latest
        return attrs.evolve(
            self.latest,
            text="".join(self.texts),
            token_ids=tuple(self.token_ids),
            logprobs=tuple(self.logprobs),
            prompt_logprobs=self.prompt_logprobs,
        )


class OutputMailbox:
    """The outputs of the requests of one ``submit_many`` call, at most one pending per choice."""

    def __init__(self) -> None:
        self._pending: dict[int, _Pending] = {}  # by choice index, oldest first
        self._senders = 0  # requests still sending here
        self._closed = False  # the consumer has left
        self._lot = trio.lowlevel.ParkingLot()
        self._waiting_since: float | None = None  # when the consumer last had nothing to take, if it has now
        self.num_merged = 0  # outputs merged into one not yet taken (the consumer lagged)

    # -- the engine's side (synchronous) ----------------------------------------------

    def add_sender(self) -> None:
        """One more request sends here (called at submission, before the consumer has it)."""
        self._senders += 1

    def put(self, out: RequestOutput, now: float | None = None) -> bool:
        """Hand ``out`` over, merged into its choice's pending output if there is one.

        Never blocks. Returns False when the consumer has gone: drop the request."""
        if self._closed:
            return False
        pending = self._pending.get(out.index)
        if pending is None:
            self._pending[out.index] = _Pending.of(out)
            if self._waiting_since is None:
                self._waiting_since = time.monotonic() if now is None else now
        else:
            pending.add(out)
            self.num_merged += 1
        self._lot.unpark_all()
        return True

    def end(self) -> None:
        """One request has sent its last output; when all have, the consumer sees the end."""
        self._senders -= 1
        if self._senders == 0:
            self._lot.unpark_all()

    def waiting_for(self, now: float) -> float:
        """Seconds the oldest output here has waited for the consumer (0 when none waits)."""
        return 0.0 if self._waiting_since is None else now - self._waiting_since

    @property
    def num_pending(self) -> int:
        """Choices with an output waiting: never more than the choices themselves."""
        return len(self._pending)

    @property
    def pending_tokens(self) -> int:
        """Tokens waiting for the consumer, over every choice."""
        return sum(len(p.token_ids) for p in self._pending.values())

    # -- the consumer's side ------------------------------------------------------------

    def receive_nowait(self) -> RequestOutput:
        """The oldest pending output (every part of it that has come since the last take).

        Raises ``trio.WouldBlock`` when none is ready, ``trio.EndOfChannel`` when every
        request has ended and all was taken, ``trio.ClosedResourceError`` after ``close``."""
        if self._closed:
            raise trio.ClosedResourceError
        if self._pending:
            index = next(iter(self._pending))
            out = self._pending.pop(index).output()
            self._waiting_since = time.monotonic() if self._pending else None
            return out
        if self._senders == 0:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> RequestOutput:
        """Wait for ``receive_nowait`` to have something; a checkpoint, as Trio's receives are.
        Cancelled while waiting, it loses nothing: what came stays pending."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                out = self.receive_nowait()
            except trio.WouldBlock:
                await self._lot.park()
                continue
            except (trio.EndOfChannel, trio.ClosedResourceError):
                await trio.lowlevel.cancel_shielded_checkpoint()
                raise
            await trio.lowlevel.cancel_shielded_checkpoint()
            return out

    def close(self) -> None:
        """The consumer leaves: what is pending is dropped, and the senders are cancelled."""
        self._closed = True
        self._pending.clear()
        self._waiting_since = None
        self._lot.unpark_all()

    def __enter__(self) -> OutputMailbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __aiter__(self) -> OutputMailbox:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
