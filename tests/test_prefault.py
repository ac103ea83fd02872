"""A mapped weights file's pages read into the process in the background (``prefault``)."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from trillm.engine.execution import prefault

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")


def rss_file() -> int:
    """Bytes of mapped files resident in this process's page tables."""
    return int(re.search(r"RssFile:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def test_the_whole_mapping_becomes_resident(tmp_path, caplog):
    path = tmp_path / "weights.bin"
    size = 96 << 20  # past one chunk: the loop's every step
    path.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    mapping = np.memmap(path, dtype=np.uint8, mode="c")
    before = rss_file()
    assert rss_file() - before < size // 8  # mapping reads nothing
    with caplog.at_level(logging.INFO, logger="trillm.engine"):
        thread = prefault.start(mapping, path.name)
        assert thread is not None and thread.daemon
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert rss_file() - before >= 0.9 * size  # every page now in this mapping's tables
    assert any("weights.bin: 0.1 GiB" in r.getMessage() for r in caplog.records)
    assert int(mapping[size - 1]) == path.read_bytes()[-1]  # the same bytes
    del mapping


def test_the_bytes_still_to_read_are_counted_until_the_read_ends(tmp_path, monkeypatch):
    """``weights_pending_bytes`` (the ``trillm:weights_pending_bytes`` gauge) counts a read from before its
    thread runs until it ends, even when it ends by an error."""
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(12 << 20))
    mapping = np.memmap(path, dtype=np.uint8, mode="c")
    go = threading.Event()

    def read(*args):
        go.wait(10)
        raise OSError("a read that fails")

    monkeypatch.setattr(prefault, "_read", read)
    before = prefault.weights_pending_bytes()
    thread = prefault.start(mapping, path.name, skip=[(0, 4 << 20)])
    assert thread is not None
    assert prefault.weights_pending_bytes() - before == 8 << 20  # all but the skipped pages
    go.set()
    thread.join(timeout=10)
    assert prefault.weights_pending_bytes() == before
    del mapping


def test_copied_ranges_are_skipped_and_released(tmp_path):
    """Weights the loader copied out (repacked blocks) are resident once: their pages are dropped after
    the copy read them and the background read leaves them alone; the rest is read, bytes unchanged."""
    path = tmp_path / "weights.bin"
    size = 80 << 20
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    mapping = np.memmap(path, dtype=np.uint8, mode="c")
    copied = [(1000, 40 << 20)]  # not page-aligned: only its whole pages are dropped or skipped
    before = rss_file()
    copy = np.array(mapping[1000 : 1000 + (40 << 20)])  # the loader's copy reads them in
    assert rss_file() - before >= 0.9 * (40 << 20)
    assert prefault.release(mapping, copied) == (40 << 20) - 4096  # [4096, 40 MiB) of whole pages
    assert rss_file() - before < 4 << 20  # (other files this process maps may add a little)
    thread = prefault.start(mapping, path.name, skip=copied)
    assert thread is not None
    thread.join(timeout=60)
    grown = rss_file() - before
    assert 0.9 * (40 << 20) <= grown <= (44 << 20)  # the other half only
    assert np.array_equal(copy, data[1000 : 1000 + (40 << 20)]) and int(mapping[2000]) == int(data[2000])
    assert prefault._chunks(100, [(10, 20), (50, 10)]) == [(0, 10), (30, 20), (60, 40)]
    del mapping
