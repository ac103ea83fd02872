"""Damaged model files are refused in one line naming them, or rebuilt, never served; start-up
failures of ``trillm serve`` are one line and a non-zero exit, before any heavy work where they can be."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trillm.engine.config import EngineConfig
from trillm.engine.execution.file_checks import READY_MARK, DamagedModelFile, check_gguf, entry_problem
from trillm.engine.execution.model_source import (
    DEFAULT_ALIAS,
    _is_ready,
    converted_default,
    default_gguf,
    entry_lock,
    fetch_default_gguf,
)

pytestmark = pytest.mark.slow  # subprocess servers, and the default model fetched again

SERVE = [sys.executable, "-m", "trillm.api.cli", "serve"]


def _damage(file: Path, keep_mtime: bool) -> None:
    """The issue's damage: 16 MB of 0xFF in the middle of the file (NaNs in float32 and bf16)."""
    before = file.stat()
    with open(file, "r+b") as f:
        f.seek(before.st_size // 2 // 4096 * 4096)
        f.write(b"\xff" * (16 * 1024 * 1024))
    if keep_mtime:
        os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.fixture
def cache_copy(model_dir, tmp_path) -> Iterator[Path]:
    """A cache folder holding a copy of the converted default model (mtimes kept, as ``cp -p``)."""
    entry = tmp_path / DEFAULT_ALIAS
    shutil.copytree(model_dir, entry)  # copy2: mtimes kept
    assert entry_problem(entry) is None
    assert "files" in json.loads((entry / READY_MARK).read_text())  # sizes, mtimes and hashes recorded
    yield tmp_path
    shutil.rmtree(entry, ignore_errors=True)  # 540 MB: not left for pytest's kept temporary folders


def _serve_fails(*args: str, timeout: float = 120) -> tuple[str, float]:
    start = time.monotonic()
    proc = subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=timeout)
    took = time.monotonic() - start
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("[trillm] cannot start: "), proc.stderr
    return lines[0], took


def test_regression_16mb_of_ff_in_the_cached_weights_rebuild_the_entry(cache_copy, capsys):
    entry = cache_copy / DEFAULT_ALIAS
    (entry / "config.json").touch()  # a new mtime alone: hashed again, still the same, recorded
    assert entry_problem(entry) is None
    mark = json.loads((entry / READY_MARK).read_text())
    assert mark["files"]["config.json"]["mtime_ns"] == (entry / "config.json").stat().st_mtime_ns
    _damage(entry / "model.safetensors", keep_mtime=False)
    problem = entry_problem(entry)
    assert problem is not None and "model.safetensors" in problem and "SHA-256" in problem
    assert not _is_ready(entry) and not entry.exists()  # removed, so it is converted again
    assert f"rebuilding {entry}" in capsys.readouterr().err


def test_regression_damage_that_kept_size_and_mtime_is_refused_at_start_in_one_line(cache_copy):
    """The marker cannot see it; the finiteness check of the loaded weights does."""
    weights = cache_copy / DEFAULT_ALIAS / "model.safetensors"
    _damage(weights, keep_mtime=True)
    assert entry_problem(weights.parent) is None
    # The converted entry served as the checkpoint folder it is (the alias reads its GGUF file).
    line, _ = _serve_fails(
        "--model", str(weights.parent), "--cache-dir", str(cache_copy), "--port", "0", "--dtype", "float32"
    )
    assert f"{weights} is damaged: tensor" in line and "NaN" in line
    assert f"delete {weights.parent} and start again to rebuild it" in line


def test_regression_a_truncated_download_is_fetched_again(tmp_path, capsys):
    whole = default_gguf(EngineConfig().cache_path)
    cut = default_gguf(tmp_path)
    cut.parent.mkdir()
    with open(whole, "rb") as src:
        cut.write_bytes(src.read(whole.stat().st_size // 2))
    with pytest.raises(DamagedModelFile, match="truncated") as refused:
        check_gguf(cut)
    assert str(cut) in str(refused.value)
    assert fetch_default_gguf(tmp_path) == cut
    assert cut.stat().st_size == whole.stat().st_size
    check_gguf(cut)
    assert f"{cut} is truncated or damaged: fetching it again" in capsys.readouterr().err


def test_regression_processes_starting_at_once_take_turns_preparing_the_default_model(model_dir, tmp_path):
    """On a new machine two processes (replicas, workers of a parallel test run) downloaded and
    converted into the same temporary folders at once; the second now waits for the one preparing
    the entry and finds it ready, fetching nothing."""
    entry = tmp_path / DEFAULT_ALIAS
    found: list[Path] = []
    second = threading.Thread(target=lambda: found.append(converted_default(tmp_path)))
    with entry_lock(entry):
        second.start()
        second.join(0.5)
        assert second.is_alive()  # waiting for the lock
        shutil.copytree(model_dir, entry)  # what the first one's preparation leaves
    second.join(60)
    assert found == [entry]
    assert not (tmp_path / "downloads").exists()


def test_regression_a_truncated_gguf_given_by_path_is_one_line_naming_it(tmp_path):
    whole = default_gguf(EngineConfig().cache_path)
    cut = tmp_path / "cut.gguf"
    with open(whole, "rb") as src:
        cut.write_bytes(src.read(whole.stat().st_size - 4096))
    line, _ = _serve_fails("--model", str(cut), "--cache-dir", str(tmp_path), "--port", "0")
    assert f"{cut} is" in line and "truncated" in line and "download it again" in line


def test_regression_a_busy_port_is_one_line_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # An empty cache: had it loaded the model first, it would download and convert it.
        line, took = _serve_fails("--port", str(port), "--cache-dir", str(tmp_path))
    assert line == f"[trillm] cannot start: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert took < 30 and not any(tmp_path.iterdir())
