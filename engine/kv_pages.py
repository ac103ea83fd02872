"""Page allocator for the paged KV cache: pure bookkeeping, no tensors, no Trio."""

from __future__ import annotations


class OutOfPages(Exception):
    """Raised when an allocation asks for more pages than are free."""


class PageAllocator:
    """Hands out page indices from a fixed pool with exact accounting.

    Every page is either free or owned; freeing a page twice or one that was
    never handed out is a bug and raises at once instead of corrupting the pool.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("a KV cache needs at least one page")
        self.num_pages = num_pages
        # Stack of free pages; low indices are handed out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._owned: set[int] = set()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return len(self._owned)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._owned.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._owned:
                raise AssertionError(f"page {page} freed but not owned")
            self._owned.remove(page)
            self._free.append(page)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
