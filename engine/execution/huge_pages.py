"""A mapped file's pages moved, in place, into anonymous transparent huge pages.

A decode step streams every weight once, 4.7 GB a token for an 8B Q4_K_M file. Mapped from the
page cache those bytes sit in 4 KiB pages (ext4's cache of a file written once holds few large
folios, and Linux maps a file's pages huge only where it does): a TLB miss and a page walk every
4 KiB of the stream. In 2 MiB pages the same kernels read the stream faster: Q4_K matrices of the
8B file from memory 15.6 -> 16.2-18.1 GB/s; the 8B-shaped file's one stream 307-325 -> 264-296 ms
a token (two Sapphire Rapids cores, alternating runs). llama.cpp gets the same by reading the
file into its own buffers (``--no-mmap``); vLLM's CPU build by loading into torch tensors.

``promote`` copies a 2 MiB-aligned range of a mapping into a fresh anonymous region advised
``MADV_HUGEPAGE`` and ``mremap``s that region over the range: the addresses (and every tensor
viewing them) stay, the bytes are the same, and a kernel reading them at that moment sees the
old page or the new one, both the file's bytes. The mapping is private and never written, so
the copy is exactly what it held. The cost is memory: the pages become the process's own rather
than the page cache's, which several processes mapping one file share (``--dp`` replicas keep
the file's pages). Where transparent huge pages are off (``never``) nothing is moved.

Pages moved are no longer the page cache's, which the kernel drops under memory pressure and reads
again: they stay until the process ends. So moving stops (``room_for``) where it would leave less
than an eighth of the machine's memory (or its container's) available, and the rest of the file
stays mapped as it was: an 18.6 GB file on a 23 GB machine moved whole left 3.5 GB for everything
else, a larger one would have pushed the machine into the out-of-memory killer.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from trillm.engine.execution.gguf_support import available_memory, cgroup_memory_limit, meminfo
from trillm.engine.execution.native_memory import c_library

HUGE_PAGE = 2 << 20
PROT_READ, PROT_WRITE = 1, 2
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
MADV_HUGEPAGE = 14
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
MAP_FAILED = ctypes.c_void_p(-1).value
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
RESERVE_SHARE = 8  # moving stops where it would leave less than 1/8 of the memory available


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library with the calls a move needs declared, or None."""
    libc = c_library()
    if libc is None or not all(hasattr(libc, f) for f in ("mmap", "munmap", "mremap", "madvise")):
        return None
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munmap.restype = ctypes.c_int
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    libc.mremap.restype = ctypes.c_void_p
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def available() -> bool:
    """Whether this kernel hands out transparent huge pages to a region that asks (``always`` or
    ``madvise``) and the calls a move needs are there."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting and _libc() is not None


def aligned_inside(address: int, length: int) -> tuple[int, int]:
    """The whole huge pages inside [address, address + length): (start, length), length 0 if none."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    stop = (address + length) // HUGE_PAGE * HUGE_PAGE
    return start, max(0, stop - start)


def promote(address: int, length: int) -> bool:
    """Move [address, address + length) (huge-page aligned, mapped, readable) into anonymous huge
    pages holding the same bytes, at the same addresses. False (the range as it was) where a call
    is refused: no memory for the copy, or no libc."""
    libc = _libc()
    if libc is None or address % HUGE_PAGE or length % HUGE_PAGE or length == 0:
        return False
    spare = length + HUGE_PAGE  # room to align the copy: mremap keeps a huge page whole only when aligned
    region = libc.mmap(None, spare, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if region in (None, MAP_FAILED):
        return False
    copy = -(-region // HUGE_PAGE) * HUGE_PAGE
    moved = False
    try:
        libc.madvise(copy, length, MADV_HUGEPAGE)  # refused only where THP is off: then plain pages
        ctypes.memmove(copy, address, length)  # the GIL released (a foreign call)
        flags = MREMAP_MAYMOVE | MREMAP_FIXED
        moved = libc.mremap(copy, length, length, flags, address) == address
    finally:
        if moved:  # what is left of the region: the unaligned head and tail
            if copy > region:
                libc.munmap(region, copy - region)
            if region + spare > copy + length:
                libc.munmap(copy + length, region + spare - copy - length)
        else:
            libc.munmap(region, spare)
    return moved


def room_for(length: int) -> bool:
    """Whether ``length`` more bytes can become the process's own and still leave 1 / RESERVE_SHARE
    of the memory (the machine's, or its container's where that is less) available. True where
    neither figure is known."""
    free = available_memory()
    known = [n for n in (meminfo("MemTotal"), cgroup_memory_limit()) if n is not None]
    if free is None or not known:
        return True
    return free - length >= min(known) // RESERVE_SHARE
