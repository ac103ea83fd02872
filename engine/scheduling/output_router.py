"""The output path: sampled tokens become text and reach each request's mailbox.

Like vLLM's ``OutputProcessor``: incremental detokenization, stop strings, the
per-request timers, and the hand-over to the consumer. All calls are synchronous
(``OutputMailbox.put`` never blocks: a lagging consumer's outputs are merged), so
the scheduler actor routes a whole step without yielding. How a token leaves its request
— still going, or ended (finished, stopped by a stop string, its consumer gone or
stalled) — is reported back as an ``End``, which the caller hands to ``endings.Endings``
in the same step: that is where the request is closed, counted and its pages freed.
"""

from __future__ import annotations

import time

import attrs

from trillm.engine.mailbox import OutputMailbox
from trillm.engine.outputs import RequestOutput, TokenLogprobs
from trillm.engine.scheduling.detokenizer import IncrementalDetokenizer
from trillm.engine.scheduling.end_kinds import End
from trillm.engine.scheduling.sequence import Sequence
from trillm.engine.scheduling.stop_strings import StopStringMatcher
from trillm.engine.scheduling.telemetry import EngineObserver, NullObserver, RequestTimer


@attrs.define(eq=False)
class LiveRequest:
    """A submitted request that has not ended: its sequence and where its outputs go."""

    seq: Sequence
    mailbox: OutputMailbox
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    index: int
    timer: RequestTimer
    # prompt tokens 1.. with their logprobs, by position (``SamplingParams.prompt_logprobs``), until sent
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    sent: int = 0  # output tokens sent so far


class OutputRouter:
    """Owns every open request's output state; the scheduler owns its pages."""

    def __init__(self, tokenizer: object, stall_timeout: float | None = None) -> None:
        self.tokenizer = tokenizer
        self.stall_timeout = stall_timeout or None  # 0: off
        self.observer: EngineObserver = NullObserver()
        self.live: dict[str, LiveRequest] = {}
        self.generation_tokens_total = 0
        self.outputs_merged = 0  # outputs merged into one their consumer had not taken yet (it lagged)

    def open(self, seq: Sequence, mailbox: OutputMailbox, index: int) -> LiveRequest:
        mailbox.add_sender()
        live = LiveRequest(
            seq,
            mailbox,
            IncrementalDetokenizer(self.tokenizer, seq.prompt_ids, seq.params.skip_special_tokens),
            StopStringMatcher(seq.params.stop),
            index,
            RequestTimer(seq.arrival_time, seq.params.priority),
        )
        if seq.params.prompt_logprobs is not None:
            live.prompt_logprobs = [None] * (len(seq.prompt_ids) - 1)
        self.live[seq.request_id] = live
        return live

    def on_scheduled(self, seqs: list[Sequence], now: float) -> None:
        for seq in seqs:
            self.live[seq.request_id].timer.on_scheduled(self.observer, now)

    def add_prompt_logprobs(self, seq: Sequence, start: int, entries: tuple[TokenLogprobs, ...]) -> None:
        """Keep the logprobs of prompt tokens ``start + 1``, ... until the first output carries them
        (a prompt in chunks gets them over several steps; a recompute after preemption, again)."""
        live = self.live.get(seq.request_id)
        if live is not None and live.prompt_logprobs is not None:
            live.prompt_logprobs[start : start + len(entries)] = entries

    def route(self, seq: Sequence, indices: list[int], logprobs: list[TokenLogprobs | None]) -> End | None:
        """Send ``seq.output_ids[i]`` for ``i`` in ``indices`` (one step's: several after a
        verification), with their text, to its consumer as one output; None while the request
        goes on, else how it ended, for ``Endings.end``: ``GONE`` (the consumer has left; nothing
        was sent), ``FINISHED``/``STOPPED`` (this was its last output; a stop string found in the
        text finishes the sequence here, "stop", and the tokens after it are not sent),
        ``STALLED`` (its oldest output has waited longer than ``stall_timeout``).
        """
        live = self.live[seq.request_id]
        text, tokens, entries, last = "", [], [], False
        for index, entry in zip(indices, logprobs):
            token = seq.output_ids[index]
            self.generation_tokens_total += 1
            tokens.append(token)
            if entry is not None:
                entries.append(entry)
            live.sent = index + 1
            last = seq.is_finished and index == len(seq.output_ids) - 1
            piece = live.detokenizer.push(token)
            if last:
                piece += live.detokenizer.flush()
            text += live.stops.push(piece)
            if live.stops.stopped:  # a stop string ends it, whatever else happened this step
                seq.finish_reason = "stop"
                last = True
                break
            if last:
                text += live.stops.flush()
                break
        output = RequestOutput(
            seq.request_id,
            live.index,
            text,
            tuple(tokens),
            seq.finish_reason if last else None,
            len(seq.prompt_ids),
            live.sent,
            tuple(entries),
            seq.num_cached_tokens,
            self._take_prompt_logprobs(live),
            stop_string=live.stops.matched if last else None,
            embedding=seq.embedding if last and seq.params.pooling is not None else None,
            token_scores=seq.token_scores if last else None,
            accepted_prediction_tokens=seq.spec.prediction_accepted if seq.spec is not None else 0,
        )
        now = time.monotonic()
        merged = live.mailbox.num_merged
        if not live.mailbox.put(output, now):
            return End.GONE
        self.outputs_merged += live.mailbox.num_merged - merged
        live.timer.on_token(self.observer, now)
        if last:
            return End.STOPPED if live.stops.stopped else End.FINISHED
        if self.stall_timeout is not None and live.mailbox.waiting_for(now) > self.stall_timeout:
            return End.STALLED
        return None

    @staticmethod
    def _take_prompt_logprobs(live: LiveRequest) -> tuple[TokenLogprobs, ...] | None:
        """The prompt's logprobs, once, for the request's first output."""
        entries, live.prompt_logprobs = live.prompt_logprobs, None
        if entries is None:
            return None
        assert all(e is not None for e in entries), "every prompt chunk returns before the first token"
        return tuple(e for e in entries if e is not None)

    def close(self, request_id: str, reason: str | None, error: str | None = None) -> bool:
        """End a request's output now; with a reason, send a last output saying so (and
        ``error``, what went wrong, with reason "error"). Called by ``Endings.end`` only.

        Returns whether the request was open."""
        live = self.live.pop(request_id, None)
        if live is None:
            return False
        if reason is not None:
            seq = live.seq
            text = live.stops.push(live.detokenizer.flush()) + live.stops.flush()
            output = RequestOutput(
                request_id,
                live.index,
                text,
                (),
                reason,
                len(seq.prompt_ids),
                live.sent,
                (),
                seq.num_cached_tokens,
                error=error,
            )
            live.mailbox.put(output)
        live.mailbox.end()
        return True
