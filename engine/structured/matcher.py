"""One sequence's progress through its grammar, and the masks a step applies.

A ``Matcher`` belongs to one sequence and is touched only by the model-runner
thread, in step order: each step fills its row of the mask from the matcher's
state, samples, then advances the matcher by the sampled token. With the overlap
scheduler the next step is prepared before this one's token is known, but it
executes after it, so the matcher is always exactly one token behind the row it
masks. Preemption keeps a sequence's output tokens, so it keeps its matcher too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import torch

from trillm.engine.structured.compiler import CompiledGrammar

log = logging.getLogger("trillm.engine")


class Matcher:
    """Where one sequence stands in its grammar (xgrammar's ``GrammarMatcher``)."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        import xgrammar

        self.grammar = grammar
        self._matcher = xgrammar.GrammarMatcher(grammar.compiled, override_stop_tokens=list(grammar.stop_ids))
        self.rejected = False  # a token the mask did not allow got through: stop constraining, say so once

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (not once the grammar has ended)."""
        return not self.rejected and not self._matcher.is_terminated()

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self.active:
            return
        if not self._matcher.accept_token(token):
            self.rejected = True
            log.error("token %d is outside the grammar (%s); the rest is unconstrained", token, self.grammar.spec.kind)


@attrs.frozen
class GrammarMasks:
    """The allowed tokens of the constrained rows of one step, as xgrammar bitmasks (int32 words)."""

    bitmask: torch.Tensor  # [rows of the step, ceil(vocab / 32)], CPU
    rows: list[int]  # which rows are constrained

    @classmethod
    def fill(cls, matchers: Sequence[Matcher | None], vocab_size: int) -> GrammarMasks | None:
        """Masks for every row whose matcher is active; None when no row is constrained.

        Runs on the CPU; on a GPU it is called while the step's forward runs there."""
        rows = [i for i, m in enumerate(matchers) if m is not None and m.active]
        if not rows:
            return None
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
        for i in rows:
            matcher = matchers[i]
            assert matcher is not None
            matcher.fill(bitmask, i)
        return cls(bitmask, rows)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place."""
        import xgrammar

        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=self.rows)


def advance(matchers: Sequence[Matcher | None], tokens: Sequence[int]) -> None:
    """Each constrained row's matcher takes the token its row sampled."""
    for matcher, token in zip(matchers, tokens):
        if matcher is not None:
            matcher.accept(token)
