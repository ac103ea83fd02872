"""A mapped file's pages moved in place into anonymous huge pages (``huge_pages``), alone, under a
concurrent reader, through the background read (``prefault``), and under a real GGUF file's weights."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from trillm.engine.config import EngineConfig
from trillm.engine.execution import huge_pages, prefault
from trillm.engine.execution.gguf_header import read_header
from trillm.engine.execution.gguf_model import gguf_weights
from trillm.engine.execution.model_source import fetch_packaged
from trillm.engine.execution.packaged_models import GEMMA3_270M
from trillm.kernels.gguf_blocks import GGUFWeight

pytestmark = pytest.mark.skipif(
    huge_pages._libc() is None or not Path("/proc/self/smaps").exists(), reason="Linux's mremap and smaps"
)
MiB = 1 << 20


def mapping_of(path: Path, size: int, seed: int = 0) -> tuple[np.memmap, np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return np.memmap(path, dtype=np.uint8, mode="c"), data


def region_of(address: int) -> dict[str, str]:
    """The smaps entry of the mapping holding ``address``: its header's path ('' when anonymous) and fields."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            if entry is not None:
                return entry
            start, stop = (int(x, 16) for x in head[0].split("-"))
            entry = {"path": " ".join(head[5:])} if start <= address < stop else None
        elif entry is not None:
            entry[head[0].rstrip(":")] = head[1]
    assert entry is not None, f"{address:#x} is not mapped"
    return entry


def test_aligned_inside():
    H = huge_pages.HUGE_PAGE
    assert huge_pages.aligned_inside(0, 3 * H) == (0, 3 * H)
    assert huge_pages.aligned_inside(1, 3 * H) == (H, 2 * H)
    assert huge_pages.aligned_inside(H - 4096, H + 8192) == (H, H)
    assert huge_pages.aligned_inside(4096, H) == (H, 0)
    assert huge_pages.promote(4096, huge_pages.HUGE_PAGE) is False  # unaligned: refused, nothing moved


def test_a_promoted_range_keeps_its_addresses_and_bytes(tmp_path):
    path = tmp_path / "weights.bin"
    mapping, data = mapping_of(path, 9 * MiB + 123)
    start, length = huge_pages.aligned_inside(mapping.ctypes.data + 1, mapping.nbytes - 1)
    assert length >= 4 * MiB
    view = mapping[start - mapping.ctypes.data :][:length]  # a tensor's view, taken before the move
    assert region_of(start)["path"] == str(path)
    assert huge_pages.promote(start, length)
    after = region_of(start)
    assert after["path"] == ""  # anonymous now, at the same address
    assert np.array_equal(mapping, data) and np.array_equal(view, data[start - mapping.ctypes.data :][:length])
    if huge_pages.available():  # the kernel may still refuse a huge page (no contiguous memory)
        assert int(after["AnonHugePages"]) > 0
    del view, mapping


def test_readers_during_the_move_see_the_files_bytes(tmp_path):
    """The kernels read the weights while the background thread moves them: every read, before,
    during and after each mremap, sees the file's bytes."""
    mapping, data = mapping_of(tmp_path / "weights.bin", 32 * MiB, seed=2)
    expected = int(data.astype(np.int64).sum())
    sums, stop = [], threading.Event()

    def read() -> None:
        while not stop.is_set():
            sums.append(int(torch.from_numpy(mapping).sum(dtype=torch.int64)))  # the GIL released

    reader = threading.Thread(target=read)
    reader.start()
    start, length = huge_pages.aligned_inside(mapping.ctypes.data, mapping.nbytes)
    moved = [huge_pages.promote(a, huge_pages.HUGE_PAGE) for a in range(start, start + length, huge_pages.HUGE_PAGE)]
    stop.set()
    reader.join()
    assert all(moved) and len(moved) >= 15
    assert sums and all(s == expected for s in sums)


def test_the_background_read_moves_all_but_the_skipped_ranges(tmp_path):
    path = tmp_path / "weights.bin"
    mapping, data = mapping_of(path, 40 * MiB + 500, seed=3)
    base = mapping.ctypes.data
    copied = [(10 * MiB + 7, 8 * MiB)]  # copied out by the loader: released, never read again
    prefault.release(mapping, copied)
    thread = prefault.start(mapping, path.name, skip=copied, huge=True)
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert np.array_equal(mapping[: 10 * MiB], data[: 10 * MiB])
    assert np.array_equal(mapping[19 * MiB :], data[19 * MiB :])
    if huge_pages.available():
        assert region_of(base + 30 * MiB)["path"] == ""  # moved
        skipped = region_of(base + 14 * MiB)
        # Left as it was, unread: only its edges' pages are resident (a large folio of the page cache
        # is mapped whole when one of its pages is read, up to 2 MiB an edge).
        assert skipped["path"] == str(path) and int(skipped["Rss"]) * 1024 <= 4 * MiB
    del mapping


def test_moving_stops_short_of_the_memory_reserve(tmp_path, monkeypatch, caplog):
    """Moved pages are the process's own until it ends: where a move would leave less than an eighth
    of the memory available, the rest of the file is read in place, mapped as it was."""
    path = tmp_path / "weights.bin"
    mapping, data = mapping_of(path, 32 * MiB, seed=5)
    monkeypatch.setattr(prefault, "CHUNK_BYTES", 8 * MiB)
    monkeypatch.setattr(huge_pages, "meminfo", lambda key: 800 * MiB)  # a reserve of 100 MiB
    monkeypatch.setattr(huge_pages, "cgroup_memory_limit", lambda: None)
    free = [1024 * MiB]
    monkeypatch.setattr(huge_pages, "available_memory", lambda: free[0])
    assert huge_pages.room_for(8 * MiB)
    free[0] = 105 * MiB
    assert huge_pages.room_for(5 * MiB) and not huge_pages.room_for(6 * MiB)
    asked = []

    def available() -> int:
        asked.append(1)
        return 1024 * MiB if len(asked) == 1 else 105 * MiB  # room for the first chunk only

    monkeypatch.setattr(huge_pages, "available_memory", available)
    with caplog.at_level("INFO", logger="trillm"):
        thread = prefault.start(mapping, path.name, huge=True)
        assert thread is not None
        thread.join(timeout=60)
    assert np.array_equal(mapping, data) and prefault.weights_pending_bytes() == 0
    if huge_pages.available():
        base = mapping.ctypes.data
        assert len(asked) == 2  # asked before the first move and the second, never again
        assert region_of(base + 4 * MiB)["path"] == ""  # the first chunk's interior moved
        assert region_of(base + 20 * MiB)["path"] == str(path)  # the rest left mapped
        assert "would fall under an eighth" in caplog.text
    del mapping


def test_without_huge_pages_the_file_stays_mapped(tmp_path):
    path = tmp_path / "weights.bin"
    mapping, data = mapping_of(path, 12 * MiB, seed=4)
    thread = prefault.start(mapping, path.name, huge=False)
    assert thread is not None
    thread.join(timeout=60)
    assert region_of(mapping.ctypes.data + 6 * MiB)["path"] == str(path)
    assert np.array_equal(mapping, data)
    del mapping


@pytest.mark.model
def test_a_gguf_files_blocks_are_the_same_after_the_move():
    """The Gemma 3 file's weights, kept in its blocks and moved into huge pages by the background
    read, hold the bytes a load without the move holds."""
    header = read_header(fetch_packaged(GEMMA3_270M.alias, EngineConfig().cache_path))
    moved = gguf_weights(header, blocks=True, prefault=True, huge_pages=True)
    for thread in threading.enumerate():
        if thread.name == "trillm-prefault":
            thread.join(timeout=120)
    plain = gguf_weights(header, blocks=True)
    direct = [name for name, w in moved.items() if isinstance(w, GGUFWeight)]
    assert len(direct) > 100
    for name in direct:
        assert torch.equal(moved[name].data, plain[name].data), name
    if not huge_pages.available():
        return
    # Every whole huge page inside a run of weights read from the mapping is anonymous now (the runs'
    # edges touch what the loader copied out: those pages stay the file's, unread).
    spans = sorted((w.data.data_ptr(), w.data.data_ptr() + w.nbytes) for w in (moved[n] for n in direct))
    runs = [list(spans[0])]
    for start, stop in spans[1:]:
        if start - runs[-1][1] < 4096:  # alignment padding or a small vector decoded at load between them
            runs[-1][1] = max(runs[-1][1], stop)
        else:
            runs.append([start, stop])
    pages: list[int] = []
    for start, stop in runs:
        first, length = huge_pages.aligned_inside(start, stop - start)
        pages += range(first, first + length, huge_pages.HUGE_PAGE)
    assert len(pages) >= 10
    assert all(region_of(p)["path"] == "" for p in pages)
