"""Prefill GEMMs and attention in bfloat16 (``--gemm-dtype``): within bfloat16 rounding of float32.

``kernels/bf16_panels`` decodes block weights panel by panel to bfloat16 and multiplies with torch's
oneDNN (AMX tiles where the CPU has them; any CPU runs it, slower). Each weight form the CPU backend
serves is checked against the float32 product of the decoded matrix, rows padded or not, written or
added into a column slice; the padded bfloat16 attention against the float32 one.
"""

from __future__ import annotations

import logging

import pytest
import torch

from trillm.engine.config import EngineConfig
from trillm.engine.execution.backends.cpu_attention import CpuMetadata, PrefillSpan, paged_attention
from trillm.engine.execution.layers import fuse, transposed
from trillm.engine.execution.loading import gemms_in_bf16
from trillm.kernels import amx_tiles, bf16_panels, cpu_gguf, cpu_matmul
from trillm.kernels.block_weights import Q4_1Weight, Q8_0Weight
from trillm.kernels.block_weights import dequantize as dequantize_blocks
from trillm.kernels.gguf_blocks import reference_dequantize, repacked

from tests.test_gguf_kernels import random_weight

pytestmark = pytest.mark.skipif(not (cpu_gguf.available() and cpu_matmul.available()), reason="C compiler")

BF16_STEP = 2.0**-8  # one bfloat16 rounding: at most half of this, relative


def _weights() -> dict[str, tuple[object, torch.Tensor]]:
    """Each form, with its float32 matrix [N, K]."""
    forms: dict[str, tuple[object, torch.Tensor]] = {}
    for name in ("Q4_K", "Q6_K", "Q5_0", "Q8_0", "F16", "BF16"):
        w = random_weight(name, 200, 256, seed=len(forms))
        forms[name] = (w, reference_dequantize(w))
    legacy = repacked(random_weight("Q4_1", 96, 256, 7))
    assert isinstance(legacy, Q4_1Weight)
    forms["Q4_1 (repacked)"] = (legacy, dequantize_blocks(legacy))
    eight = repacked(random_weight("Q8_0", 64, 256, 8))
    assert isinstance(eight, Q8_0Weight)
    forms["Q8_0 (repacked)"] = (eight, dequantize_blocks(eight))
    parts = [random_weight("Q4_K", 64, 256, 9), random_weight("Q6_K", 32, 256, 10)]
    forms["Stacked"] = (fuse(parts, blocks=True), torch.cat([reference_dequantize(p) for p in parts]))
    dense = torch.randn(80, 256) * 0.05
    forms["dense"] = (transposed(dense), dense)
    return forms


WEIGHTS = _weights()


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("M", [64, 100, 300, 600])
@pytest.mark.parametrize("tiles", [True, False])  # False: oneDNN's panels, as on CPUs where the tiles do not run
def test_each_form_is_the_float32_product_within_bfloat16_rounding(name, M, tiles, monkeypatch):
    if not tiles:
        monkeypatch.setattr(amx_tiles, "available", lambda: False)
    weight, dense = WEIGHTS[name]
    x = torch.randn(M, dense.shape[1])
    exact = x @ dense.T
    # x and W each rounded once (half a step each, relative, per product), the result once more
    bound = BF16_STEP * (x.abs() @ dense.abs().T) + BF16_STEP * exact.abs() + 1e-6
    got = bf16_panels.matmul(x, weight)
    assert got.dtype is torch.float32 and got.shape == exact.shape
    assert ((got - exact).abs() <= bound).all()
    # the same values oneDNN's bfloat16 GEMM gives on the rounded inputs (padding rows change nothing)
    rounded = torch.mm(x.bfloat16(), dense.bfloat16().T).float()
    torch.testing.assert_close(got, rounded, atol=1e-6, rtol=BF16_STEP)
    # added into a column slice of a wider output, as a residual add over part of a fused projection
    wide = torch.randn(M, dense.shape[0] + 8)
    before = wide.clone()
    bf16_panels.matmul(x, weight, out=wide[:, 4 : 4 + dense.shape[0]], accumulate=True)
    inner = before[:, 4:-4]  # (the tiles start from it: its values join their float32 sums)
    assert ((wide[:, 4:-4] - (inner + exact)).abs() <= bound + 1e-6 * inner.abs()).all()
    assert torch.equal(wide[:, :4], before[:, :4]) and torch.equal(wide[:, -4:], before[:, -4:])


def test_the_scratch_is_reused_and_bounded_by_the_largest_step(monkeypatch):
    monkeypatch.setattr(amx_tiles, "available", lambda: False)  # oneDNN's panels (the tiles need no scratch)
    weight, dense = WEIGHTS["Q4_K"]
    scratch = bf16_panels.Scratch()
    bf16_panels.matmul(torch.randn(600, 256), weight, scratch=scratch)
    sizes = {name: (t.data_ptr(), t.numel()) for name, t in scratch.buffers.items()}
    bf16_panels.matmul(torch.randn(520, 256), weight, scratch=scratch)  # smaller: nothing new
    assert {name: (t.data_ptr(), t.numel()) for name, t in scratch.buffers.items()} == sizes
    assert sizes["x"][1] == 1024 * 256  # 600 rows padded to the next power of two


def test_each_form_leaves_its_float32_kernel_where_its_panels_would_be_decoded_anyway(monkeypatch):
    monkeypatch.setattr(amx_tiles, "available", lambda: False)  # where the tiles run: tests/test_amx_tiles.py
    assert bf16_panels.crossover(WEIGHTS["Q4_K"][0]) == cpu_gguf.GEMM_ROWS
    assert bf16_panels.crossover(WEIGHTS["BF16"][0]) == cpu_gguf.FLOAT_GEMM_ROWS
    assert bf16_panels.crossover(WEIGHTS["Stacked"][0]) == cpu_gguf.GEMM_ROWS
    assert bf16_panels.crossover(WEIGHTS["Q4_1 (repacked)"][0]) == bf16_panels.CROSSOVER["REPACKED"]
    assert bf16_panels.crossover(WEIGHTS["dense"][0]) == bf16_panels.CROSSOVER["DENSE"]


def test_bad_arguments_are_refused():
    weight, dense = WEIGHTS["Q4_K"]
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        bf16_panels.matmul(torch.randn(64, 256, dtype=torch.float64), weight)
    with pytest.raises(ValueError, match="out must be"):
        bf16_panels.matmul(torch.randn(64, 256), weight, out=torch.empty(64, 3))
    with pytest.raises(ValueError, match="accumulate"):
        bf16_panels.matmul(torch.randn(64, 256), weight, accumulate=True)
    with pytest.raises(TypeError, match="no bfloat16 GEMM"):
        bf16_panels.matmul(torch.randn(64, 256), object())


def test_row_ranges_decode_as_the_whole_matrix_does():
    weight, dense = WEIGHTS["Q4_1 (repacked)"]
    out = torch.empty(30, 256)
    torch.testing.assert_close(cpu_matmul.dequantize_rows(weight, 40, 70, out), dense[40:70], rtol=0, atol=0)
    with pytest.raises(ValueError, match="rows"):
        cpu_matmul.dequantize_rows(weight, 90, 100, torch.empty(10, 256))


@pytest.mark.parametrize(
    "window, sinks, softcap", [(0, False, 0.0), (48, False, 0.0), (0, True, 0.0), (0, False, 30.0)]
)
@pytest.mark.parametrize("cached", [0, 83])
def test_a_prefill_attends_in_bfloat16_within_rounding_of_float32(window, sinks, softcap, cached):
    """A chunk of 70 rows after ``cached`` tokens: padded to 128 rows and a multiple of 64 keys, masked."""
    gen = torch.Generator().manual_seed(cached + window)
    heads, kv_heads, dim, page, n = 6, 2, 32, 16, 70
    length = cached + n
    pages = -(-length // page)
    k_cache, v_cache = (torch.randn(pages + 2, page, kv_heads, dim, generator=gen) for _ in range(2))
    q = torch.randn(n, heads, dim, generator=gen)
    k, v = (torch.randn(n, kv_heads, dim, generator=gen) for _ in range(2))
    mask = None if not cached else torch.ones(n, length, dtype=torch.bool).tril(cached)
    span = PrefillSpan(0, n, torch.arange(pages), length, mask)
    meta = CpuMetadata(torch.arange(cached, length), (), (span,))
    sink = torch.randn(heads, generator=gen) if sinks else None
    outs = [
        paged_attention(q, k, v, k_cache, v_cache, meta, dim**-0.5, window, sink, softcap, dtype)
        for dtype in (None, torch.bfloat16)
    ]
    assert outs[1].dtype is torch.float32 and outs[1].shape == (n, heads, dim)
    assert torch.isfinite(outs[1]).all()
    # the values (about unit size) rounded to bfloat16 on the way in and the weights inside the kernel
    torch.testing.assert_close(outs[1], outs[0], atol=0.03, rtol=0.02)


def test_auto_takes_bfloat16_only_for_dtype_auto_on_a_cpu_with_amx(monkeypatch, caplog):
    for amx in (True, False):
        monkeypatch.setattr(bf16_panels, "amx_bf16", lambda amx=amx: amx)
        assert gemms_in_bf16(EngineConfig()) is amx
        assert gemms_in_bf16(EngineConfig(dtype="float32")) is False  # asked for float32: float32 everywhere
        assert gemms_in_bf16(EngineConfig(gemm_dtype="bfloat16", dtype="float32")) is True
        assert gemms_in_bf16(EngineConfig(gemm_dtype="float32")) is False
    with pytest.raises(ValueError, match="gemm_dtype"):
        EngineConfig(gemm_dtype="float16")


def test_the_start_up_log_says_prefill_runs_in_bfloat16(caplog):
    from trillm.engine.engine import load_model

    with caplog.at_level(logging.INFO, logger="trillm.engine"):
        model = load_model(EngineConfig(gemm_dtype="bfloat16", dtype="float32"))[0]
    assert model.backend.gemm_bf16  # type: ignore[attr-defined]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("prefill steps"))
    assert "bfloat16" in line and f"from {bf16_panels.ROWS} rows" in line
