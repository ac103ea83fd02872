"""The GGUF block kernels (``kernels/cpu_gguf``) against ``gguf``'s own decoders, type by type.

Every type trillm keeps in its blocks is decoded by C exactly as ``gguf.quants.dequantize``
decodes it (value for value: the C rounds as numpy does), on random blocks whose scales are
sane float16 values and whose quant bits are random. The matmul is that matrix times x, by the
per-row path (decode sizes) and the panel + GEMM path (prefill sizes), into column slices.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

from trillm.engine.execution.layers import Stacked, embed_rows, fuse, project, project_add
from trillm.kernels import cpu_gguf
from trillm.kernels.block_weights import Q4_1Weight, Q8_0Weight
from trillm.kernels.block_weights import dequantize as dequantize_blocks
from trillm.kernels.gguf_blocks import BLOCK_TYPES, GGUFWeight, reference_dequantize, repacked, row_bytes

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="needs a C compiler")

# byte offsets of each type's float16 scale fields within a block
SCALE_FIELDS = {
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q8_0": (0,),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q6_K": (208,),
}
# E8M0 power-of-two scales: MXFP4's one byte per block, within 2^(-10)..2^(-4) of its doubled values
POWER_SCALES = {"MXFP4": (0,)}


def random_weight(name: str, N: int, K: int, seed: int = 0) -> GGUFWeight:
    """Random valid rows: random quant bits, float16 scales in [-0.05, 0.05] (plain values for F16/BF16)."""
    kind = BLOCK_TYPES[name]
    rng = np.random.default_rng(seed)
    if name == "F16":
        raw = rng.standard_normal((N, K)).astype(np.float16).view(np.uint8)
    elif name == "BF16":
        raw = (rng.standard_normal((N, K)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = rng.integers(0, 256, size=(N, row_bytes(kind, K)), dtype=np.uint8)
        blocks = raw.reshape(N, -1, kind.bytes)
        for offset in SCALE_FIELDS.get(name, ()):
            scales = rng.uniform(-0.05, 0.05, size=blocks.shape[:2]).astype(np.float16)
            blocks[..., offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
        for offset in POWER_SCALES.get(name, ()):
            blocks[..., offset] = rng.integers(118, 124, size=blocks.shape[:2], dtype=np.uint8)
    return GGUFWeight(kind, torch.from_numpy(np.ascontiguousarray(raw).reshape(N, -1)), K)


TYPES = sorted(BLOCK_TYPES)


@pytest.mark.parametrize("name", TYPES)
def test_each_type_decodes_exactly_as_gguf_does(name):
    weight = random_weight(name, 7, 512)
    expected = reference_dequantize(weight)
    assert torch.equal(cpu_gguf.dequantize(weight), expected)
    assert torch.equal(cpu_gguf.dequantize(weight, 2, 5), expected[2:5])
    ids = torch.tensor([[6, 0], [3, 3]])
    assert torch.equal(cpu_gguf.embedding(weight, ids), expected[ids])
    with pytest.raises(IndexError):
        cpu_gguf.embedding(weight, torch.tensor([7]))


def test_float16_specials_decode_as_torch_does():
    values = torch.tensor(
        [0.0, -0.0, 6e-8, -6.1e-5, 65504.0, float("inf"), -float("inf"), 1.5] * 2, dtype=torch.float16
    )
    weight = GGUFWeight(BLOCK_TYPES["F16"], values.view(torch.uint8).view(1, -1), 16)
    assert torch.equal(cpu_gguf.dequantize(weight), values.float().view(1, -1))
    nan = GGUFWeight(BLOCK_TYPES["F16"], torch.full((1, 16), float("nan"), dtype=torch.float16).view(torch.uint8), 16)
    assert cpu_gguf.dequantize(nan).isnan().all()


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("M", [1, 3, 20, cpu_gguf.GEMM_ROWS + 5])  # 20: F16 / BF16 in panels, the rest in int16
def test_matmul_equals_the_decoded_matrix_times_x(name, M, monkeypatch):
    N, K = 300, 512  # N past two panels of the GEMM path and not a multiple of the row group
    monkeypatch.setattr(cpu_gguf, "PANEL_FLOATS", 128 * K)
    weight = random_weight(name, N, K, seed=M)
    dense = reference_dequantize(weight)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1))
    expected = x @ dense.T
    scale = expected.abs().max().item()
    exact = cpu_gguf.matmul(x, weight, exact=True)
    torch.testing.assert_close(exact, expected, atol=2e-6 * scale * K**0.5, rtol=1e-5)
    fast = cpu_gguf.matmul(x, weight)
    if M < cpu_gguf.GEMM_ROWS and weight.kind.values > 1:  # int16 activations: within the stated bound
        magnitude = x.abs() @ dense.abs().T
        assert ((fast - expected).abs() <= cpu_gguf.ACTIVATION_ERROR * magnitude).all()
        assert not torch.equal(fast, exact)  # (it is the integer path that ran)
    else:
        torch.testing.assert_close(fast, expected, atol=2e-6 * scale * K**0.5, rtol=1e-5)
    wide = torch.randn(M, N + 40)  # into a column slice, adding to what is there
    before = wide.clone()
    cpu_gguf.matmul(x, weight, out=wide[:, 20 : 20 + N], accumulate=True)
    torch.testing.assert_close(wide[:, 20 : 20 + N], before[:, 20 : 20 + N] + fast, atol=1e-5 * scale, rtol=1e-5)
    assert torch.equal(wide[:, :20], before[:, :20]) and torch.equal(wide[:, 20 + N :], before[:, 20 + N :])


INTEGER_TYPES = [name for name in TYPES if BLOCK_TYPES[name].values > 1]


@pytest.mark.parametrize("name", INTEGER_TYPES)
@pytest.mark.parametrize("M", [1, 3, 6, 20])  # 6: a tile of 4 and one of 2
def test_int8_activations_stay_within_their_bound(name, M):
    """``activation_bits=8`` (llama.cpp's activations): each output within ``INT8_ACTIVATION_ERROR``
    of the float one relative to sum |x| |w|, coarser than int16's, and the same through the fused
    loop's layout (its flags carry the width) and through the grouped call."""
    N, K = 100, 512
    weight16 = random_weight(name, N, K, seed=M)
    weight8 = attrs.evolve(weight16, activation_bits=8)
    dense = reference_dequantize(weight16)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(2))
    expected, magnitude = x @ dense.T, x.abs() @ dense.abs().T
    fast8, fast16 = cpu_gguf.matmul(x, weight8), cpu_gguf.matmul(x, weight16)
    error8, error16 = ((fast8 - expected).abs() / magnitude).max(), ((fast16 - expected).abs() / magnitude).max()
    assert error8 <= cpu_gguf.INT8_ACTIVATION_ERROR
    assert error16 <= cpu_gguf.ACTIVATION_ERROR < error8  # (it is the 8-bit path that ran)
    assert cpu_gguf.layout(weight8).flags != cpu_gguf.layout(weight16).flags
    grouped = cpu_gguf.matmul_grouped(x, [weight8, attrs.evolve(weight8, data=weight8.data.flip(0))], False)
    assert torch.equal(grouped[:, :N], fast8)
    assert torch.equal(grouped[:, N:], cpu_gguf.matmul(x, attrs.evolve(weight8, data=weight8.data.flip(0))))
    assert not cpu_gguf.groupable([weight8, weight16], M)  # one width per call


def test_activation_bits_are_8_or_16():
    with pytest.raises(ValueError):
        attrs.evolve(random_weight("Q4_K", 1, 256), activation_bits=4)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_legacy_types_repack_exactly_into_the_fast_layouts(name):
    weight = random_weight(name, 9, 256)
    packed = repacked(weight)
    assert isinstance(packed, Q8_0Weight if name == "Q8_0" else Q4_1Weight)
    assert torch.equal(dequantize_blocks(packed), reference_dequantize(weight))
    ids = torch.tensor([8, 1, 1])
    assert torch.equal(embed_rows(packed, ids), reference_dequantize(weight)[ids])


def test_projections_of_mixed_types_stack_and_equal_their_concatenation():
    """A Q4_K_M file keeps Q and K in Q4_K and V in Q6_K: fused, they stay side by side."""
    q, k, v = random_weight("Q4_K", 64, 256, 1), random_weight("Q4_K", 32, 256, 2), random_weight("Q6_K", 32, 256, 3)
    fused = fuse([q, k, v], blocks=True)
    assert isinstance(fused, Stacked) and fused.shape == (128, 256)
    assert fused.nbytes == q.nbytes + k.nbytes + v.nbytes
    same = fuse([q, k], blocks=True)  # the file's bytes are not copied, even where the types agree
    assert isinstance(same, Stacked) and same.shape == (96, 256)
    assert same.parts[0].data.data_ptr() == q.data.data_ptr()
    legacy = fuse([repacked(random_weight("Q8_0", 32, 256, 4)), repacked(random_weight("Q8_0", 16, 256, 5))], True)
    assert isinstance(legacy, Q8_0Weight) and legacy.shape == (48, 256)
    dense = torch.cat([reference_dequantize(w) for w in (q, k, v)])
    for M in (1, 12):
        x = torch.randn(M, 256)
        bias = torch.randn(128)
        tolerance = cpu_gguf.ACTIVATION_ERROR * (x.abs() @ dense.abs().T).max().item() + 1e-4
        torch.testing.assert_close(project(x, fused, bias), x @ dense.T + bias, atol=tolerance, rtol=1e-5)
        h = torch.randn(M, 128)
        torch.testing.assert_close(project_add(h.clone(), x, fused), h + x @ dense.T, atol=tolerance, rtol=1e-5)


def test_bad_arguments_are_refused():
    weight = random_weight("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="float32"):
        cpu_gguf.matmul(torch.randn(1, 256, dtype=torch.float64), weight)
    with pytest.raises(ValueError):
        cpu_gguf.matmul(torch.randn(1, 128), weight)
    with pytest.raises(ValueError, match="out must be given"):
        cpu_gguf.matmul(torch.randn(1, 256), weight, accumulate=True)
    with pytest.raises(ValueError, match="whole blocks"):
        row_bytes(BLOCK_TYPES["Q4_K"], 300)


@pytest.mark.parametrize(("name", "bound"), [("Q4_K", 0.12), ("Q5_K", 0.06), ("Q6_K", 0.03)])
def test_our_k_quant_encoders_write_blocks_gguf_decodes_close_to_the_input(name, bound):
    """``bench/gguf_files`` encodes k-quants (``gguf`` only decodes them); its blocks, read back by
    ``gguf``'s decoder, hold the matrix within the type's resolution (mean error / mean |w|)."""
    from trillm.bench.gguf_files import encode

    w = np.random.default_rng(5).standard_normal((16, 512)).astype(np.float32) * 0.02
    raw = encode(w, name)
    assert raw.shape == (16, row_bytes(BLOCK_TYPES[name], 512))
    back = reference_dequantize(GGUFWeight(BLOCK_TYPES[name], torch.from_numpy(raw), 512)).numpy()
    error = np.abs(back - w).mean() / np.abs(w).mean()
    assert error < bound, error


def test_the_start_up_log_names_each_projections_formats_and_path():
    from trillm.engine.execution.layers import kernel_paths

    q, k, v = random_weight("Q4_K", 64, 256, 1), random_weight("Q4_K", 32, 256, 2), random_weight("Q6_K", 32, 256, 3)
    qkv = fuse([q, k, v], blocks=True)
    lines = kernel_paths({"qkv": [qkv, qkv], "down": [v], "lm_head": [torch.zeros(4, 4)]})
    assert lines[:3] == ["qkv: 2 x Q4_K+Q4_K+Q6_K", "down: 1 x Q6_K", "lm_head: 1 x dense float32"]
    paths = dict(line.split(": ", 1) for line in lines[3:])
    assert set(paths) == {"Q4_K", "Q6_K", "dense float32"} and paths["dense float32"] == "torch"
    assert paths["Q4_K"].startswith(f"cpu_gguf, {cpu_gguf.simd()}: int16 activations up to {cpu_gguf.GEMM_ROWS - 1}")
    bf16 = random_weight("BF16", 32, 256, 4)  # a half-precision checkpoint's rows: on the tiles at every step
    assert kernel_paths({"down": [bf16]})[-1].startswith("BF16: cpu_gguf: rows decoded to float32")
    assert kernel_paths({"down": [bf16]}, tiles=True)[-1].startswith("BF16: AMX-BF16 tiles at every step")


SMALLER_TEAM = """
import torch
from tests.test_gguf_kernels import random_weight
from trillm.kernels import cpu_gguf
weight = random_weight("Q4_K", 1000, 1024)
x = torch.randn(2, 1024)
print(torch.equal(cpu_gguf.matmul(x, weight, num_threads=1), cpu_gguf.matmul(x, weight, num_threads=4)))
"""


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_the_rows_are_the_same_whatever_thread_takes_them(name):
    """The integer path hands rows out in chunks a thread takes from its own share's front or, done
    with it, from another's back: each row is one thread's whole sum, so any split gives the same
    bits; a team smaller than asked for (``OMP_THREAD_LIMIT``) takes the missing threads' shares."""
    weight = random_weight(name, 1000, 1024, seed=5)  # 125 units of 8 rows: shares of unequal chunks
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(6))
    one = cpu_gguf.matmul(x, weight, num_threads=1)
    for threads in (2, 3, 7):
        assert torch.equal(cpu_gguf.matmul(x, weight, num_threads=threads), one)
    done = subprocess.run(
        [sys.executable, "-c", SMALLER_TEAM],
        env={**os.environ, "OMP_THREAD_LIMIT": "1"},
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        check=True,
    )
    assert done.stdout.strip() == "True"
