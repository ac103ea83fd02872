"""Which replica serves a request: the one that holds its prompt's prefix, unless it is busy.

Like SGLang's cache-aware router, without a tree: each replica remembers the hashes of
the page-sized prefixes of the prompts it was sent (a hash of a prefix names the whole
prefix, as the radix cache shares whole pages), most recent first, up to a bound. A
request goes to the replica holding its longest prefix, if that replica's load is
within ``slack`` of the least loaded one; otherwise, or with no match, to the least
loaded (ties broken by fewest requests routed so far, so an idle set spreads work).
Pure and synchronous: the front end calls it and tells it the loads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def prefix_hashes(prompt_ids: Sequence[int], page_size: int) -> list[int]:
    """One hash per whole page of the prompt, each naming the prefix up to that page's end."""
    out, running = [], 0
    for end in range(page_size, len(prompt_ids) + 1, page_size):
        running = hash((running, tuple(prompt_ids[end - page_size : end])))
        out.append(running)
    return out


class PrefixRouter:
    """Routing state for ``count`` replicas."""

    def __init__(self, count: int, page_size: int, slack: int = 4, remembered: int = 1 << 16) -> None:
        self.page_size = page_size
        self.slack = slack  # open requests a holder of the prefix may have beyond the least loaded
        self.remembered = remembered  # prefixes kept per replica
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(count)]
        self.routed = [0] * count
        self.affinity_hits = 0  # requests sent where their prefix was

    def match(self, replica: int, hashes: list[int]) -> int:
        """Pages of the prompt's prefix ``replica`` was sent before."""
        seen, matched = self._seen[replica], 0
        for h in hashes:
            if h not in seen:
                break
            matched += 1
        return matched

    def choose(
        self, prompt_ids: Sequence[int], loads: Sequence[int], alive: Sequence[bool], cache_key: str | None = None
    ) -> int:
        """The replica for a prompt, given each replica's open requests; remembers the choice.
        ``cache_key`` (OpenAI's ``prompt_cache_key``) stands before the prompt as a page of its own,
        so requests with one key go where the key went. ValueError when no replica is alive."""
        candidates = [i for i, ok in enumerate(alive) if ok]
        if not candidates:
            raise ValueError("no replica is alive")
        hashes = prefix_hashes(prompt_ids, self.page_size)
        if cache_key is not None:
            key = hash(("prompt_cache_key", cache_key))
            hashes = [key, *(hash((key, h)) for h in hashes)]
        least = min(loads[i] for i in candidates)
        best, best_match = -1, 0
        for i in candidates:
            matched = self.match(i, hashes)
            if matched > best_match and loads[i] <= least + self.slack:
                best, best_match = i, matched
        if best >= 0:
            self.affinity_hits += 1
        else:
            best = min(candidates, key=lambda i: (loads[i], self.routed[i], i))
        self._remember(best, hashes)
        self.routed[best] += 1
        return best

    def _remember(self, replica: int, hashes: list[int]) -> None:
        seen = self._seen[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.remembered:
            seen.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica died (or flushed its cache): it holds no prefix any more."""
        self._seen[replica].clear()
