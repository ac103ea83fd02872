"""Matmul with block weights (``kernels/block_weights``) decoded in registers: ``cpu_matmul.c`` via ctypes.

``matmul(x, weight)`` is ``x @ dequantize(weight).T`` without the float32 matrix: the kernel
reads 0.75 (Q4_1) or 1.125 (Q8_0) bytes per weight instead of 4, and decodes each value
exactly as ``dequantize`` does, so the result is torch.mm's up to the order of the float32
additions. Float32 CPU tensors only (ValueError otherwise). Built and cached by
``kernels.cpu_build``; the GIL is released during each call.

Up to 11 rows of x, each block of 4 weight rows is decoded in registers (memory bound
at one row: all linear layers of SmolLM2-135M in ~6 ms where dense float32 takes 21 ms);
above that, 48 weight rows at a time are decoded into an L1-sized chunk and multiplied with
all rows of x (~75% of the FMA peak at 32 rows, ~85% at 512). Both paths are built for
AVX-512 or, without it, for AVX2 + FMA (8-float vectors, 2 weight rows per in-register
tile); with neither, a plain-C path runs (``simd()`` says which).

A weight is checked once and its layout cached (by identity, dropped with the weight):
block weights are frozen (their tensors must not be resized in place), and a call must
cost microseconds at decode sizes.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from trillm.kernels import cpu_build
from trillm.kernels.block_weights import BlockWeight, Q4_1Weight, Q8_0Weight

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "trillm_matmul": [_P, _I64, _P, _P, _I64, _I64, _INT, _INT],
    "trillm_dequantize": [_P, _P, _INT],
    "trillm_has_avx512": [],
    "trillm_simd": [],
    "trillm_decode_range": [_P, _I64, _I64, _I64, _P],
    "trillm_decode_range_bf16": [_P, _I64, _I64, _I64, _P],
}
# d * q + m must round twice, as dequantize does: no fused multiply-add for the decode.
_EXTRA_FLAGS = ("-ffp-contract=off",)
_ACCUMULATE, _PORTABLE = 1, 2
_KERNEL_ROWS_SHIFT = 8  # cpu_common.h's
_F32, _CPU = torch.float32, torch.device("cpu")


class _Layout(ctypes.Structure):
    """``WeightLayout`` in cpu_matmul.c; m is NULL for Q8_0."""

    _fields_ = [("qs", _P), ("d", _P), ("m", _P), ("N", _I64), ("K", _I64)]


# id(weight) -> (weakref to it, N, K, address of its _Layout, the _Layout, the tensors it points into)
_layouts: dict[int, tuple] = {}


_KERNEL = cpu_build.CKernel("cpu_matmul", _SIGNATURES, ctypes.c_int, _EXTRA_FLAGS)
_functions = _KERNEL.functions  # (matmul, dequantize, has_avx512, simd, decode_range, decode_range_bf16)
available = _KERNEL.available
_SIMD_NAMES = ("plain", "avx2", "avx512")  # by trillm_simd's value


def has_avx512() -> bool:
    """Whether the library was built with the AVX-512 paths."""
    return bool(_functions()[2]())


def simd() -> str:
    """Which fast paths the library was built with: "avx512", "avx2" (AVX2 + FMA), or
    "plain" (only the plain-C path, slower than MKL on dense float32)."""
    return _SIMD_NAMES[_functions()[3]()]


def _check(weight: BlockWeight) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """((qs, d[, m]) contiguous, N, K) after checking dtypes and shapes."""
    tensors: tuple[torch.Tensor, ...]
    if isinstance(weight, Q4_1Weight):
        tensors, qs_dtype, per_byte = (weight.qs, weight.d, weight.m), torch.uint8, 2
    elif isinstance(weight, Q8_0Weight):
        tensors, qs_dtype, per_byte = (weight.qs, weight.d), torch.int8, 1
    else:
        raise ValueError(f"not a block weight: {type(weight).__name__}")
    qs, scales = tensors[0], tensors[1:]
    if qs.dtype != qs_dtype or any(s.dtype != _F32 for s in scales):
        raise ValueError(f"{type(weight).__name__} needs qs {qs_dtype} and float32 scales")
    if not all(t.device.type == "cpu" for t in tensors):
        raise ValueError("cpu_matmul takes CPU tensors only")
    if qs.dim() != 2 or (qs.shape[1] * per_byte) % 32:
        raise ValueError(f"qs {tuple(qs.shape)} is not [N, K{' / 2' if per_byte == 2 else ''}] with K % 32 == 0")
    N, K = qs.shape[0], qs.shape[1] * per_byte
    if any(s.shape != (N, K // 32) for s in scales):
        raise ValueError(f"scales {[tuple(s.shape) for s in scales]} are not [N, K / 32] = [{N}, {K // 32}]")
    return tuple(t.contiguous() for t in tensors), N, K


def _layout(weight: BlockWeight) -> tuple[int, int, int]:
    """(N, K, address of the weight's C layout), checked on first use."""
    key = id(weight)
    entry = _layouts.get(key)
    if entry is None or entry[0]() is not weight:
        tensors, N, K = _check(weight)
        layout = _Layout(*(t.data_ptr() for t in tensors), *((None,) if len(tensors) == 2 else ()), N, K)

        def forget(ref: weakref.ref, key: int = key) -> None:
            if _layouts.get(key, (None,))[0] is ref:  # not a newer weight that reuses the id
                del _layouts[key]

        entry = (weakref.ref(weight, forget), N, K, ctypes.addressof(layout), layout, tensors)
        _layouts[key] = entry
    return entry[1], entry[2], entry[3]


def matmul(
    x: torch.Tensor,
    weight: BlockWeight,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    num_threads: int | None = None,
    kernel_rows: int | None = None,
) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequantize(weight).T ; with accumulate=True, out += that (out must be given).

    x: float32 CPU [M, K] with any row stride (e.g. columns of a wider matrix); other
    layouts are copied. out: float32 CPU [M, N] with unit column stride and any row
    stride, written in place (allocated when None); it must not overlap x. Returns out.
    ``kernel_rows``: pick the kernel as for that many rows (each row's result is the same
    whatever rows come with it, within one kernel; ``cpu_common.h``).
    """
    return _matmul(x, weight, out, accumulate, num_threads, (kernel_rows or 0) << _KERNEL_ROWS_SHIFT)


# The checks below avoid the slower torch calls (``x.device``, ``torch.empty`` with a
# tuple): at decode sizes they would cost as much as the work.


def _matmul(
    x: torch.Tensor,
    weight: BlockWeight,
    out: torch.Tensor | None,
    accumulate: bool,
    num_threads: int | None,
    flags: int,
) -> torch.Tensor:
    """``matmul``; flags=_PORTABLE forces the plain-C path (a test hook)."""
    N, K, layout = _layout(weight)
    if x.dtype is not _F32 or not x.is_cpu:
        raise ValueError("cpu_matmul.matmul takes float32 CPU tensors only")
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x {tuple(x.shape)} does not match the weight's K = {K}")
    M = x.shape[0]
    x_stride = x.stride()
    if x_stride[1] != 1 and K > 1:
        x = x.contiguous()
        x_stride = x.stride()
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True adds into out, so out must be given")
        out = torch.empty(M, N, dtype=_F32, device=_CPU)  # not the defaults, which a caller may have changed
        out_stride = N
    else:
        if out.dtype is not _F32 or not out.is_cpu:
            raise ValueError("out must be a float32 CPU tensor")
        if out.dim() != 2 or out.shape[0] != M or out.shape[1] != N:
            raise ValueError(f"out {tuple(out.shape)} is not [M, N] = [{M}, {N}]")
        strides = out.stride()
        if (N > 1 and strides[1] != 1) or (M > 1 and strides[0] < N):
            raise ValueError(f"out needs unit column stride and non-overlapping rows, got strides {strides}")
        out_stride = strides[0]
        if accumulate:
            flags |= _ACCUMULATE
    if M and N:
        if K == 0:
            if not accumulate:
                out.zero_()
            return out
        threads = num_threads if num_threads is not None else torch.get_num_threads()
        rc = _functions()[0](x.data_ptr(), x_stride[0], layout, out.data_ptr(), out_stride, M, flags, max(1, threads))
        if rc != 0:
            raise MemoryError("the CPU matmul kernel could not allocate its scratch buffer")
    return out


def dequantize_rows(
    weight: BlockWeight, start: int, stop: int, out: torch.Tensor, path: int | None = None
) -> torch.Tensor:
    """Rows ``start:stop`` decoded into ``out`` (float32 [rows, K], contiguous) by a C decoder: path 0
    the plain-C one, 1 the SIMD one (AVX-512 or AVX2) that both fast paths use; None the one
    ``matmul`` uses here. A panel for a GEMM in another dtype (``kernels/bf16_panels``)."""
    if path is None:
        path = 0 if simd() == "plain" else 1
    N, K, _ = _layout(weight)
    if not 0 <= start <= stop <= N:
        raise ValueError(f"rows {start}:{stop} of a weight of {N}")
    if out.dtype is not _F32 or out.shape != (stop - start, K) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{stop - start}, {K}]")
    rows = [t[start:stop] for t in _layouts[id(weight)][5]]
    part = _Layout(*(t.data_ptr() for t in rows), *((None,) if len(rows) == 2 else ()), stop - start, K)
    if stop > start and K and _functions()[1](ctypes.addressof(part), out.data_ptr(), path) != 0:
        raise ValueError(f"decoder path {path} is not built here")
    return out


def dequantize_c(weight: BlockWeight, path: int | None = None) -> torch.Tensor:
    """The float32 [N, K] matrix as a C decoder computes it (a test hook; ``dequantize_rows``'
    ``path``)."""
    N, K, _ = _layout(weight)
    return dequantize_rows(weight, 0, N, torch.empty(N, K, dtype=_F32, device=_CPU), path)
