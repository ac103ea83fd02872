"""Radix tree of cached KV pages, keyed by the tokens each full page holds.

Pure bookkeeping over the ``PageAllocator``: the tree holds one reference on
every page in it; sequences that reuse a cached prefix take their own. A page
only the tree holds is evictable; eviction takes least-recently-used leaves
first. A page enters the tree only once its sequence stops writing to it
(finished, aborted or preempted), so a cached prefix is never stale.
"""

from __future__ import annotations

import itertools

from trillm.engine.scheduling.kv_pages import PageAllocator


class _Node:
    __slots__ = ("key", "page", "parent", "children", "last_use")

    def __init__(self, key: tuple[int, ...], page: int, parent: _Node | None, last_use: int) -> None:
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_use = last_use


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self._root = _Node((), -1, None, 0)
        self._clock = itertools.count(1)
        self._nodes: dict[int, _Node] = {}  # page -> node

    @property
    def cached_pages(self) -> int:
        return len(self._nodes)

    @property
    def evictable_pages(self) -> int:
        return sum(1 for page in self._nodes if self.allocator.refcount(page) == 1)

    def _keys(self, tokens: list[int], num_pages: int) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i * ps : (i + 1) * ps]) for i in range(num_pages)]

    def match(self, tokens: list[int]) -> list[int]:
        """Pages caching the longest prefix of ``tokens`` in whole pages, leaving
        at least one token to compute (its logits are needed). The caller takes a
        reference on them (``allocator.share``)."""
        pages: list[int] = []
        node = self._root
        now = next(self._clock)
        for key in self._keys(tokens, (len(tokens) - 1) // self.page_size):
            child = node.children.get(key)
            if child is None:
                break
            child.last_use = now
            pages.append(child.page)
            node = child
        return pages

    def insert(self, tokens: list[int], pages: list[int], num_computed: int) -> None:
        """Cache the full pages among the first ``num_computed`` tokens; pages whose
        content is already cached are left to their owner (freed on release)."""
        node = self._root
        now = next(self._clock)
        for key, page in zip(self._keys(tokens, num_computed // self.page_size), pages):
            child = node.children.get(key)
            if child is None:
                if page in self._nodes:  # the same page under another path cannot happen
                    raise AssertionError(f"page {page} cached twice")
                child = _Node(key, page, node, now)
                node.children[key] = child
                self._nodes[page] = child
                self.allocator.share([page])
            child.last_use = now
            node = child

    def evict(self, wanted: int) -> int:
        """Free up to ``wanted`` pages nobody but the tree holds, oldest leaves first."""
        freed = 0
        while freed < wanted:
            leaves = [n for n in self._nodes.values() if not n.children and self.allocator.refcount(n.page) == 1]
            if not leaves:
                break
            for leaf in sorted(leaves, key=lambda n: n.last_use)[: wanted - freed]:
                self._remove(leaf)
                freed += 1
        return freed

    def flush(self) -> int:
        """Drop every page only the tree holds (``POST /flush_cache``)."""
        return self.evict(len(self._nodes))

    def _remove(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.key]
        del self._nodes[node.page]
        self.allocator.free([node.page])
