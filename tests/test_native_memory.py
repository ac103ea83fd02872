"""glibc's mmap threshold, pinned: the cause of the memory that grew under load (``native_memory``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from trillm.engine.execution import native_memory

glibc = pytest.mark.skipif(native_memory._glibc() is None, reason="glibc's malloc only")

# In a fresh process: free a 20 MiB block (glibc's threshold rises to 20 MiB unless pinned), then
# allocate 1 MiB and print how many bytes of it glibc mapped on its own (0: it came from an arena).
SCRIPT = """
import ctypes, sys
from trillm.engine.execution import native_memory
class Info(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if sys.argv[1] == "pin":
    assert native_memory.pin_mmap_threshold()
libc.free(libc.malloc(20 << 20))
before = libc.mallinfo2().hblkhd
block = libc.malloc(1 << 20)
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped_after_a_large_free(mode: str, **env: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return int(out.stdout)


@glibc
def test_regression_one_large_free_no_longer_moves_mib_blocks_into_the_arenas():
    """Unpinned, glibc serves the 1 MiB block from an arena that keeps it when freed (the growth);
    pinned, it maps it on its own and hands it back when freed."""
    assert _mapped_after_a_large_free("default") == 0
    assert _mapped_after_a_large_free("pin") >= 1 << 20


@glibc
def test_an_operators_malloc_mmap_threshold_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    assert native_memory.pin_mmap_threshold() is False
