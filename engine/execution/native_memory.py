"""glibc's malloc, set for a process that allocates and frees vocabulary-sized tensors every step;
and how much of a file the page cache already holds (``resident_file_bytes``).

glibc serves a block at or above its mmap threshold (128 KiB at start) with its own
``mmap``, returned to the kernel when freed. But the threshold is dynamic: each time
such a block is freed, it rises to that block's size (up to 32 MiB). After one long
prompt's prefill freed its multi-MiB attention buffers, every per-step tensor below
the new threshold (logits, sampler and mask buffers, activations) came from the heap
arenas instead, and the arenas keep what is freed in them: measured, ~180 KB more
resident memory per tiny request, with no plateau, all of it handed back by
``malloc_trim(0)`` (so freed memory kept, not a leak). ``pin_mmap_threshold`` fixes
the threshold (``mallopt(M_MMAP_THRESHOLD)`` also turns the dynamic rise off), so
large blocks keep going back to the kernel; ``trim`` hands back what the arenas
keep, for when the engine goes idle.

Without glibc (musl, macOS) both do nothing. An operator's own
``MALLOC_MMAP_THRESHOLD_`` wins: glibc read it at start, and it turned the rise off too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os

import numpy as np
import torch

log = logging.getLogger("trillm.engine")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value: what the process measured flat with


@functools.cache
def c_library() -> ctypes.CDLL | None:
    """The C library, its errno kept for ``ctypes.get_errno`` (which call the kernel refused); None
    where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library, if it is glibc (it has ``malloc_trim``); else None."""
    lib = c_library()
    if lib is None or not hasattr(lib, "malloc_trim") or not hasattr(lib, "mallopt"):
        return None
    lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.malloc_trim.argtypes = [ctypes.c_size_t]
    return lib


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (process-wide, every arena); idempotent.

    Returns whether it was set here: False without glibc or when ``MALLOC_MMAP_THRESHOLD_``
    is in the environment (the operator's choice stands)."""
    libc = _glibc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) failed; resident memory may grow under load", nbytes)
        return False
    return True


def trim() -> bool:
    """Hand the kernel the free memory every malloc arena keeps (``malloc_trim(0)``); returns
    whether any was. Takes a few milliseconds on a model-sized heap: call it when idle."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def resident_file_bytes(path: os.PathLike[str] | str) -> int:
    """Bytes of ``path`` already in the page cache (``mincore`` over a mapping of it): a file another
    process maps (a second server on the same GGUF file) needs no memory of its own when we map it
    too. 0 where it cannot be told (no libc, an empty file)."""
    libc = _glibc()
    size = os.path.getsize(path)
    if libc is None or size == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: nothing is read
        if address in (None, ctypes.c_void_p(-1).value):
            return 0
        try:
            pages = ctypes.create_string_buffer((size + page - 1) // page)
            if libc.mincore(address, size, pages) != 0:
                return 0
            return int((np.frombuffer(pages.raw, dtype=np.uint8) & 1).sum()) * page
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros whose pages are not resident until written, on the CPU: the KV pool. ``torch.zeros``
    writes every page (a 512 MiB pool was resident from the start, however little of it a load
    used). Each tensor is an anonymous mapping of its own, whose fresh zero pages the kernel backs
    as they are touched, as llama.cpp's buffers are: ``calloc`` did so only above malloc's mmap
    threshold (pinned at 32 MiB), and a float16 layer of Gemma 3's pool (15 MiB) came from the heap,
    zeroed by hand, so 241 MiB of a 530 MiB pool was resident at start. The mapping goes with the
    tensor. Elsewhere, ``torch.zeros``."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
