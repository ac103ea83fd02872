"""A thinking budget: after so many tokens of thinking, the reply is made to close it.

Anthropic's ``thinking.budget_tokens`` (and the chat extension ``thinking_budget``), as
SGLang's thinking-budget processor and the "budget forcing" of s1 do it: the tokens of the
thinking are counted as they are sampled, and once the budget is spent the tokens that end
the thinking (``</think>`` and the blank line templates put after it) are forced one by one,
each row's logits masked to that one token, so the answer follows. Thinking the model closes
itself ends the count. Like a grammar ``Matcher``, a ``ThinkingBudget`` belongs to one
sequence and is touched only by the model-runner thread, in step order: it has seen every
token sampled before the row it decides (requests with a budget are not speculated on).
Preemption keeps a sequence's output tokens, so it keeps this too.
"""

from __future__ import annotations

import torch


class ThinkingBudget:
    """Where one reply stands in its thinking: opening, inside (counted), closing, or past it."""

    def __init__(
        self,
        budget: int,
        start_ids: tuple[int, ...],
        end_ids: tuple[int, ...],
        after_ids: tuple[int, ...],
        max_tokens: int | None = None,
    ) -> None:
        """As ``SamplingParams.thinking_*`` say: thinking opens at once, or where the output opens with
        ``start_ids``; ``end_ids`` (the closing tag) end it, then ``after_ids`` are forced too. With
        ``max_tokens``, the closing starts early enough for the whole tag to fit: a reply cut by its
        length never ends in a piece of it."""
        self.budget = budget
        self.max_tokens = max_tokens
        self.taken = 0  # output tokens so far
        self.start_ids = start_ids
        self.closer = end_ids  # what ends thinking when the model writes it
        self.end_ids = (*end_ids, *after_ids)  # what is forced
        # An explicit start must open the output; else thinking starts at once.
        self.state = "opening" if self.start_ids else "inside"
        self.seen: list[int] = []  # the output so far, as far as the state needs it
        self.counted = 0  # thinking tokens so far
        self.forced = 0  # end tokens forced so far

    def next_forced(self) -> int | None:
        """The token the next row must be, if any (asked once a row, before ``took``)."""
        if self.state == "inside" and self._spent():
            self.state = "closing"
        return self.end_ids[self.forced] if self.state == "closing" else None

    def _spent(self) -> bool:
        """The budget is used up, or the room left (this row's on) holds just the closing tag."""
        room = None if self.max_tokens is None else self.max_tokens - self.taken
        return self.counted >= self.budget or (room is not None and room <= len(self.closer))

    def took(self, token: int) -> None:
        """The token the row sampled (forced or free)."""
        self.taken += 1
        if self.state == "done":
            return
        self.seen.append(token)
        if self.state == "opening":
            n = len(self.seen)
            if tuple(self.seen) == self.start_ids[:n]:
                if n == len(self.start_ids):
                    self.state, self.seen = "inside", []
            else:
                self.state = "done"  # the reply did not open with thinking: nothing to count
            return
        if self.state == "closing":
            self.forced += 1
            if self.forced == len(self.end_ids):
                self.state = "done"
            return
        self.counted += 1
        closer = self.closer
        if len(self.seen) >= len(closer) and tuple(self.seen[-len(closer) :]) == closer:
            self.state = "done"  # the model ended its thinking itself
        del self.seen[: -len(closer)]


def force_rows(bitmask: torch.Tensor, forced: list[tuple[int, int]]) -> None:
    """Each (row, token): the row's mask allows that token alone (xgrammar's int32 word layout)."""
    for row, token in forced:
        bitmask[row] = 0
        word, bit = divmod(token, 32)
        bitmask[row, word] = (1 << bit) - (1 << 32 if bit == 31 else 0)
