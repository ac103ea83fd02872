"""Stop strings over streamed text: cut at the first stop, and hold back only
what could still become one, so no part of a stop string is ever sent."""

from __future__ import annotations


def earliest_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Where to cut ``text``, and the stop string found there: the one that completes first (as
    tokens arrive), the longest one if several complete at the same character."""
    found = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return None
    _, cut, stop = min(found)
    return cut, stop


class StopStringMatcher:
    """Feed text deltas in; get back the text that is safe to send.

    ``held`` is the tail of the text seen so far that is a prefix of some stop
    string; it is released as soon as it can no longer start a stop string,
    or when the generation ends for another reason (``flush``).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (Anthropic's ``stop_sequence``)

    def push(self, delta: str) -> str:
        """Return the text to send now; sets ``stopped`` when a stop string completed."""
        if not self.stops:
            return delta
        if self.stopped:
            return ""
        text = self.held + delta
        found = earliest_stop(text, self.stops)
        if found is not None:
            self.stopped = True
            self.held = ""
            cut, self.matched = found
            return text[:cut]
        keep = self._longest_stop_prefix_suffix(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """Generation ended without a stop string: release what was held back."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
