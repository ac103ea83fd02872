"""glibc's mmap threshold, pinned: the cause of the memory that grew under load (``native_memory``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trillm.engine.execution import native_memory

glibc = pytest.mark.skipif(native_memory._glibc() is None, reason="glibc's malloc only")

# In a fresh process, pinned: 64 blocks of 1 MiB (a prefill chunk's activations) written, then freed; the
# bytes glibc mapped on its own for them (0: the arenas served them, to be reused layer after layer without
# page faults), the resident bytes ``trim`` hands back once they are free, and the bytes it maps on its
# own for one 40 MiB block (above the pin: back to the kernel the moment it is freed).
SCRIPT = """
import ctypes, sys
from trillm.engine.execution import native_memory
class Info(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
assert native_memory.pin_mmap_threshold()
before = libc.mallinfo2().hblkhd
big = libc.malloc(40 << 20)
mapped_big = libc.mallinfo2().hblkhd - before
libc.free(big)
before = libc.mallinfo2().hblkhd
blocks = [libc.malloc(1 << 20) for _ in range(64)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
later = libc.malloc(200 << 10)  # still in use above them: their free space is a hole, not the heap's top
mapped_small = libc.mallinfo2().hblkhd - before
for b in blocks:
    libc.free(b)
kept = rss()
native_memory.trim()
handed_back = kept - rss()
print(mapped_small, handed_back, mapped_big)
"""


@glibc
def test_the_arenas_serve_a_chunks_activations_and_trim_hands_them_back():
    """Pinned at 32 MiB: blocks below come from the arenas (a prefill chunk's activations reused layer
    after layer: SmolLM2's 2,000-token prefill 2.45 -> 1.3 s against the 128 KiB pin), what they keep
    once freed goes back with ``trim`` (the engine's, when idle and every 5 s under load), and a block
    above the pin is mapped on its own."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    mapped_small, handed_back, mapped_big = (int(v) for v in out.stdout.split())
    assert mapped_small == 0
    assert handed_back >= 48 << 20
    assert mapped_big >= 40 << 20
    assert native_memory.MMAP_THRESHOLD_BYTES == 32 << 20


@glibc
def test_an_operators_malloc_mmap_threshold_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    assert native_memory.pin_mmap_threshold() is False
