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


# In a fresh process with the server's pinned threshold: Gemma 3's file loaded (the heap then holds
# freed blocks of the load, which calloc reuses and must zero by hand), then a float16 KV pool made as
# the runner makes it (1,820 pages: 18 layers of 14.2 MiB each for K and for V, under the threshold).
# With SmolLM2's load the heap held no such blocks and calloc's pages stayed untouched.
POOL = """
import gc, torch
from trillm.engine.config import EngineConfig
from trillm.engine.execution import loading, native_memory
from trillm.engine.execution.model_runner import ModelRunner
native_memory.pin_mmap_threshold()
def status(key):
    return int([l for l in open("/proc/self/status") if l.startswith(key)][0].split()[1]) << 10
model = loading.load_model(EngineConfig(model="gemma-3-270m-q4_k_m", prefault=False))[0]
native_memory.trim()
anon, size = status("RssAnon"), status("VmSize")
runner = ModelRunner(model, 1820, 16)
made = status("RssAnon") - anon
runner.kv_cache[3][0][7].fill_(1.5)
written = status("RssAnon") - anon
del runner
gc.collect()
print(made, written, status("VmSize") - size)
"""


@glibc
def test_regression_the_kv_pool_is_resident_only_as_written_whatever_its_layers_size():
    """Below malloc's mmap threshold, calloc zeroed a layer's pages by hand where it reused freed heap
    blocks: 241 MiB of Gemma 3's 530 MiB float16 pool was resident at start. Now each layer is a
    mapping of its own, unmapped with it."""
    out = subprocess.run([sys.executable, "-c", POOL], capture_output=True, text=True, check=True)
    made, written, left = (int(v) for v in out.stdout.split())
    assert made < 16 << 20, f"{made >> 20} MiB of the pool resident before anything was written"
    assert 4096 <= written < made + (8 << 20)
    assert left < 64 << 20  # its 512 MiB of mappings went with it
