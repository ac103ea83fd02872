"""Load a model for the engine: resolve weights, pick the dtype, read tokenizer and EOS ids."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llama import LlamaModel
from engine.model_runner import choose_dtype
from engine.model_source import resolve_model

log = logging.getLogger("trillm.engine")


def _eos_ids(folder: Path, config: dict[str, Any], tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    sources: list[Any] = [config.get("eos_token_id"), tokenizer.eos_token_id]
    gen = folder / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def load_model(config: EngineConfig) -> tuple[LlamaModel, Any, frozenset[int]]:
    """Weights, tokenizer and EOS ids for ``config.model`` (slow; call from a thread)."""
    from transformers import AutoTokenizer

    # The forward pass runs in the runner's worker thread with all cores. A
    # second OpenMP team on the loading thread would halve its speed on small
    # machines, so the caller's thread stays single-threaded.
    torch.set_num_threads(1)
    folder = resolve_model(config.model)
    model_config = json.loads((folder / "config.json").read_text())
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(config.dtype)
    if dtype is None:
        if config.dtype != "auto":
            raise ValueError(f"dtype must be auto, float32 or bfloat16, not {config.dtype!r}")
        dtype = choose_dtype()
    max_len = config.max_model_len or model_config.get("max_position_embeddings", 2048)
    model = LlamaModel.load(folder, model_config, dtype, max_len)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    log.info("loaded %s (%s) from %s", config.model, dtype, folder)
    return model, tokenizer, _eos_ids(folder, model_config, tokenizer)
