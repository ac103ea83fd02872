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
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import threading
import time
from typing import Any

from trillm.engine.execution.native_memory import c_library

log = logging.getLogger("trillm.engine")

MADV_WILLNEED, MADV_POPULATE_READ = 3, 22  # linux/mman.h
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


def start(mapping: Any, name: str) -> threading.Thread | None:
    """Populate ``mapping`` (a numpy memmap of a whole file, kept alive by the thread) in the
    background; None where there is no libc to ask."""
    libc = _libc()
    if libc is None or mapping.nbytes == 0:
        return None
    thread = threading.Thread(target=_populate, args=(libc, mapping, name), name="trillm-prefault", daemon=True)
    thread.start()
    return thread


def _populate(libc: ctypes.CDLL, mapping: Any, name: str) -> None:
    base, size = mapping.ctypes.data, mapping.nbytes  # a whole-file mapping: page-aligned
    advice, began = MADV_POPULATE_READ, time.perf_counter()
    for offset in range(0, size, CHUNK_BYTES):
        length = min(CHUNK_BYTES, size - offset)
        if libc.madvise(base + offset, length, advice) == 0:
            continue
        if advice == MADV_POPULATE_READ and ctypes.get_errno() == errno.EINVAL:
            advice = MADV_WILLNEED  # an older kernel: read ahead instead
            libc.madvise(base + offset, length, advice)
            continue
        log.info("%s: reading its pages ahead stopped at %d MiB (errno %d)", name, offset >> 20, ctypes.get_errno())
        return
    how = "mapped" if advice == MADV_POPULATE_READ else "read ahead"
    log.info("%s: %.1f GiB %s in %.1f s", name, size / 2**30, how, time.perf_counter() - began)
