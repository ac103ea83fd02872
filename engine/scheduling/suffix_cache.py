"""What recent requests generated, as counts of the token that followed each short context: the
``suffix`` proposer's memory across requests (SuffixDecoding's idea, in n-gram form).

Agents and code tools send many requests whose outputs repeat each other (the same tool-call
scaffolding, the same file regions): a request may be proposed what earlier ones wrote after the
context it has just produced. From the longest context seen (``MAX_CONTEXT`` tokens down to
``MIN_CONTEXT``), the most frequent next token is followed while the product of the chosen
tokens' frequencies stays above ``min_confidence``: a well-trodden continuation proposes many
tokens, a contested one few or none.

Bounded: it holds the last ``max_tokens`` tokens learned, whole requests, and forgets the oldest
request's counts exactly as it learned them. Requests are learned once they end; nothing of a
running request is in it, so its proposals never go stale for that request (its own tokens are
the n-gram proposer's). ``clear`` empties it (``/flush_cache``).
"""

from __future__ import annotations

from collections import deque

MIN_CONTEXT = 2
MAX_CONTEXT = 5
PROMPT_CONTEXT = MAX_CONTEXT  # tokens of a request's prompt end learned with its output (its first tokens' context)


class SuffixCache:
    def __init__(self, max_tokens: int = 32_768, min_confidence: float = 0.3) -> None:
        self.max_tokens = max_tokens
        self.min_confidence = min_confidence
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}
        self.learned: deque[tuple[tuple[int, ...], int]] = deque()  # (tokens, where the output starts)
        self.size = 0  # tokens in ``learned``

    def learn(self, prompt_tail: list[int], output: list[int]) -> None:
        """A finished request's output, after the end of its prompt; the oldest go past the bound."""
        tokens = tuple(prompt_tail[-PROMPT_CONTEXT:]) + tuple(output)
        if len(tokens) > self.max_tokens or not output:
            return
        first = len(tokens) - len(output)
        self._count(tokens, first, +1)
        self.learned.append((tokens, first))
        self.size += len(tokens)
        while self.size > self.max_tokens:
            old, old_first = self.learned.popleft()
            self.size -= len(old)
            self._count(old, old_first, -1)

    def _count(self, tokens: tuple[int, ...], first: int, delta: int) -> None:
        """Add ``delta`` to each (context, next token) pair whose next token is at ``first`` or after."""
        for end in range(max(first, MIN_CONTEXT), len(tokens)):
            nxt = tokens[end]
            for n in range(MIN_CONTEXT, min(MAX_CONTEXT, end) + 1):
                key = tokens[end - n : end]
                counts = self.counts.setdefault(key, {})
                left = counts.get(nxt, 0) + delta
                if left > 0:
                    counts[nxt] = left
                else:
                    counts.pop(nxt, None)
                    if not counts:
                        del self.counts[key]

    def _next(self, context: list[int]) -> tuple[int, float] | None:
        """The most frequent token after the longest known suffix of ``context``, and its share."""
        for n in range(min(MAX_CONTEXT, len(context)), MIN_CONTEXT - 1, -1):
            counts = self.counts.get(tuple(context[-n:]))
            if counts:
                token, count = max(counts.items(), key=lambda item: item[1])
                return token, count / sum(counts.values())
        return None

    def has_match(self, context: list[int]) -> bool:
        found = self._next(context)
        return found is not None and found[1] >= self.min_confidence

    def propose(self, context: list[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens, while the continuation's confidence stays above the threshold."""
        tail = list(context[-MAX_CONTEXT:])
        out: list[int] = []
        confidence = 1.0
        while len(out) < k:
            found = self._next(tail)
            if found is None:
                break
            confidence *= found[1]
            if confidence < self.min_confidence:
                break
            out.append(found[0])
            tail = tail[1:] + [found[0]] if len(tail) >= MAX_CONTEXT else tail + [found[0]]
        return tuple(out)

    def clear(self) -> None:
        self.counts.clear()
        self.learned.clear()
        self.size = 0
