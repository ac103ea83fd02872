"""Prompt lookup: the tokens that followed the longest recent match of a sequence's last tokens,
in its own prompt and output and in a client's predicted output (OpenAI's ``prediction``).

Per request, built from its tokens as they settle (an index of token pairs with links to their
earlier places), so it is never stale across requests; ``speculation.SpeculationControl`` decides
whether and how many of its proposals a step carries.
"""

from __future__ import annotations

from array import array

MAX_NGRAM = 4  # the longest suffix matched
MIN_NGRAM = 2  # the shortest (one token matches too often to be worth a row): the pairs indexed
CANDIDATES = 8  # a pair's latest places compared for the longest match


class _BigramIndex:
    """Where each token pair was last followed by a known token, and the pair's earlier places
    (``before``): one dictionary entry and 4 bytes a token, whatever the longest match looked for."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.last: dict[int, int] = {}
        self.before = array("i")  # before[end]: the previous end after the same pair, or -1

    @staticmethod
    def key(a: int, b: int) -> int:
        return a << 32 | b

    def extend(self, tokens: list[int] | tuple[int, ...]) -> None:
        for token in tokens:
            end = len(self.tokens)
            self.before.append(-1)
            if end >= 2:  # the pair just before ``end`` is followed by ``token``
                key = self.key(self.tokens[-2], self.tokens[-1])
                self.before[end] = self.last.get(key, -1)
                self.last[key] = end
            self.tokens.append(token)

    def find(self, suffix: list[int]) -> int | None:
        """Where the longest match of ``suffix``'s end (up to ``MAX_NGRAM`` tokens) is followed
        by a known token, among its last ``CANDIDATES`` places; the latest of equals."""
        at = self.last.get(self.key(suffix[-2], suffix[-1]), -1) if len(suffix) >= 2 else -1
        best, best_length = None, 0
        for _ in range(CANDIDATES):
            if at < 0:
                break
            length = 2
            while (
                length < MAX_NGRAM
                and length < min(at, len(suffix))
                and self.tokens[at - length - 1] == suffix[-length - 1]
            ):
                length += 1
            if length > best_length:
                best, best_length = at, length
            at = self.before[at]
        return best


def _continued(tokens: list[int], at: int, k: int) -> tuple[int, ...]:
    """Up to ``k`` tokens from ``at``. Where they run into the end and the text since ``at`` is
    its period at least twice over (a loop, ``X, X, X, ``, or a list), the period goes on: such
    a loop gets ``k`` tokens a step, not one period's. (A short match near the end without that
    evidence is left as it is: carried on in open chat, it cost 3-6 % in rows that failed.)"""
    out = tokens[at : at + k]
    period = len(tokens) - at
    if len(out) < k and period <= at and tokens[at - period : at] == out:
        while len(out) < k:
            out.append(out[len(out) - period])
    return tuple(out)


class NgramProposer:
    """Prompt lookup over one sequence's tokens, and over a predicted output (OpenAI's
    ``prediction``) before them: the tokens that followed the longest recent match of the last
    ``MIN_NGRAM`` .. ``MAX_NGRAM`` tokens. Tokens are added as they become known, never removed."""

    def __init__(self, prediction: tuple[int, ...] = (), prompt_len: int = 0) -> None:
        self.prompt_len = prompt_len  # before any output, the prediction's start is proposed
        self.own = _BigramIndex()
        self.predicted = _BigramIndex()
        self.predicted.extend(prediction)

    @property
    def tokens(self) -> list[int]:
        return self.own.tokens

    def extend(self, tokens: list[int]) -> None:
        """Known tokens of the sequence, appended (the prompt, then each settled output)."""
        self.own.extend(tokens)

    def propose(self, k: int) -> tuple[tuple[int, ...], bool]:
        """Up to ``k`` tokens likely to follow, and whether they come from the prediction."""
        tokens, prediction = self.own.tokens, self.predicted.tokens
        if prediction and len(tokens) == self.prompt_len:
            return tuple(prediction[:k]), True
        at = self.predicted.find(tokens)
        if at is not None:
            return tuple(prediction[at : at + k]), True
        at = self.own.find(tokens)
        if at is not None:
            return _continued(tokens, at, k), False
        return (), False

    def has_match(self) -> bool:
        """Whether ``propose`` would find anything now (one or two dictionary lookups)."""
        tokens = self.own.tokens
        if self.predicted.tokens and len(tokens) == self.prompt_len:
            return True
        if len(tokens) < MIN_NGRAM:
            return False
        key = _BigramIndex.key(tokens[-2], tokens[-1])
        return key in self.predicted.last or key in self.own.last
