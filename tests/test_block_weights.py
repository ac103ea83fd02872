"""Exact GGUF blocks: packing never changes a weight, and the default model packs whole."""

from __future__ import annotations

import json

import pytest
import torch

from trillm.engine.config import EngineConfig
from trillm.engine.execution.backends import CpuBackend
from trillm.engine.execution.loading import load_model
from trillm.engine.execution.model import DecoderModel
from trillm.kernels import cpu_matmul
from trillm.kernels.block_weights import Q4_1Weight, Q8_0Weight, dequantize, pack_exact, pack_q4_1, pack_q8_0

from tests.test_kernel_engine import TINY


def _half(shape: tuple[int, ...], scale: float, gen: torch.Generator) -> torch.Tensor:
    """Random float16 values as float32, as GGUF stores block scales."""
    return (torch.rand(shape, generator=gen) * scale).to(torch.float16).float()


def q4_1_matrix(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """What a GGUF reader makes of a Q4_1 tensor: float32(d * q) + m, q spanning 0..15."""
    gen = torch.Generator().manual_seed(seed)
    d, m = _half((n, k // 32, 1), 0.01, gen), -_half((n, k // 32, 1), 0.1, gen)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # a quantizer's block reaches both ends
    return (d * q + m).reshape(n, k)


def q8_0_matrix(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    d = _half((n, k // 32, 1), 0.01, gen)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q[..., 3] = 127 * torch.where(torch.rand(n, k // 32, generator=gen) < 0.5, -1.0, 1.0)
    return (d * q).reshape(n, k)


def test_q4_1_matrices_pack_exactly_and_smaller():
    w = q4_1_matrix(40, 96)
    w[3, 32:64] = 0.25  # a constant block: d = 0
    packed = pack_q4_1(w)
    assert isinstance(packed, Q4_1Weight) and packed.shape == (40, 96)
    assert torch.equal(dequantize(packed), w)
    assert packed.nbytes * 5 < w.numel() * 4  # 5 bits + scales per weight instead of 32
    assert isinstance(pack_exact(w), Q4_1Weight)


def test_q8_0_matrices_pack_exactly():
    w = q8_0_matrix(24, 64)
    w[0, :32] = 0.0
    assert pack_q4_1(w) is None  # 255 levels do not fit in 16
    packed = pack_q8_0(w)
    assert isinstance(packed, Q8_0Weight) and packed.shape == (24, 64)
    assert torch.equal(dequantize(packed), w)
    assert isinstance(pack_exact(w), Q8_0Weight)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(16, 64),  # ordinary float32 weights
        lambda: q4_1_matrix(16, 64)[:, :40],  # K not a multiple of 32
        lambda: q4_1_matrix(16, 64).to(torch.bfloat16),
    ],
)
def test_anything_not_exactly_blocks_stays_dense(make):
    assert pack_exact(make()) is None


def test_one_wrong_value_keeps_the_matrix_dense():
    w = q4_1_matrix(8, 64)
    w[5, 17] = w[5, 17] + 1e-4
    assert pack_q4_1(w) is None and pack_exact(w) is None
    w[5, 17] = float("nan")
    assert pack_exact(w) is None


def test_default_model_packs_every_projection_exactly(model_parts, model_dir):
    """The shipped GGUF's weights are Q4_1 and Q8_0: all 121 projections pack, and
    every packed value equals the float32 weight a dense load gives."""
    blocks = model_parts[0]
    config = json.loads((model_dir / "config.json").read_text())
    dense = DecoderModel.load(
        model_dir, config, torch.float32, 256, backend=CpuBackend(torch.device("cpu"), torch.float32)
    )
    assert dense.num_block_weights == 0
    assert blocks.num_block_weights == len(blocks.projections()) == 1 + 4 * blocks.shape.num_layers
    assert isinstance(blocks.lm_head, Q8_0Weight) and isinstance(blocks.layers[0].gate_up, Q4_1Weight)
    for packed, dense_t in zip(blocks.projections(), dense.projections(), strict=True):
        assert torch.equal(dequantize(packed), dense_t.t())


@pytest.mark.parametrize("simd, blocks", [("plain", False), ("avx2", True)])
def test_auto_takes_blocks_only_with_a_simd_path(monkeypatch, model_dir, simd, blocks):
    """A checkpoint's exact blocks: the plain-C block matmul is slower than MKL, so ``auto`` does
    not pick it; the AVX2 paths beat MKL's AVX2 GEMM at decode sizes, so it does (see
    docs/benchmarks.md). A GGUF file keeps its blocks either way: decoded, it takes 4-7x the memory."""
    monkeypatch.setattr(cpu_matmul, "simd", lambda: simd)
    model, _, _ = load_model(EngineConfig(model=str(model_dir), dtype="float32"))
    assert (model.num_block_weights > 0) == blocks
    from_file, _, _ = load_model(EngineConfig(dtype="float32"))  # the alias: its GGUF file
    assert from_file.num_block_weights == len(from_file.projections())


def test_weight_format_is_checked(tmp_path):
    with pytest.raises(ValueError, match="weight_format"):
        EngineConfig(weight_format="int4")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    with pytest.raises(ValueError, match="exact Q4_1/Q8_0 blocks"):  # random weights never are
        load_model(EngineConfig(model=str(config), load_format="dummy", dtype="float32", weight_format="blocks"))
    with pytest.raises(ValueError, match="float32"):
        load_model(EngineConfig(model=str(config), load_format="dummy", dtype="bfloat16", weight_format="blocks"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_value_past_the_probed_rows_or_not_finite_keeps_a_large_matrix_dense(bad):
    w = q4_1_matrix(64, 64)  # more rows than the packers probe first
    assert pack_q4_1(w) is not None
    w[50, 3] = w[50, 3] + 1e-4  # the probe passes; the whole matrix must not
    assert pack_exact(w) is None
    w = q8_0_matrix(64, 64)
    w[50, 3] = bad
    assert pack_exact(w) is None
