"""One sequence's progress through its grammar, and the masks a step applies.

A ``Matcher`` belongs to one sequence and is touched only by the model-runner
thread, in step order: each step fills its row of the mask from the matcher's
state, samples, then advances the matcher by the sampled token (a verification: by each token it
emits, its rows masked after each proposal in turn, ``draft_masks``). With the overlap
scheduler the next step is prepared before this one's token is known, but it
executes after it, so the matcher is always exactly one token behind the row it
masks. Preemption keeps a sequence's output tokens, so it keeps its matcher too.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from trillm.engine.structured.compiler import CompiledGrammar
from trillm.kernels import cpu_ops

log = logging.getLogger("trillm.engine")


class Matcher:
    """Where one sequence stands in its grammar (xgrammar's ``GrammarMatcher``).

    A matcher never lets go of its sequence: if its grammar allows no next token (a dead
    end: the language has no string that continues the output) or a token it did not
    allow got through, it records ``failed_at``, the output index that could not be
    produced, and the engine ends the sequence there with finish reason "error"."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        import xgrammar

        self.grammar = grammar
        self._matcher = xgrammar.GrammarMatcher(grammar.compiled, override_stop_tokens=list(grammar.stop_ids))
        # Kept here rather than asked of xgrammar: each call into it costs ~0.1 ms, per row, per step.
        self.terminated = False  # it took a stop token: the grammar is complete
        self.num_accepted = 0  # output tokens taken so far: the output index the next mask is for
        self.failed_at: int | None = None  # the output index no token could fill; the sequence ends before it
        self.reason = ""

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (not once the grammar has ended or failed)."""
        return not (self.terminated or self.failed_at is not None)

    def fail(self, reason: str) -> None:
        """The output cannot go on inside the grammar: say so once; the engine ends the sequence."""
        if self.failed_at is None:
            self.failed_at = self.num_accepted
            self.reason = reason
            log.error(
                "%s grammar: %s after %d output tokens; the choice ends with an error",
                self.grammar.spec.kind,
                reason,
                self.num_accepted,
            )

    def accepted(self, token: int, ok: bool) -> None:
        """Record the outcome of xgrammar taking ``token`` (``advance`` feeds a whole step at once)."""
        if not ok:
            self.fail(f"token {token} is outside the grammar")
            return
        self.num_accepted += 1
        if token in self.grammar.stop_ids:
            self.terminated = True

    def draft_masks(self, draft: tuple[int, ...], vocab_size: int) -> tuple[GrammarMasks, int]:
        """The masks of a verification's rows (row j: after the first j proposals) and how many
        proposals are verified: not one the grammar refuses, nor one after which it allows no
        token (plain decoding meets that dead end next, as it would have). Leaves the matcher
        where it was (xgrammar rolls back any number of tokens). A dead end at the first row
        fails the matcher, as ``GrammarMasks.fill`` does, and masks nothing."""
        bitmask = torch.full((len(draft) + 1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
        accepted = taken = 0
        for j in range(len(draft) + 1):
            self._matcher.fill_next_token_bitmask(bitmask, j)
            if (bitmask[j] == 0).all():  # a dead end: the proposal before it is not verified
                taken = max(0, j - 1)
                break
            taken = j
            if j == len(draft) or not self._matcher.accept_token(draft[j]):
                break
            accepted += 1
            if self._matcher.is_terminated():  # a stop token: nothing may follow it
                taken = j + 1
                break
        if accepted:
            self._matcher.rollback(accepted)
        if (bitmask[0] == 0).all():
            self.fail("no token is allowed")
            return GrammarMasks(bitmask, []), 0
        return GrammarMasks(bitmask, list(range(taken + 1))), taken

    def take(self, tokens: Sequence[int]) -> None:
        """A verification's emitted tokens, in order (until one is refused)."""
        for token in tokens:
            if not self.active:
                return
            self.accepted(token, self._matcher.accept_token(token))


@attrs.define
class GrammarMasks:
    """The allowed tokens of the constrained rows of one step, as xgrammar bitmasks (int32 words)."""

    bitmask: torch.Tensor  # [rows of the step, ceil(vocab / 32)], CPU
    rows: list[int]  # which rows are constrained
    apply_seconds: float = 0.0

    @classmethod
    def empty(cls, rows: int, vocab_size: int) -> GrammarMasks:
        """Masks that allow every token and constrain no row (yet)."""
        return cls(torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32), [])

    @classmethod
    def fill(cls, matchers: Sequence[Matcher | None], vocab_size: int, threads: int = 1) -> GrammarMasks | None:
        """Masks for every row whose matcher is active; None when no row is constrained.

        Runs on the CPU, all rows in one call to xgrammar over ``threads`` threads (a Python
        call per row cost 10x more); on a GPU it is called while the step's forward runs there."""
        rows = [i for i, m in enumerate(matchers) if m is not None and m.active]
        if not rows:
            return None

        bitmask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)  # xgrammar's layout
        active = [matchers[i]._matcher for i in rows]  # type: ignore[union-attr]  # rows hold matchers
        _batch_matcher(threads).batch_fill_next_token_bitmask(active, bitmask, rows)
        # A row whose mask allows nothing is a dead end: its sequence ends here (its logits are
        # left alone, so the row's throwaway sample is well defined, and it is never sent).
        dead = (bitmask[rows] == 0).all(dim=1).tolist()
        if any(dead):
            for i, is_dead in zip(list(rows), dead):
                if is_dead:
                    matchers[i].fail("no token is allowed")  # type: ignore[union-attr]
            rows = [i for i, is_dead in zip(rows, dead) if not is_dead]
            if not rows:
                return None
        return cls(bitmask, rows)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place."""
        import xgrammar

        started = time.perf_counter()
        if logits.is_cpu and logits.dtype == torch.float32 and logits.stride()[-1] == 1 and cpu_ops.available():
            cpu_ops.apply_bitmask(logits, self.bitmask, self.rows)  # ~10x xgrammar's CPU path (stores only)
        else:
            bitmask = self.bitmask.to(logits.device, non_blocking=True)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=self.rows)
        self.apply_seconds += time.perf_counter() - started


@functools.cache
def _batch_matcher(threads: int) -> Any:
    """xgrammar's batch filler owns a thread pool: made once per thread count, not per step."""
    import xgrammar

    return xgrammar.BatchGrammarMatcher(max_threads=threads)


def advance(matchers: Sequence[Matcher | None], tokens: Sequence[int]) -> None:
    """Each active row's matcher takes the token its row sampled, in one call to xgrammar."""
    rows = [(m, t) for m, t in zip(matchers, tokens) if m is not None and m.active]
    if not rows:
        return
    import xgrammar

    results = xgrammar.BatchGrammarMatcher.batch_accept_token([m._matcher for m, _ in rows], [t for _, t in rows])
    for (matcher, token), ok in zip(rows, results):
        matcher.accepted(token, ok)
