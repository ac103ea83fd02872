"""``cpu_gguf.c`` built for other instruction sets than this CPU's native one.

CI machines differ (AVX2 only, AVX-512 with VNNI, neither), so the source is compiled here as
each would compile it: the plain-C build runs every type against ``gguf``'s decoders, as the
native build does in ``test_gguf_kernels``; builds for instruction sets this CPU lacks are
compiled (their code must at least build) and run only where the CPU has them.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import subprocess
from pathlib import Path

import attrs
import pytest
import torch

from trillm.kernels import cpu_build, cpu_gguf
from trillm.kernels.gguf_blocks import BLOCK_TYPES, reference_dequantize

from .test_gguf_kernels import TYPES, random_weight

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="needs a C compiler")

PLAIN = ["-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f"]
VNNI_512 = ["-march=sapphirerapids"]  # AVX-512 VNNI + VL + BW: the k-quants two runs a 512-bit instruction
VNNI_256 = ["-march=sapphirerapids", "-mno-avx512bw"]  # VNNI + VL alone: every kernel 256 bits wide
VNNI_AVX = ["-march=haswell", "-mavxvnni"]  # AVX-VNNI on an AVX2 CPU (Alder Lake, Zen 5 client)


def compile_variant(tmp_path: Path, name: str, flags: list[str], link: bool = True) -> Path:
    out = tmp_path / (f"cpu_gguf_{name}.so" if link else f"cpu_gguf_{name}.o")
    compiler = shlex.split(os.environ.get("CC") or "cc")
    source = cpu_build.KERNELS_DIR / "cpu_gguf.c"
    flags_all = [f for f in cpu_build.FLAGS if link or f != "-shared"]
    command = [*compiler, *flags_all, *cpu_gguf._KERNEL.extra_flags, *flags, "-o", str(out), str(source)]
    command += cpu_build.LIBS if link else ["-c"]
    subprocess.run(command, check=True, capture_output=True)
    return out


class _Variant:
    """Stands in for ``cpu_gguf._KERNEL``: the same entry points from another build."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        cpu_gguf._KERNEL.declare(lib)
        self._functions = tuple(getattr(lib, f) for f in cpu_gguf._KERNEL.signatures)

    def functions(self) -> tuple:
        return self._functions


def check_build(lib: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every type decodes exactly as gguf does; the int16 and int8 paths are within their bounds."""
    monkeypatch.setattr(cpu_gguf, "_KERNEL", _Variant(lib))
    for name in TYPES:
        weight = random_weight(name, 40, 512, seed=3)
        dense = reference_dequantize(weight)
        assert torch.equal(cpu_gguf.dequantize(weight), dense), name
        for M in (1, 3):
            x = torch.randn(M, 512, generator=torch.Generator().manual_seed(M))
            expected = x @ dense.T
            fast = cpu_gguf.matmul(x, weight)
            magnitude = x.abs() @ dense.abs().T
            assert ((fast - expected).abs() <= cpu_gguf.ACTIVATION_ERROR * magnitude + 1e-6).all(), (name, M)
            if weight.kind.values > 1:  # int8 activations: their own products on SIMD builds, the same bound
                fast8 = cpu_gguf.matmul(x, attrs.evolve(weight, activation_bits=8))
                assert ((fast8 - expected).abs() <= cpu_gguf.INT8_ACTIVATION_ERROR * magnitude + 1e-6).all(), (name, M)


def test_the_plain_c_build_runs_every_type(tmp_path, monkeypatch):
    lib = ctypes.CDLL(str(compile_variant(tmp_path, "plain", PLAIN)))
    assert cpu_gguf.SIMD_NAMES[lib.trillm_gguf_simd()] == "plain"
    check_build(lib, monkeypatch)


def test_the_native_build_names_its_path():
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    vnni512 = {"avx512_vnni", "avx512vl"} <= set(flags)
    expected = ("avx512vnni" if "avx512bw" in flags else "avx512vnni-256") if vnni512 else None
    expected = expected or ("avxvnni" if "avx_vnni" in flags else None)
    expected = expected or ("avx2" if {"avx2", "fma", "f16c"} <= set(flags) else "plain")
    assert cpu_gguf.simd() == expected


@pytest.mark.parametrize(
    ("name", "flags", "cpu_flag"),
    [
        ("avx512vnni", VNNI_512, "avx512_vnni"),
        ("avx512vnni-256", VNNI_256, "avx512_vnni"),
        ("avxvnni", VNNI_AVX, "avx_vnni"),
    ],
)
def test_vnni_builds_compile_and_run_where_the_cpu_has_them(tmp_path, monkeypatch, name, flags, cpu_flag):
    try:
        path = compile_variant(tmp_path, name, flags, link=cpu_flag in Path("/proc/cpuinfo").read_text().split())
    except subprocess.CalledProcessError as error:
        if b"unrecognized" in error.stderr or b"bad value" in error.stderr:
            pytest.skip(f"this compiler does not know {flags}")  # an older GCC: nothing of ours to test
        raise
    if path.suffix == ".so":  # this CPU has it: run it as the native build is run
        lib = ctypes.CDLL(str(path))
        assert cpu_gguf.SIMD_NAMES[lib.trillm_gguf_simd()] == name
        check_build(lib, monkeypatch)


def test_the_512_bit_kernels_give_the_256_bit_kernels_bits(tmp_path):
    """The k-quant kernels two runs a 512-bit instruction sum each run in the lanes and order of the
    256-bit ones, and int16 activations laid out in pairs of runs reach every kernel where it reads
    them (a row of 25 runs ends in a lone one): every type, every tile of rows of x, both
    activation widths, any thread count."""
    cpu = Path("/proc/cpuinfo").read_text().split()
    if not {"avx512_vnni", "avx512vl", "avx512bw"} <= set(cpu):
        compile_variant(tmp_path, "wide", VNNI_512, link=False)  # it must still build
        return
    wide, narrow = (
        ctypes.CDLL(str(compile_variant(tmp_path, n, f))) for n, f in (("wide", VNNI_512), ("narrow", VNNI_256))
    )
    assert (cpu_gguf.SIMD_NAMES[wide.trillm_gguf_simd()], cpu_gguf.SIMD_NAMES[narrow.trillm_gguf_simd()]) == (
        "avx512vnni",
        "avx512vnni-256",
    )
    P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name, K in [(name, K) for name in TYPES for K in (768, 800) if K % BLOCK_TYPES[name].values == 0]:
        weight = random_weight(name, 37, K, seed=5)
        rows = weight.data.contiguous()
        for M in (1, 2, 3, 4, 5, 9):
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
            for flags, threads in ((0, 1), (4, 2), (0, 3), (4, 1)):  # 4: int8 activations
                outs = []
                for lib in (wide, narrow):
                    out = torch.full((M, 37), float("nan"))
                    args = (P(x.data_ptr()), I64(K), INT(weight.kind.id), P(rows.data_ptr()), I64(rows.shape[1]))
                    args += (I64(37), I64(K), P(out.data_ptr()), I64(37), I64(M), INT(flags), INT(threads))
                    assert lib.trillm_gguf_matmul(*args) == 0
                    outs.append(out)
                assert not outs[0].isnan().any()
                assert torch.equal(outs[0], outs[1]), (name, K, M, flags, threads)
