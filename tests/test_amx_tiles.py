"""Batched steps on AMX bfloat16 tiles (``kernels/amx_tiles``, ``cpu_amx.c``): the weights' own
decoders, rounded to bfloat16, multiplied with x rounded to bfloat16, summed in float32.

Each form the tiles take is checked against the float32 product of the same rounded matrices (the
only difference is the order of the float32 additions), at row counts around the tiles' blocks of
16 and 32 in both of the kernel's layouts (the weights as the A operand, and from 128 rows x),
K longer than one panel and K not a multiple of 32, rows of x in more than one pass; below ``min_rows`` the fused loop's
entry is the weight's own kernel, bit for bit; and decode steps of many rows in the C loop equal the
Python loop's and stay within bfloat16 rounding of the float32 ones. The numerical tests need a CPU
with AMX-BF16 (Sapphire Rapids and later); everywhere the tiles' absence must leave the float32
paths in charge.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from trillm.engine.execution.model_runner import ModelRunner
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.kernels import amx_tiles, bf16_panels, cpu_build, cpu_gguf, cpu_matmul, cpu_ops
from trillm.kernels.block_weights import Q4_1Weight, Q8_0Weight
from trillm.kernels.block_weights import dequantize as dequantize_blocks
from trillm.kernels.gguf_blocks import reference_dequantize, repacked
from trillm.kernels.stacked import Stacked

from tests.test_gguf_kernels import random_weight

needs_tiles = pytest.mark.skipif(not amx_tiles.available(), reason="this CPU has no AMX-BF16 tiles")


def test_the_tiles_run_exactly_where_the_cpu_has_them():
    """Built with -march=native: available only where /proc/cpuinfo lists amx_bf16; where absent,
    every form keeps its float32 kernel up to its oneDNN crossover."""
    if not cpu_gguf.available():
        assert not amx_tiles.available()
        return
    # never without /proc/cpuinfo's amx_bf16 flag (with it, a compiler without AMX or a kernel before
    # Linux 5.16, which grants no tile state, leave the tiles off too)
    assert bf16_panels.amx_bf16() or not amx_tiles.available()
    q4k = random_weight("Q4_K", 64, 256)
    if amx_tiles.available():
        assert bf16_panels.crossover(q4k) == amx_tiles.MIN_ROWS["GGUF"]
    else:
        assert bf16_panels.crossover(q4k) == cpu_gguf.GEMM_ROWS
        with pytest.raises(RuntimeError, match="no AMX"):
            amx_tiles.matmul(torch.randn(16, 256), q4k)
    bf16 = random_weight("BF16", 64, 256)  # read in place by the tiles, at any rows
    assert amx_tiles.handles(bf16)
    if amx_tiles.available():  # every step of a half-precision checkpoint, one row too
        assert bf16_panels.crossover(bf16) == amx_tiles.MIN_ROWS["BF16"] == 1
    else:
        assert bf16_panels.crossover(bf16) == cpu_gguf.FLOAT_GEMM_ROWS


def _forms() -> dict[str, tuple[object, torch.Tensor]]:
    forms: dict[str, tuple[object, torch.Tensor]] = {}
    for name in ("Q4_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "MXFP4"):
        w = random_weight(name, 72, 512, seed=len(forms))
        forms[name] = (w, reference_dequantize(w))
    f16 = random_weight("F16", 40, 100, seed=20)  # K not a multiple of 32: padded with zeros
    forms["F16 K=100"] = (f16, reference_dequantize(f16))
    bf16 = random_weight("BF16", 48, 200, seed=24)  # a half-precision checkpoint's rows
    forms["BF16 K=200"] = (bf16, reference_dequantize(bf16))
    rows = random_weight("BF16", 72, 256, seed=25)  # K a multiple of 32: whole groups read in place, the last decoded
    forms["BF16 K=256 (in place)"] = (rows, reference_dequantize(rows))
    long = random_weight("Q4_K", 40, 4096 + 512, seed=21)  # two panels of K
    forms["Q4_K K=4608"] = (long, reference_dequantize(long))
    q41 = repacked(random_weight("Q4_1", 50, 256, seed=22))
    assert isinstance(q41, Q4_1Weight)
    forms["Q4_1 (repacked)"] = (q41, dequantize_blocks(q41))
    q80 = repacked(random_weight("Q8_0", 33, 576, seed=23))
    assert isinstance(q80, Q8_0Weight)
    forms["Q8_0 (repacked)"] = (q80, dequantize_blocks(q80))
    return forms


FORMS = _forms() if cpu_gguf.available() and cpu_matmul.available() else {}


@needs_tiles
@pytest.mark.parametrize("name", ["BF16 K=256 (in place)", "BF16 K=200", "Q4_1 (repacked)", "Q4_K"])
def test_a_row_is_the_same_whatever_rows_come_with_it(name):
    """A half-precision checkpoint runs every step on the tiles (``MIN_ROWS["BF16"]`` 1): a speculative
    step's proposed rows must give the logits a plain step gives, bit for bit, at every batch size."""
    weight, dense = FORMS[name]
    x = torch.randn(150, dense.shape[1], generator=torch.Generator().manual_seed(3))
    alone = torch.cat([amx_tiles.matmul(x[i : i + 1], weight) for i in range(20)])
    for M in (2, 9, 16, 17, 33, 128, 150):  # from 128 rows x is the A operand
        assert torch.equal(amx_tiles.matmul(x[:M], weight)[:20], alone[: min(M, 20)]), M


@needs_tiles
@pytest.mark.parametrize("name", sorted(FORMS))
@pytest.mark.parametrize("M", [1, 13, 16, 33, 70, 130, 300])  # from 128 rows x is the A operand
def test_each_form_is_the_product_of_the_rounded_matrices(name, M):
    weight, dense = FORMS[name]
    x = torch.randn(M, dense.shape[1])
    rounded = x.bfloat16().double() @ dense.bfloat16().double().T  # exact sums of the rounded products
    got = amx_tiles.matmul(x, weight)
    assert got.dtype is torch.float32 and got.shape == rounded.shape
    # float32 sums of float32-exact products: rounding only in the additions
    scale = x.abs().double() @ dense.abs().double().T
    assert ((got.double() - rounded).abs() <= 1e-6 * scale + 1e-30).all()
    # added into a column slice of a wider output (a part of a fused projection, the residual)
    wide = torch.randn(M, dense.shape[0] + 6)
    before = wide.clone()
    amx_tiles.matmul(x, weight, out=wide[:, 3 : 3 + dense.shape[0]], accumulate=True)
    # (from 128 rows the tiles start from the output: its values join the float32 sums)
    inner = before[:, 3:-3].double()
    assert ((wide[:, 3:-3].double() - (inner + rounded)).abs() <= 1e-6 * (scale + inner.abs()) + 1e-30).all()
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, -3:], before[:, -3:])


@needs_tiles
def test_a_prefill_of_many_rows_runs_in_passes_with_x_row_major():
    """4,200 rows of K = 512: x's bfloat16 rows come in passes of at most 4,096 rows (each decodes W
    again; the last, of 104 rows, through the narrow layout), and a strided x (a view into a wider
    activation) is read in place."""
    weight, dense = FORMS["Q5_K"]
    x = torch.randn(4200, dense.shape[1] + 8)[:, 4:-4]
    got = amx_tiles.matmul(x, weight)
    rounded = x.bfloat16().double() @ dense.bfloat16().double().T
    scale = x.abs().double() @ dense.abs().double().T
    assert ((got.double() - rounded).abs() <= 1e-6 * scale + 1e-30).all()


def _gated_forms() -> dict[str, object]:
    if not FORMS:
        return {}
    q4k, q6k = random_weight("Q4_K", 70, 512, seed=30), random_weight("Q6_K", 70, 512, seed=31)
    bf16 = [random_weight("BF16", 64, 256, seed=s) for s in (32, 33)]  # read in place
    long = [random_weight("Q5_K", 40, 4096 + 256, seed=s) for s in (34, 35)]  # two panels of K
    return {
        "Q4_K | Q6_K": Stacked((q4k, q6k)),  # a file's gate and up in different types, I = 70
        "BF16 | BF16": Stacked(tuple(bf16)),
        "Q5_K K=4352": Stacked(tuple(long)),
        "Q4_1 joined": FORMS["Q4_1 (repacked)"][0],  # gate rows then up rows in one weight (50 -> I = 25)
    }


GATED_FORMS = _gated_forms()


@needs_tiles
@pytest.mark.parametrize("name", sorted(GATED_FORMS))
@pytest.mark.parametrize("M", [1, 17, 130, 300])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_gated_product_is_the_activation_of_the_two_matmuls(name, M, activation):
    """act(x Wg^T) * (x Wu^T) in one pass: the two products as ``matmul`` makes them, the activation
    as cpu_ops applies it (its exponential within a few ulps)."""
    weight = GATED_FORMS[name]
    gate, gate0, up, up0, size = amx_tiles.gated_parts(weight)
    x = torch.randn(M, gate.shape[1])
    g = amx_tiles.matmul(x, gate)[:, gate0 : gate0 + size]
    u = amx_tiles.matmul(x, up)[:, up0 : up0 + size]
    want = cpu_ops.gated_mul(torch.cat([g, u], 1), activation)
    out = torch.full((M, size + 3), float("nan"))[:, :size]  # rows of a wider buffer
    got = amx_tiles.gated(x, weight, activation, out=out)
    assert got is out
    scale = (g.abs() * u.abs()).max().item()
    assert ((got - want).abs() <= 2e-5 * scale + 1e-5 * want.abs()).all()


@needs_tiles
@pytest.mark.parametrize("M, K", [(2100, 512), (130, 100), (33, 64), (1000, 4352)])
def test_rows_packed_into_the_tiles_order_are_the_rounded_rows_and_norms(M, K):
    """``pack`` holds x (a strided view) rounded as the matmul rounds it (AVX512-BF16 flushes float32
    subnormals: none here), and with a norm weight the rows ``cpu_ops.rms_norm`` makes, rounded; rows
    and values past x are zeros."""
    x = torch.randn(M, K + 8)[:, 3:-5] * 3
    packed = amx_tiles.pack(x)
    assert torch.equal(packed.floats(), x.bfloat16().float())
    w = torch.rand(K) + 0.5
    normed = amx_tiles.pack(x, w, 1e-5)
    assert torch.equal(normed.floats(), cpu_ops.rms_norm(x, w, 1e-5).bfloat16().float())
    R, C = -(-M // 32) * 32, -(-K // 32) * 32
    full = amx_tiles.TileRows(normed.data, R, C).floats()
    assert full[M:].eq(0).all() and full[:, K:].eq(0).all()
    with pytest.raises(ValueError):
        amx_tiles.pack(x, out=amx_tiles.TileRows.empty(M, K + 1))


@needs_tiles
@pytest.mark.parametrize("name", ["BF16 | BF16", "Q5_K K=4352", "Q4_K | Q6_K"])
@pytest.mark.parametrize("M", [130, 300, 2100])
def test_products_of_packed_rows_are_the_products_of_float_rows(name, M):
    """x handed over in the tiles' order (a norm's output, the gated product) gives the very floats
    the float32 rows give, in passes of rows too; the gated product into the tiles' order is its
    float32 product packed (zeros past its rows and columns: the down projection reads them)."""
    weight = GATED_FORMS[name]
    gate, *_, size = amx_tiles.gated_parts(weight)
    x = torch.randn(M, gate.shape[1])
    packed = amx_tiles.pack(x)
    assert torch.equal(amx_tiles.matmul(packed, gate), amx_tiles.matmul(x, gate))
    h = torch.randn(M, gate.shape[0])
    added = amx_tiles.matmul(packed, gate, out=h.clone(), accumulate=True)
    want = amx_tiles.matmul(x, gate, out=h.clone(), accumulate=True)
    # a last pass of float rows under 128 adds its sums to out after the tiles, packed rows before them
    torch.testing.assert_close(added, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    rows = amx_tiles.gated(x, weight, "silu")
    assert torch.equal(amx_tiles.gated(packed, weight, "silu"), rows)
    padded = -(-M // 32) * 32 * -(-size // 32) * 32
    into = amx_tiles.TileRows(torch.full((padded,), 7, dtype=torch.int16), M, size)
    assert amx_tiles.gated(packed, weight, "silu", out=into) is into
    assert torch.equal(into.data, amx_tiles.pack(rows).data)


@needs_tiles
def test_a_weight_too_large_to_keep_its_pairs_pairs_them_a_group_at_a_time(monkeypatch):
    """A build that keeps no pairs between passes and takes one group a block (as an 8B model's FFN
    weights run: their pairs would be tens of MiB a thread) gives the very floats the default build
    gives, for products and gated products of float32 rows and of rows in the tiles' order."""
    lib = ctypes.CDLL(str(cpu_build._build("cpu_amx", ("-DKEEP_PAIRS_BYTES=0", "-DPAIRS_L2_BYTES=0"))))
    amx_tiles._KERNEL.declare(lib)
    small = tuple(getattr(lib, f) for f in amx_tiles._SIGNATURES)
    weight = GATED_FORMS["Q5_K K=4352"]  # two panels of K, passes of 96 rows
    gate = amx_tiles.gated_parts(weight)[0]
    x = torch.randn(300, gate.shape[1])
    packed = amx_tiles.pack(x)
    want = [amx_tiles.matmul(x, gate), amx_tiles.matmul(packed, gate), amx_tiles.gated(x, weight, "silu")]
    monkeypatch.setattr(amx_tiles._KERNEL, "_functions", small)
    got = [amx_tiles.matmul(x, gate), amx_tiles.matmul(packed, gate), amx_tiles.gated(x, weight, "silu")]
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_a_gated_product_needs_two_parts_of_one_size():
    if not FORMS:
        return
    q4k = random_weight("Q4_K", 64, 256, seed=40)
    assert amx_tiles.gated_parts(Stacked((q4k, random_weight("Q4_K", 32, 256, seed=41)))) is None
    assert amx_tiles.gated_parts(Stacked((q4k, q4k, q4k))) is None
    assert amx_tiles.gated_parts(torch.randn(256, 64)) is None  # dense: not the tiles' form
    assert amx_tiles.gated_parts(q4k) == (q4k, 0, q4k, 32, 32)


@needs_tiles
def test_the_fused_loops_entry_hands_small_steps_to_the_weights_own_kernel():
    weight, dense = FORMS["Q4_K"]
    amx = amx_tiles.layout(weight, min_rows=12)
    entry = ctypes.CFUNCTYPE(
        ctypes.c_int,
        *(ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
        + (ctypes.c_int64, ctypes.c_int, ctypes.c_int),
    )(amx_tiles.layout_matmul_address())
    for M in (5, 12):
        x = torch.randn(M, dense.shape[1])
        out = torch.empty(M, dense.shape[0])
        assert entry(x.data_ptr(), x.stride(0), amx.address, out.data_ptr(), out.stride(0), M, 0, 2) == 0
        own = cpu_gguf.matmul(x, weight)
        if M < 12:
            assert torch.equal(out, own)  # the int16 kernel, bit for bit
        else:
            assert torch.equal(out, amx_tiles.matmul(x, weight))


@needs_tiles
def test_bad_arguments_are_refused():
    weight, dense = FORMS["Q5_0"]
    with pytest.raises(ValueError, match="x must be"):
        amx_tiles.matmul(torch.randn(4, 7), weight)
    with pytest.raises(ValueError, match="out must be"):
        amx_tiles.matmul(torch.randn(4, dense.shape[1]), weight, out=torch.empty(4, 3))
    with pytest.raises(ValueError, match="accumulate"):
        amx_tiles.matmul(torch.randn(4, dense.shape[1]), weight, accumulate=True)
    with pytest.raises(TypeError, match="no AMX"):
        amx_tiles.layout(torch.randn(4, 4))  # type: ignore[arg-type]


def _runner(model, tiles: bool) -> ModelRunner:
    model.backend.gemm_bf16 = tiles  # read by bind: the C loop's projections on tiles or not
    runner = ModelRunner(model, 80, 16)
    assert runner._bound is not None and runner._bound.tiles == tiles
    return runner


@needs_tiles
def test_wide_decode_steps_on_tiles_are_the_python_loops_and_near_float32(model_parts):
    """Twenty sequences decoding together (steps of 20 rows down to a few), fed the float32 path's
    greedy tokens: on tiles the C loop's logits are the Python loop's bit for bit, and within
    bfloat16 rounding of float32, mostly with the same greedy token."""
    model = model_parts[0]
    try:
        fused, plain, float32 = _runner(model, True), _runner(model, True), _runner(model, False)
        sched = Scheduler(PageAllocator(80), 16, 32, 512)
        for i in range(20):
            prompt = list(range(200 + 11 * i, 200 + 11 * i + 4 + 3 * i))
            params = SamplingParams(max_tokens=6 + i % 4, temperature=0, ignore_eos=True)
            sched.add(Sequence(f"s{i}", prompt, params, 10_000, frozenset()))
        agree = total = 0
        while sched.has_work:
            batch = sched.schedule()
            logits = {}
            for name, runner, tiles, fuse in (
                ("fused", fused, True, True),
                ("plain", plain, True, False),
                ("float32", float32, False, True),
            ):
                model.backend.gemm_bf16, model.backend.fuse_decode = tiles, fuse
                with torch.inference_mode():
                    logits[name] = runner.execute_logits(runner.prepare(batch))
            assert torch.equal(logits["fused"], logits["plain"])
            if all(c.length == 1 for c in batch.chunks) and len(batch.chunks) >= 16:
                a, b = logits["fused"], logits["float32"]
                assert (a - b).abs().max() < 0.05 * b.abs().max()  # bfloat16 rounding, not another model
                agree += int((a.argmax(-1) == b.argmax(-1)).sum())
                total += a.shape[0]
            sched.complete(batch, logits["float32"].argmax(-1).tolist())
        assert total >= 32, "some decode steps should have had 16 rows or more"
        assert agree / total >= 0.9
    finally:
        model.backend.gemm_bf16 = False
        model.backend.fuse_decode = True


@needs_tiles
@pytest.mark.parametrize("name", sorted(FORMS))
def test_the_bfloat16_decoders_round_the_float32_ones(name):
    """The panels' decoders (``decode16``) give each float32 decoder's values rounded to nearest even,
    bit for bit, including a partial last panel (K=100) and a range starting past the first panel."""
    weight, dense = FORMS[name]
    amx = amx_tiles.AmxWeight(weight, 0)  # kept: its layout points into it
    layout = amx.layout
    reader = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p
    )
    floats, halves = reader(layout.decode), reader(layout.decode16)
    N, K = dense.shape
    k0 = 4096 if K > 4096 else 0
    for n in (0, N // 2, N - 1):
        f32, b16 = torch.empty(K - k0), torch.empty(K - k0, dtype=torch.bfloat16)
        assert floats(layout.weight, n, k0, K - k0, f32.data_ptr()) == 0
        assert halves(layout.weight, n, k0, K - k0, b16.data_ptr()) == 0
        assert torch.equal(f32, dense[n, k0:])
        assert torch.equal(b16.view(torch.int16), f32.bfloat16().view(torch.int16))
