"""How a model's embeddings are pooled (``/v1/embeddings``): from its own configuration.

A sentence-transformers folder says it in ``modules.json`` and ``1_Pooling/config.json``
(``pooling_mode_lasttoken`` for Qwen3-Embedding, ``pooling_mode_cls_token``,
``pooling_mode_mean_tokens``) and normalizes when it lists a ``Normalize`` module; a GGUF
file in ``<arch>.pooling_type`` (llama.cpp's: 1 mean, 2 CLS, 3 last). A model that names
none (a chat model) is pooled by the mean of its last hidden states, normalized, as the
issue of embeddings from any served model asks. ``dimensions`` may truncate only where the
config says the model was trained for it (Matryoshka), as vLLM checks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import attrs

from trillm.engine.config import EngineConfig

log = logging.getLogger("trillm.engine")

_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean"}


@attrs.frozen
class Pooling:
    mode: str  # "mean", "cls" or "last"
    normalize: bool
    source: str  # where it was read: "sentence-transformers", "gguf", "setting" or "default"
    matryoshka: bool = False  # ``dimensions`` may truncate
    matryoshka_dimensions: tuple[int, ...] = ()  # the sizes it may truncate to; () any


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _sentence_transformers(folder: Path) -> tuple[str, bool] | None:
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list):
        return None
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m.get("path", "") for m in modules if isinstance(m, dict)}
    if "Pooling" not in kinds:
        return None
    config = _json(folder / kinds["Pooling"] / "config.json") or {}
    mode = next((mode for key, mode in _ST_MODES.items() if config.get(key)), None)
    return (mode, "Normalize" in kinds) if mode else None


def _gguf(config: EngineConfig) -> str | None:
    from trillm.engine.execution.gguf_header import read_header
    from trillm.engine.execution.model_source import gguf_file

    path = gguf_file(config.model, config.cache_path)
    if path is None:
        return None
    metadata = read_header(path).metadata
    arch = metadata.get("general.architecture")
    return _GGUF_POOLING.get(int(metadata.get(f"{arch}.pooling_type", 0)))


def pooling_of(config: EngineConfig, folder: Path | None) -> Pooling:
    """``config.pooling`` if set, else what the model's files name, else the mean, normalized."""
    model_config = (_json(folder / "config.json") if folder is not None else None) or {}
    sizes = model_config.get("matryoshka_dimensions") or ()
    matryoshka = bool(model_config.get("is_matryoshka") or sizes)
    found = _sentence_transformers(folder) if folder is not None else None
    mode, normalize, source = (found[0], found[1], "sentence-transformers") if found else (None, True, "default")
    if mode is None:
        try:
            mode, source = _gguf(config), "gguf"
        except Exception:  # an unreadable header: the default
            log.debug("no pooling read from the GGUF header", exc_info=True)
    if mode is None:
        mode, source = "mean", "default"
    if config.pooling != "auto":
        mode, source = config.pooling, "setting"
    return Pooling(mode, normalize, source, matryoshka, tuple(int(s) for s in sizes))


def pooling_for(config: EngineConfig) -> Pooling:
    """``pooling_of`` the served model's folder (none for a model that cannot be resolved here)."""
    from trillm.engine.execution.loading import model_folder

    try:
        folder: Path | None = model_folder(config)
    except (OSError, ValueError):
        folder = None
    return pooling_of(config, folder)
