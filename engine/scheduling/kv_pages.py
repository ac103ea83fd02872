"""Page allocator for the paged KV cache: pure bookkeeping, no tensors, no Trio."""

from __future__ import annotations

# What a sequence's table holds in place of a page it gave back (``Scheduler._drop_passed_pages``):
# a valid index (the KV pool is zeroed at start and holds finite values), read by no kernel with
# any weight: the windowed kernels skip or mask every position before the window.
DROPPED_PAGE = 0


class OutOfPages(Exception):
    """Raised when an allocation asks for more pages than are free."""


class PageAllocator:
    """Hands out page indices from a fixed pool with exact, reference-counted accounting.

    A page is free or held by one or more sequences (``share`` adds a holder,
    e.g. the n choices of one prompt). Releasing a page more often than it was
    taken is a bug and raises at once instead of corrupting the pool.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("a KV cache needs at least one page")
        self.num_pages = num_pages
        # Stack of free pages; low indices are handed out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs: dict[int, int] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return len(self._refs)

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """Add a holder to pages that are already held; returns them for the new holder."""
        for page in pages:
            if page not in self._refs:
                raise AssertionError(f"page {page} shared but not held")
            self._refs[page] += 1
        return list(pages)

    def free(self, pages: list[int]) -> None:
        """Drop one holder of each page; a page nobody holds goes back to the pool."""
        for page in pages:
            count = self._refs.get(page)
            if count is None:
                raise AssertionError(f"page {page} freed but not held")
            if count == 1:
                del self._refs[page]
                self._free.append(page)
            else:
                self._refs[page] = count - 1


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
