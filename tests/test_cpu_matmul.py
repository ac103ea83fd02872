"""The block-weight CPU matmul matches torch.mm on the dequantized weight, decodes it bit for bit,
and handles strided views, accumulation, thread counts and both SIMD paths (AVX-512 here, AVX2 in a
build without AVX-512) and the plain-C one."""

from __future__ import annotations

import ctypes
import gc
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from trillm.kernels import cpu_build, cpu_matmul
from trillm.kernels.block_weights import Q4_1Weight, Q8_0Weight, dequantize

KINDS = ("q4_1", "q8_0")


def block_weight(kind: str, N: int, K: int, seed: int) -> Q4_1Weight | Q8_0Weight:
    """Random q, and d, m float16 values in float32, as a GGUF file holds them."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(N, K // 32, generator=gen) * 0.02 + 1e-3).half().float()
    if kind == "q8_0":
        return Q8_0Weight(torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen), d)
    m = (torch.randn(N, K // 32, generator=gen) * 0.1).half().float()
    return Q4_1Weight(torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen), d, m)


def paths() -> list[int]:
    """Flags for ``cpu_matmul._matmul``: the default dispatch and the forced plain-C path."""
    return [0, cpu_matmul._PORTABLE]


def assert_matches(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, before: torch.Tensor | None = None) -> None:
    """got == before + x @ w.T up to float32 rounding of sums of K products (bounded by their magnitudes)."""
    want = x.double() @ w.double().t()
    bound = 1e-5 * (x.double().abs() @ w.double().abs().t()) + 1e-30
    if before is not None:
        want += before.double()
        bound += 1e-6 * before.double().abs()
    err = (got.double() - want).abs()
    worst = int(err.argmax()) if err.numel() else 0
    assert bool((err <= bound).all()), f"error {float(err.flatten()[worst])} > {float(bound.flatten()[worst])}"


def test_available():
    assert cpu_matmul.available()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("N,K", [(17, 96), (100, 576), (64, 32), (5, 1536)])
def test_decoders_bit_exact(kind: str, N: int, K: int):
    weight = block_weight(kind, N, K, seed=N + K)
    want = dequantize(weight)
    assert torch.equal(cpu_matmul.dequantize_c(weight), want)  # the decoder matmul uses
    assert torch.equal(cpu_matmul.dequantize_c(weight, 0), want)
    if cpu_matmul.simd() != "plain":
        assert torch.equal(cpu_matmul.dequantize_c(weight, 1), want)


def test_simd_names_the_build():
    assert cpu_matmul.simd() in ("avx512", "avx2", "plain")
    assert cpu_matmul.has_avx512() == (cpu_matmul.simd() == "avx512")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M", [1, 3, 11, 12, 96])
def test_one_hot_rows_give_the_weights_exactly(kind: str, M: int):
    """Each output is one weight times 1 plus zeros: exact on every path, which checks the
    panel and tile layouts value by value (including the N tail past 48 columns)."""
    K, N = 96, 70
    weight = block_weight(kind, N, K, seed=M)
    x = torch.eye(K)[torch.arange(M) * 7 % K]
    want = dequantize(weight).t()[torch.arange(M) * 7 % K]
    for flags in paths():
        assert torch.equal(cpu_matmul._matmul(x, weight, None, False, 2, flags), want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M", [0, 1, 3, 8, 33, 130])
@pytest.mark.parametrize("N", [1, 17, 64, 100])
@pytest.mark.parametrize("K", [32, 96, 576])
def test_matches_torch(kind: str, M: int, N: int, K: int):
    weight = block_weight(kind, N, K, seed=M * 7 + N * 3 + K)
    w = dequantize(weight)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M + K))
    for flags in paths():
        for threads in (1, 2):
            got = cpu_matmul._matmul(x, weight, None, False, threads, flags)
            assert got.shape == (M, N) and got.dtype == torch.float32
            assert_matches(got, x, w)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M,N,K", [(1, 100, 576), (5, 17, 96), (33, 100, 576), (130, 64, 96), (600, 50, 576)])
def test_strided_views_and_accumulate(kind: str, M: int, N: int, K: int):
    """x a column slice of a wider matrix; out a column slice too, added into in place
    (h += attn @ W_o^T), its other columns untouched. 600 rows: two blocks of packed x."""
    gen = torch.Generator().manual_seed(M + N)
    weight = block_weight(kind, N, K, seed=M)
    w = dequantize(weight)
    x = torch.randn(M, K + 9, generator=gen)[:, 5 : 5 + K]
    for flags in paths():
        for threads in (1, 2):
            wide = torch.randn(M, N + 7, generator=gen)
            before = wide.clone()
            out = wide[:, 3 : 3 + N]
            assert cpu_matmul._matmul(x, weight, out, True, threads, flags) is out
            assert_matches(out, x, w, before[:, 3 : 3 + N])
            assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, 3 + N :], before[:, 3 + N :])
            out2 = torch.full((M, N + 1), 7.0)[:, :N]  # overwritten, not added to
            cpu_matmul._matmul(x, weight, out2, False, threads, flags)
            assert_matches(out2, x, w)


DIRECT_ROWS = 11  # cpu_matmul.c's DIRECT_MAX_M: up to these rows the weights are decoded in registers


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("N,K", [(70, 576), (9, 96)])
def test_a_row_is_the_same_whatever_rows_come_with_it(kind: str, N: int, K: int):
    """Up to DIRECT_ROWS rows each row's result is the one it gets alone, bit for bit (the order of
    its additions does not depend on the tile): speculation's verification rows must give the
    logits a plain decode gives, or a greedy tie could break differently. Past DIRECT_ROWS, rows
    told to take the kernel of one row (a verification of several sequences) run in passes of
    equal size, and still give each row its lone result."""
    weight = block_weight(kind, N, K, seed=N)
    x = torch.randn(3 * DIRECT_ROWS, K, generator=torch.Generator().manual_seed(K))
    one_row = 1 << cpu_matmul._KERNEL_ROWS_SHIFT
    for threads in (1, 2):
        alone = torch.cat([cpu_matmul._matmul(x[i : i + 1], weight, None, False, threads, 0) for i in range(len(x))])
        for M in range(2, DIRECT_ROWS + 1):
            together = cpu_matmul._matmul(x[:M], weight, None, False, threads, 0)
            assert torch.equal(together, alone[:M]), (M, threads)
        for M in (DIRECT_ROWS + 1, 2 * DIRECT_ROWS - 1, 3 * DIRECT_ROWS):
            together = cpu_matmul._matmul(x[:M], weight, None, False, threads, one_row)
            assert torch.equal(together, alone[:M]), (M, threads)


def test_public_entry_and_copied_inputs():
    weight = block_weight("q4_1", 64, 96, seed=1)
    w = dequantize(weight)
    x = torch.randn(96, 9).t()  # columns not contiguous: copied
    assert_matches(cpu_matmul.matmul(x, weight), x, w)
    out = torch.randn(9, 64)
    before = out.clone()
    assert cpu_matmul.matmul(x, weight, out=out, accumulate=True, num_threads=2) is out
    assert_matches(out, x, w, before)
    empty = Q8_0Weight(torch.zeros(3, 0, dtype=torch.int8), torch.zeros(3, 0))  # K = 0: zeros
    assert torch.equal(cpu_matmul.matmul(torch.randn(2, 0), empty), torch.zeros(2, 3))


def test_layout_cache_follows_the_weight():
    weight = block_weight("q8_0", 8, 32, seed=2)
    cpu_matmul.matmul(torch.randn(1, 32), weight)
    key = id(weight)
    assert key in cpu_matmul._layouts
    del weight
    gc.collect()
    assert key not in cpu_matmul._layouts


def test_rejects_bad_inputs():
    weight = block_weight("q4_1", 16, 64, seed=3)
    x = torch.randn(4, 64)
    bad_calls = [
        lambda: cpu_matmul.matmul(x.double(), weight),
        lambda: cpu_matmul.matmul(torch.randn(4, 32), weight),  # K mismatch
        lambda: cpu_matmul.matmul(torch.randn(64), weight),
        lambda: cpu_matmul.matmul(x, weight, out=torch.empty(4, 15)),
        lambda: cpu_matmul.matmul(x, weight, out=torch.empty(4, 16, dtype=torch.float64)),
        lambda: cpu_matmul.matmul(x, weight, out=torch.empty(16, 4).t()),  # column stride 16
        lambda: cpu_matmul.matmul(x, weight, out=torch.empty(1, 16).expand(4, 16)),  # rows overlap
        lambda: cpu_matmul.matmul(x, weight, accumulate=True),  # nothing to add into
        lambda: cpu_matmul.matmul(x, Q4_1Weight(weight.qs.to(torch.int8), weight.d, weight.m)),
        lambda: cpu_matmul.matmul(x, Q4_1Weight(weight.qs, weight.d.double(), weight.m)),
        lambda: cpu_matmul.matmul(x, Q4_1Weight(weight.qs, weight.d[:, :1], weight.m)),
        lambda: cpu_matmul.matmul(x, Q8_0Weight(weight.qs, weight.d)),  # uint8 q for Q8_0
        lambda: cpu_matmul.matmul(x[:, :40], Q8_0Weight(torch.zeros(16, 40, dtype=torch.int8), torch.zeros(16, 1))),
        lambda: cpu_matmul.matmul(x, dequantize(weight)),  # a dense matrix is not a block weight
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()


def build_variant(tmp_path: Path, name: str, flags: list[str]) -> ctypes.CDLL:
    """cpu_matmul.c compiled as cpu_build does, plus ``flags`` (e.g. -mno-avx512f), loaded and declared."""
    lib_path = tmp_path / f"cpu_matmul_{name}.so"
    compiler = shlex.split(os.environ.get("CC") or "cc")
    source = cpu_build.KERNELS_DIR / "cpu_matmul.c"
    command = [
        *compiler,
        *cpu_build.FLAGS,
        *cpu_matmul._EXTRA_FLAGS,
        *flags,
        "-o",
        str(lib_path),
        str(source),
        *cpu_build.LIBS,
    ]
    subprocess.run(command, check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    cpu_matmul._KERNEL.declare(lib)
    return lib


def check_variant(lib: ctypes.CDLL, shapes: list[tuple[int, int]], Ms: list[int]) -> None:
    """Both decoders of ``lib`` bit for bit (path 1 only where built), and its matmul against the
    dequantized matrix: x a column slice, added into a column slice of out (the other columns
    untouched) and written into a fresh out, on 1 and 2 threads."""
    has_path_1 = lib.trillm_simd() != 0
    for kind in KINDS:
        for N, K in shapes:
            weight = block_weight(kind, N, K, seed=N + K)
            _, _, layout = cpu_matmul._layout(weight)
            w = dequantize(weight)
            # also with float32 scales (a GGUF file's are float16), for which d * q rounds too
            gen = torch.Generator().manual_seed(N * K)
            scaled = [
                s * (1 + torch.rand(s.shape, generator=gen))
                for s in ([weight.d, weight.m] if kind == "q4_1" else [weight.d])
            ]
            for decode_me in (weight, type(weight)(weight.qs, *scaled)):
                _, _, decode_layout = cpu_matmul._layout(decode_me)
                for path in (0, 1):
                    decoded = torch.full((N, K), float("nan"))
                    rc = lib.trillm_dequantize(decode_layout, decoded.data_ptr(), path)
                    assert rc == (0 if path == 0 or has_path_1 else 1)
                    assert rc or torch.equal(decoded, dequantize(decode_me)), (kind, N, K, path)
            for M in Ms:
                x = torch.randn(M, K + 3, generator=gen)[:, 1 : 1 + K]
                for threads in (1, 2):
                    wide = torch.randn(M, N + 5, generator=gen)
                    before = wide.clone()
                    out = wide[:, 2 : 2 + N]
                    rc = lib.trillm_matmul(
                        x.data_ptr(),
                        x.stride(0),
                        layout,
                        out.data_ptr(),
                        out.stride(0),
                        M,
                        cpu_matmul._ACCUMULATE,
                        threads,
                    )
                    assert rc == 0
                    assert_matches(out, x, w, before[:, 2 : 2 + N])
                    assert torch.equal(wide[:, :2], before[:, :2]) and torch.equal(wide[:, 2 + N :], before[:, 2 + N :])
                    fresh = torch.full((M, N), 7.0)
                    assert lib.trillm_matmul(x.data_ptr(), x.stride(0), layout, fresh.data_ptr(), N, M, 0, threads) == 0
                    assert_matches(fresh, x, w)
                    if M <= DIRECT_ROWS and has_path_1:  # each row as it comes alone, bit for bit
                        for i in range(M):
                            alone = torch.full((1, N), 7.0)
                            row = x[i : i + 1]
                            assert lib.trillm_matmul(row.data_ptr(), K, layout, alone.data_ptr(), N, 1, 0, threads) == 0
                            assert torch.equal(fresh[i : i + 1], alone), (kind, N, K, M, i)


def test_avx2_build_without_avx512(tmp_path):
    """The same source compiled with -mno-avx512f: the AVX2 paths (plain C on a CPU whose native
    build has no SIMD path, i.e. no AVX2 + FMA), both decoding exactly. Every M from the
    in-register path (up to 11 rows, 4 at a time or 5 for a last row, each row bit for bit as
    alone) into the panel one (16-row tiles), two blocks of packed x (600 rows at K = 608); N not
    a multiple of the tiles (1-4 weight rows in register, 6 in a panel tile, 8-lane stores, 48-row
    panels: 49 leaves one column),
    K a multiple of 32 but not of the 64-wide chunks."""
    lib = build_variant(tmp_path, "avx2", ["-mno-avx512f"])
    expected = "plain" if cpu_matmul.simd() == "plain" else "avx2"  # AVX-512 CPUs all have AVX2 + FMA
    assert cpu_matmul._SIMD_NAMES[lib.trillm_simd()] == expected and lib.trillm_has_avx512() == 0
    check_variant(lib, [(49, 96), (7, 32)], list(range(41)) + [100, 130])
    check_variant(lib, [(100, 608)], [1, 3, 4, 11, 12, 33, 130, 600])


def test_plain_build_without_simd(tmp_path):
    """Compiled with neither AVX-512 nor AVX2/FMA: only the plain-C path, which decodes exactly."""
    lib = build_variant(tmp_path, "plain", ["-mno-avx512f", "-mno-avx2", "-mno-fma"])
    assert lib.trillm_simd() == 0 and lib.trillm_has_avx512() == 0
    assert cpu_matmul._SIMD_NAMES[lib.trillm_simd()] == "plain"
    check_variant(lib, [(50, 96)], [0, 1, 5, 40])
