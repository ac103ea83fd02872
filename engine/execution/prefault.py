"""A GGUF file's mapped pages, read into this process's page tables in the background after start.

The weights are a memory-mapped view of the file (``gguf_model``): a page is read when a step
first touches it. For a mixture of experts that is a long warm-up: on the Qwen3-30B-A3B-shaped
file a token's first touch of each expert it picks costs a page fault per 4 KiB (minor where the
page cache holds the file, a disk read where not), and only 6.4 of its 18 GB had been touched
after 96 tokens; the first requests ran at 5.4 tok/s where the warm process runs 7.1. llama.cpp
reads the whole file at load (``MAP_POPULATE``), so its start waits for it. Here a daemon thread
asks the kernel for the pages (``madvise(MADV_POPULATE_READ)``, 64 MiB at a time, the GIL
released in ctypes) while the server already answers: start-up does not wait, and each chunk
read is one fewer fault in a step. Kernels before Linux 5.14 lack that advice: they get
``MADV_WILLNEED`` (read ahead into the page cache; the page tables still fill by faults).
The file fits in memory (``gguf_support.check_servable`` refused it otherwise), so nothing is
pushed out for it.

Tensors the loader copied out of the mapping (blocks repacked for faster kernels, rows reordered)
are never read from it again: ``release`` drops the pages their copy read from this process
(``MADV_DONTNEED``; the page cache keeps them) and the background read skips them, so a copied
weight is resident once, not twice (Gemma 3 270M's Q8_0 embedding: 178 MiB).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from trillm.engine.execution import huge_pages
from trillm.engine.execution.native_memory import c_library

log = logging.getLogger("trillm.engine")

MADV_WILLNEED, MADV_DONTNEED, MADV_POPULATE_READ = 3, 4, 22  # linux/mman.h
PAGE = 4096
CHUNK_BYTES = 64 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library with ``madvise`` declared, or None."""
    libc = c_library()
    if libc is None or not hasattr(libc, "madvise"):
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _inner_pages(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole pages inside each (offset, bytes) range of the file: what no other tensor shares."""
    pages = []
    for offset, nbytes in ranges:
        start, stop = -(-offset // PAGE) * PAGE, (offset + nbytes) // PAGE * PAGE
        if stop > start:
            pages.append((start, stop - start))
    return pages


def within(mapping: Any, pointer: int) -> bool:
    """Whether ``pointer`` lies in ``mapping`` (a tensor's data there is a view of it, not a copy)."""
    return mapping.ctypes.data <= pointer < mapping.ctypes.data + mapping.nbytes


def release(mapping: Any, copied: list[tuple[int, int]]) -> int:
    """Drop this process's pages of the (offset, bytes) ranges of ``mapping`` that were copied out and
    are not read from it again. Returns the bytes advised (0 where there is no libc)."""
    libc = _libc()
    if libc is None:
        return 0
    done = 0
    for start, length in _inner_pages(copied):
        if libc.madvise(mapping.ctypes.data + start, length, MADV_DONTNEED) == 0:
            done += length
    return done


_pending: dict[int, int] = {}  # a running read's id -> the bytes it has still to read
_pending_lock = threading.Lock()


def weights_pending_bytes() -> int:
    """Bytes of mapped weights this process's background reads have still to read (0: all in memory,
    and moved where they move): ``trillm:weights_pending_bytes``, which the bench waits on."""
    with _pending_lock:
        return sum(_pending.values())


def start(mapping: Any, name: str, skip: Sequence[tuple[int, int]] = (), huge: bool = False) -> threading.Thread | None:
    """Populate ``mapping`` (a numpy memmap of a whole file, kept alive by the thread) in the
    background, but for the (offset, bytes) ranges in ``skip``; None where there is no libc to ask.
    ``huge``: move the pages into anonymous huge pages where the kernel has them (``huge_pages``)."""
    libc = _libc()
    if libc is None or mapping.nbytes == 0:
        return None
    chunks = _chunks(mapping.nbytes, _inner_pages(list(skip)))
    huge = huge and huge_pages.available()
    key = object()
    with _pending_lock:  # counted before the thread runs: a scrape right after start sees it
        _pending[id(key)] = sum(length for _, length in chunks)
    thread = threading.Thread(
        target=_populate, args=(libc, mapping, name, chunks, huge, key), name="trillm-prefault", daemon=True
    )
    thread.start()
    return thread


def _chunks(size: int, skip: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) pieces of at most CHUNK_BYTES covering [0, size) without the skipped pages."""
    pieces, offset = [], 0
    for start, length in sorted(skip) + [(size, 0)]:
        for at in range(offset, start, CHUNK_BYTES):
            pieces.append((at, min(CHUNK_BYTES, start - at)))
        offset = max(offset, start + length)
    return pieces


def _populate(
    libc: ctypes.CDLL, mapping: Any, name: str, chunks: list[tuple[int, int]], huge: bool, key: object
) -> None:
    try:
        _read(libc, mapping, name, chunks, huge, key)
    except Exception:  # the pages are then read as steps touch them: slower, never wrong
        log.exception("%s: reading its pages ahead failed", name)
    finally:
        with _pending_lock:
            del _pending[id(key)]


def _read(libc: ctypes.CDLL, mapping: Any, name: str, chunks: list[tuple[int, int]], huge: bool, key: object) -> None:
    base, size = mapping.ctypes.data, mapping.nbytes  # a whole-file mapping: page-aligned
    advice, began, promoted = MADV_POPULATE_READ, time.perf_counter(), 0
    for offset, length in chunks:
        pieces = [(base + offset, length)]
        if huge:  # the whole huge pages moved; the edges, and all after a refusal, read in place
            inner, inner_length = huge_pages.aligned_inside(base + offset, length)
            if inner_length and not huge_pages.room_for(inner_length):
                huge = False
                log.info(
                    "%s: no huge pages from %d MiB on: the memory left available would fall under an eighth",
                    name,
                    offset >> 20,
                )
            elif inner_length and huge_pages.promote(inner, inner_length):
                promoted += inner_length
                end = base + offset + length
                pieces = [(base + offset, inner - base - offset), (inner + inner_length, end - inner - inner_length)]
            elif inner_length:
                huge = False
                log.info("%s: no huge pages from %d MiB on (errno %d)", name, offset >> 20, ctypes.get_errno())
        for address, piece in pieces:
            if piece <= 0 or libc.madvise(address, piece, advice) == 0:
                continue
            if advice == MADV_POPULATE_READ and ctypes.get_errno() == errno.EINVAL:
                advice = MADV_WILLNEED  # an older kernel: read ahead instead
                libc.madvise(address, piece, advice)
                continue
            log.info("%s: reading its pages ahead stopped at %d MiB (errno %d)", name, offset >> 20, ctypes.get_errno())
            return
        with _pending_lock:
            _pending[id(key)] -= length
    how = "mapped" if advice == MADV_POPULATE_READ else "read ahead"
    moved = f", {promoted / 2**30:.1f} GiB of it into huge pages" if promoted else ""
    log.info("%s: %.1f GiB %s%s in %.1f s", name, size / 2**30, how, moved, time.perf_counter() - began)
