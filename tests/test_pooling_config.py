"""How a model's embeddings are pooled (``engine/execution/pooling.py``): a sentence-transformers
folder's modules, a GGUF header's ``pooling_type``, the setting, and the default."""

from __future__ import annotations

import json

import numpy as np
from gguf import GGUFWriter

from trillm.engine.config import EngineConfig
from trillm.engine.execution.pooling import pooling_of


def _folder(tmp_path, mode_key: str | None, normalize: bool, config: dict | None = None):
    (tmp_path / "config.json").write_text(json.dumps(config or {"hidden_size": 8}))
    if mode_key is None:
        return tmp_path
    modules = [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({mode_key: True}))
    return tmp_path


def test_sentence_transformers_modules_name_the_pooling_and_the_normalization(tmp_path):
    config = EngineConfig(model=str(tmp_path))
    cls = pooling_of(config, _folder(tmp_path, "pooling_mode_cls_token", normalize=False))
    assert (cls.mode, cls.normalize, cls.source, cls.matryoshka) == ("cls", False, "sentence-transformers", False)


def test_a_chat_model_is_pooled_by_the_mean_normalized_unless_set(tmp_path):
    folder = _folder(tmp_path, None, normalize=True, config={"hidden_size": 8, "is_matryoshka": True})
    default = pooling_of(EngineConfig(model=str(folder)), folder)
    assert (default.mode, default.normalize, default.source, default.matryoshka) == ("mean", True, "default", True)
    assert pooling_of(EngineConfig(model=str(folder), pooling="last"), folder).mode == "last"


def test_a_gguf_header_names_its_pooling(tmp_path):
    path = tmp_path / "embed.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.pooling_type", 3)  # llama.cpp's LLAMA_POOLING_TYPE_LAST
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    found = pooling_of(EngineConfig(model=str(path)), None)
    assert (found.mode, found.source) == ("last", "gguf")
