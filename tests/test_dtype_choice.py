"""``--dtype auto`` keeps the block path for decode, even where bfloat16 matmuls are faster.

Regression: on a CPU with AMX, ``auto`` timed one batched matmul, found bfloat16
faster and served the default model with 0 of 121 projections in blocks (7x slower
decode). The probe is faked here to answer as such a machine does.
"""

from __future__ import annotations

import logging

import pytest
import torch

from trillm.engine.config import EngineConfig
from trillm.engine.execution import dtype_choice, loading
from trillm.kernels import cpu_matmul


def amx_like(rows: int, width: int, out: int, dtype: torch.dtype) -> float:
    """A machine whose bfloat16 matmuls are 5x faster than float32 (Sapphire Rapids' AMX)."""
    return 1e-4 if dtype == torch.bfloat16 else 5e-4


def no_bf16(rows: int, width: int, out: int, dtype: torch.dtype) -> float:
    """A machine without native bfloat16 (AVX2 only): bfloat16 is emulated, slower."""
    return 5e-4 if dtype == torch.bfloat16 else 1e-4


def block_path_here() -> bool:
    """Whether this machine runs the float32 block path (a C compiler and SIMD)."""
    return cpu_matmul.available() and cpu_matmul.simd() != "plain"


@pytest.fixture
def default_model() -> tuple[EngineConfig, object, dict]:
    """The default model as loading sees it: its GGUF file's header is where its weights are."""
    config = EngineConfig()
    folder = loading.model_folder(config)
    return config, loading._weights_source(config, folder), loading.json.loads((folder / "config.json").read_text())


def test_auto_keeps_blocks_on_an_amx_cpu(default_model) -> None:
    config, folder, model_config = default_model
    choice = dtype_choice.choose_dtype(config, torch.device("cpu"), folder, model_config, amx_like)
    if block_path_here():
        assert choice.dtype == torch.float32
        assert "the GGUF file's blocks" in choice.reason
        # Q4_1 in the file is 0.625 bytes a weight (float16 scales included): the reason says what it read.
        assert "0.62 bytes a weight" in choice.reason
    else:  # no block path to keep: the decode-shaped probe decides
        assert choice.dtype == torch.bfloat16


def test_dense_weights_follow_the_decode_probe(default_model) -> None:
    config, folder, model_config = default_model
    dense = EngineConfig(weight_format="dense")
    amx = dtype_choice.choose_dtype(dense, torch.device("cpu"), folder, model_config, amx_like)
    assert amx.dtype == torch.bfloat16 and "dense weights" in amx.reason
    avx2 = dtype_choice.choose_dtype(dense, torch.device("cpu"), folder, model_config, no_bf16)
    assert avx2.dtype == torch.float32
    # The probe is decode-shaped, on the model's own widths.
    assert f"1x{model_config['hidden_size']} @ {model_config['hidden_size']}x" in amx.reason


def test_random_dummy_weights_are_never_blocks(default_model) -> None:
    _, folder, model_config = default_model
    config = EngineConfig(load_format="dummy")
    choice = dtype_choice.choose_dtype(config, torch.device("cpu"), None, model_config, amx_like)
    assert choice.dtype == torch.bfloat16


def test_an_explicit_dtype_is_kept(default_model) -> None:
    _, folder, model_config = default_model
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        config = EngineConfig(dtype=name)
        assert dtype_choice.choose_dtype(config, torch.device("cpu"), folder, model_config, amx_like).dtype == dtype


def test_the_default_model_loads_in_blocks_on_an_amx_cpu(monkeypatch, caplog) -> None:
    """The whole start-up path: every projection in blocks, and the log says why."""
    monkeypatch.setattr(dtype_choice, "matmul_seconds", amx_like)
    with caplog.at_level(logging.INFO, logger="trillm.engine"):
        model, _, _ = loading.load_model(EngineConfig())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype ")]
    assert len(said) == 1
    if block_path_here():
        assert model.dtype == torch.float32
        assert model.num_block_weights == len(model.projections())
        assert said[0].startswith("dtype float32: auto: the projections are the GGUF file's blocks")
    else:
        assert model.dtype == torch.bfloat16 and said[0].startswith("dtype bfloat16: auto: dense weights")


def test_a_tie_goes_to_float32(default_model) -> None:
    """Near-equal timings (noise on a memory-bound GEMV) must not flip the choice between starts."""
    _, folder, model_config = default_model
    dense = EngineConfig(weight_format="dense")
    tie = dtype_choice.choose_dtype(dense, torch.device("cpu"), folder, model_config, lambda *a: 1e-4)
    assert tie.dtype == torch.float32
