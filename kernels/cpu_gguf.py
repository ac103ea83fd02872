"""Matmul, embedding rows and dequantize for ``GGUFWeight`` (the file's blocks): ``cpu_gguf.c`` via ctypes.

``matmul(x, w)`` is ``x @ dequantize(w).T`` without the float32 matrix. Below ``GEMM_ROWS`` rows
of x (decode steps, bound by the bytes of the weight), x is quantized to int16 per 32 values
(or int8, as llama.cpp does, where the weight's ``activation_bits`` say 8: 256x coarser, fewer
instructions) and each block is unpacked once and dotted in integers with every row, its scales
applied once per sub-block: the result is within ``ACTIVATION_ERROR`` (``INT8_ACTIVATION_ERROR``)
of the float one, relative to ``|x| @ |W|.T``. ``exact=True`` (and F16 /
BF16 weights) decodes weight rows to float32 instead. From ``GEMM_ROWS`` rows on (prefill),
panels of ``PANEL_FLOATS / K`` weight rows are decoded and multiplied with torch's GEMM, in float32. Float32
CPU tensors only; the GIL is released in C.
"""

from __future__ import annotations

import ctypes

import torch

from trillm.kernels import cpu_build
from trillm.kernels.gguf_blocks import GGUFWeight

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES: dict[str, list] = {
    "trillm_gguf_matmul": [_P, _I64, _INT, _P, _I64, _I64, _I64, _P, _I64, _I64, _INT, _INT],
    "trillm_gguf_rows": [_INT, _P, _I64, _I64, _P, _I64, _P, _INT],
    "trillm_gguf_dequantize": [_INT, _P, _I64, _I64, _I64, _I64, _P, _I64, _INT],
    "trillm_gguf_simd": [],
    "trillm_gguf_layout_matmul": [_P, _I64, _P, _P, _I64, _I64, _INT, _INT],
    "trillm_gguf_matmul_grouped": [_P, _I64, _I64, _INT, _P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _I64, _INT, _INT],
    "trillm_gguf_decode_range": [_P, _I64, _I64, _I64, _P],
    "trillm_gguf_decode_range_bf16": [_P, _I64, _I64, _I64, _P],
}
# The decoders round as gguf's numpy reference does: no fused multiply-add.
_KERNEL = cpu_build.CKernel("cpu_gguf", _SIGNATURES, ctypes.c_int, ("-ffp-contract=off",))
available = _KERNEL.available
_F32, _CPU = torch.float32, torch.device("cpu")
_ACCUMULATE, _EXACT, _INT8 = 1, 2, 4
GEMM_ROWS = 49  # rows of x from which the panel + GEMM path runs (at most the C kernel's MAX_INT_ROWS + 1;
# measured on AVX2 (Q4_K, Q6_K, 4096 x 4096): the int16 path is faster up to ~50 rows, torch's GEMM above)
FLOAT_GEMM_ROWS = 12  # the same for F16 / BF16 weights, whose rows below it are decoded and dotted in float32
ACTIVATION_ERROR = 2e-5  # bound of the int16 path's error per output, relative to sum_k |x_k| |w_k| (tested)
INT8_ACTIVATION_ERROR = 5e-3  # the same for int8 activations: half a step of 127 (1/254), rounded up
SIMD_NAMES = ("plain", "avx2", "avxvnni", "avx512vnni-256", "avx512vnni")  # by trillm_gguf_simd's value
PANEL_FLOATS = 1 << 19  # a panel decoded per GEMM: 2 MiB of float32 (measured best of 0.6-16 MiB at K 576-2048)


def simd() -> str:
    """The instruction set the integer path runs on here (``SIMD_NAMES``), for the start-up log."""
    return SIMD_NAMES[_KERNEL.functions()[3]()]


class GGUFLayout(ctypes.Structure):
    """A weight as ``cpu_forward.c``'s fused loop holds it (``trillm_gguf_layout_matmul``'s layout)."""

    _fields_ = [("type", _I64), ("w", _P), ("row_bytes", _I64), ("N", _I64), ("K", _I64), ("flags", _I64)]


def layout(weight: GGUFWeight) -> GGUFLayout:
    """``weight`` for the fused loop (which must keep ``weight`` alive: this holds its address)."""
    _check(weight)
    N, K = weight.shape
    return GGUFLayout(weight.kind.id, weight.data.data_ptr(), weight.data.stride(0), N, K, activation_flags(weight))


def layout_matmul_address() -> int:
    """The address of ``trillm_gguf_layout_matmul`` (cpu_matmul's matmul signature)."""
    return ctypes.cast(_KERNEL.functions()[4], ctypes.c_void_p).value or 0


def _gemm_rows(weight: GGUFWeight) -> int:
    """The rows of x from which ``matmul`` multiplies decoded panels with torch's GEMM."""
    return FLOAT_GEMM_ROWS if weight.kind.values == 1 else GEMM_ROWS


def max_fused_rows(weight: GGUFWeight) -> int:
    """The most rows of x ``matmul`` runs in C alone (beyond them it multiplies panels in torch)."""
    return _gemm_rows(weight) - 1


def activation_flags(weight: GGUFWeight) -> int:
    """The C kernels' flag for ``weight``'s activation width (``INT8``, or 0 for int16)."""
    return _INT8 if weight.activation_bits == 8 else 0


def _threads(num_threads: int | None) -> int:
    return max(1, num_threads if num_threads is not None else torch.get_num_threads())


def _check(weight: GGUFWeight) -> None:
    data = weight.data
    if data.dtype != torch.uint8 or data.dim() != 2 or not data.is_cpu or data.stride(1) != 1:
        raise ValueError("a GGUFWeight holds uint8 CPU rows [N, row_bytes] with unit stride")


def dequantize(
    weight: GGUFWeight, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows ``start:stop`` as float32 [rows, K] (into ``out`` when given, any row stride)."""
    _check(weight)
    N, K = weight.shape
    stop = N if stop is None else stop
    if not 0 <= start <= stop <= N:
        raise ValueError(f"rows {start}:{stop} of a weight of {N}")
    rows = stop - start
    if out is None:
        out = torch.empty(rows, K, dtype=_F32, device=_CPU)
    if out.shape != (rows, K) or out.dtype is not _F32 or (K > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be float32 [{rows}, {K}] with unit column stride")
    if rows and K:
        data = weight.data
        rc = _KERNEL.functions()[2](
            weight.kind.id,
            data.data_ptr(),
            data.stride(0),
            K,
            start,
            rows,
            out.data_ptr(),
            out.stride(0),
            _threads(None),
        )
        if rc:
            raise ValueError(f"cpu_gguf cannot decode {weight.kind.name}")
    return out


def embedding(weight: GGUFWeight, ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), K]: the rows ``ids`` names, decoded (an embedding lookup)."""
    _check(weight)
    N, K = weight.shape
    flat = ids.reshape(-1).to(device=_CPU, dtype=torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= N):
        raise IndexError(f"a token id is outside the embedding's {N} rows")
    out = torch.empty(flat.numel(), K, dtype=_F32, device=_CPU)
    if flat.numel():
        data = weight.data
        rc = _KERNEL.functions()[1](
            weight.kind.id,
            data.data_ptr(),
            data.stride(0),
            K,
            flat.data_ptr(),
            flat.numel(),
            out.data_ptr(),
            _threads(None),
        )
        if rc:
            raise ValueError(f"cpu_gguf cannot decode {weight.kind.name}")
    return out.view(*ids.shape, K)


def matmul(
    x: torch.Tensor,
    weight: GGUFWeight,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    num_threads: int | None = None,
    exact: bool = False,
) -> torch.Tensor:
    """y[M, N] = x[M, K] @ dequantize(weight).T; with accumulate=True, out += that (out given).
    ``exact``: float32 activations at every size (else the weight's ``activation_bits`` below
    ``GEMM_ROWS`` rows).

    x: float32 CPU [M, K] (other layouts are copied). out: float32 CPU [M, N] with unit column
    stride (written in place; allocated when None); it must not overlap x."""
    _check(weight)
    N, K = weight.shape
    if x.dtype is not _F32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be float32 CPU [M, {K}], got {x.dtype} {tuple(x.shape)} on {x.device}")
    if x.stride(1) != 1:
        x = x.contiguous()
    M = x.shape[0]
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True adds into out, so out must be given")
        out = torch.empty(M, N, dtype=_F32, device=_CPU)
    elif out.dtype is not _F32 or not out.is_cpu or out.shape != (M, N) or (N > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be float32 CPU [{M}, {N}] with unit column stride")
    if not (M and N):
        return out
    if M >= _gemm_rows(weight):
        rows = max(16, PANEL_FLOATS // K)
        panel = torch.empty(min(rows, N), K, dtype=_F32, device=_CPU)
        for start in range(0, N, rows):
            stop = min(start + rows, N)
            w = dequantize(weight, start, stop, panel[: stop - start])
            part = out[:, start:stop]
            if accumulate:
                part.addmm_(x, w.t())
            else:
                torch.mm(x, w.t(), out=part) if part.is_contiguous() else part.copy_(torch.mm(x, w.t()))
        return out
    data = weight.data
    rc = _KERNEL.functions()[0](
        x.data_ptr(),
        x.stride(0),
        weight.kind.id,
        data.data_ptr(),
        data.stride(0),
        N,
        K,
        out.data_ptr(),
        out.stride(0),
        M,
        (_ACCUMULATE if accumulate else 0) | (_EXACT if exact else 0) | activation_flags(weight),
        _threads(num_threads),
    )
    if rc == 1:
        raise MemoryError("the GGUF matmul could not allocate its scratch buffer")
    if rc:
        raise ValueError(f"cpu_gguf cannot decode {weight.kind.name}")
    return out


def groupable(weights: list[GGUFWeight], rows: int) -> bool:
    """Whether ``matmul_grouped`` runs these at ``rows`` rows of x: one type, shape and activation
    width, the integer path."""
    first = weights[0]
    return (
        rows < _gemm_rows(first)
        and first.kind.values > 1
        and all(
            w.kind is first.kind
            and w.shape == first.shape
            and w.data.stride(0) == first.data.stride(0)
            and w.activation_bits == first.activation_bits
            for w in weights
        )
    )


def matmul_grouped(
    x: torch.Tensor, weights: list[GGUFWeight], per_group_x: bool, num_threads: int | None = None
) -> torch.Tensor:
    """[M, G * N]: column block g is x_g @ dequantize(weights[g]).T, in one call (``groupable``
    weights). ``per_group_x``: x is [M, G * K], group g's input its columns g*K:(g+1)*K; else x
    [M, K] for every group. The integer path, as ``matmul`` takes below ``GEMM_ROWS`` rows."""
    first = weights[0]
    for w in weights:
        _check(w)
    N, K = first.shape
    G = len(weights)
    if x.dtype is not _F32 or not x.is_cpu or x.dim() != 2 or x.shape[1] != (G * K if per_group_x else K):
        raise ValueError(f"x must be float32 CPU [M, {G * K if per_group_x else K}], got {tuple(x.shape)}")
    if not groupable(weights, x.shape[0]):
        raise ValueError("matmul_grouped takes weights of one type, shape and width, at rows the integer path runs")
    x = x.contiguous()
    M = x.shape[0]
    out = torch.empty(M, G * N, dtype=_F32, device=_CPU)
    pointers = (ctypes.c_void_p * G)(*(w.data.data_ptr() for w in weights))
    rc = _KERNEL.functions()[5](
        x.data_ptr(),
        x.stride(0),
        K if per_group_x else 0,
        first.kind.id,
        pointers,
        G,
        first.data.stride(0),
        N,
        K,
        out.data_ptr(),
        out.stride(0),
        N,
        M,
        activation_flags(first),
        _threads(num_threads),
    )
    if rc == 1:
        raise MemoryError("the grouped GGUF matmul could not allocate its scratch buffers")
    if rc:
        raise ValueError(f"cpu_gguf cannot group {first.kind.name}")
    return out
