"""Matmuls on AMX bfloat16 tiles over weights kept in their blocks: ``cpu_amx.c`` via ctypes.

``matmul(x, w)`` is ``x @ W.T`` with W's rows decoded (exactly as the weight's own kernels decode
them), rounded to bfloat16, and multiplied with x rounded to bfloat16, products summed in float32:
the rounding of ``bf16_panels``, without its panels in memory. A thread decodes 32 weight rows at a
time into L2 and runs every row of x past them on the tiles, so a batched decode step pays one
decode of the model per step instead of one per row of x; measured on two Sapphire Rapids cores
(``bench/gguf_kernels.py``) it is what makes 8-48-row steps several times faster than the integer
kernels. The fused decode loop calls it through ``layout`` (``trillm_amx_layout_matmul``), which
hands steps below ``min_rows`` to the weight's own matmul.

Where the CPU, the compiler or the kernel has no AMX-BF16 (``available()`` False) nothing here
runs and the callers keep their float32 paths.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from typing import Any

import attrs
import torch

from trillm.kernels import cpu_build, cpu_gguf, cpu_matmul
from trillm.kernels.block_weights import BlockWeight, Q4_1Weight, Q8_0Weight
from trillm.kernels.gguf_blocks import GGUFWeight
from trillm.kernels.stacked import Stacked

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "trillm_amx_available": [],
    "trillm_amx_matmul": [_P, _I64, _P, _P, _I64, _I64, _INT, _INT],
    "trillm_amx_layout_matmul": [_P, _I64, _P, _P, _I64, _I64, _INT, _INT],
    "trillm_amx_gated": [_P, _I64, _P, _I64, _P, _I64, _I64, _P, _I64, _I64, _INT, _INT],
    "trillm_amx_matmul_tiles": [_P, _P, _P, _I64, _I64, _INT, _INT],
    "trillm_amx_gated_tiles": [_P, _P, _I64, _P, _I64, _I64, _P, _I64, _P, _I64, _INT, _INT],
    "trillm_amx_pack": [_P, _I64, _P, ctypes.c_float, _I64, _I64, _P, _INT],
}
_KERNEL = cpu_build.CKernel("cpu_amx", _SIGNATURES, ctypes.c_int)
_ACCUMULATE = 1
_F32 = torch.float32
# Rows of x from which the tiles beat a weight's own float32 kernel (two Sapphire Rapids cores,
# ``bench/gguf_kernels.py --tiles``): a file's blocks from ~10 (their int16 kernels take one row of
# x at a time), repacked Q4_1/Q8_0 from 6 (SmolLM2's 121 matrices from memory, in turn: 5 rows 17.2
# ms in float32 against 19.5 on the tiles, 6 rows 22.4 against 19.8, 12 rows 43.2 against 20.7;
# the 16 measured before came from a process whose OpenMP teams slept at every barrier).
# BF16 rows (a half-precision checkpoint's) at every step, read where they lie: the tiles keep pace with
# memory from one row on, where cpu_gguf's float32 dots do not (SmolLM2's 121 matrices from memory: 1 row
# 13.5 ms on the tiles against 22.9, 2 rows 13.4 against 27.3, 8 rows 13.8 against 57.1), and a row's
# product is the same whatever rows come with it, so one kernel serves plain and speculative steps.
MIN_ROWS = {"GGUF": 12, "REPACKED": 6, "BF16": 1}


class _Layout(ctypes.Structure):
    """``AmxLayout`` in cpu_amx.c."""

    _fields_ = [
        ("decode", _P),
        ("weight", _P),
        ("N", _I64),
        ("K", _I64),
        ("below", _P),
        ("below_layout", _P),
        ("min_rows", _I64),
        ("decode16", _P),
        ("rows", _P),
        ("stride", _I64),
    ]


@functools.cache
def available() -> bool:
    """Whether the tiles run here: built with AMX-BF16 and granted by the kernel (Linux)."""
    return _KERNEL.available() and _KERNEL.functions()[0]() == 1


def handles(weight: object) -> bool:
    """Whether the tiles take ``weight``: a file's blocks or rows (a half-precision checkpoint's too)
    and repacked Q4_1 / Q8_0."""
    return isinstance(weight, (GGUFWeight, Q4_1Weight, Q8_0Weight))


def _form(weight: object) -> str:
    if isinstance(weight, GGUFWeight):
        return "BF16" if weight.kind.name == "BF16" else "GGUF"
    return "REPACKED"


def min_rows(weight: object) -> int:
    """``MIN_ROWS`` of ``weight``'s form (it must be one ``handles`` takes)."""
    return MIN_ROWS[_form(weight)]


WIDE_ROWS = 128  # cpu_amx.c's: from these rows of x the tiles take x as their A operand
_STEP = 32  # values of K per tile product, rows of x per block: TileRows pad both to it


def _padded(n: int) -> int:
    return -(-n // _STEP) * _STEP


@attrs.frozen(eq=False)  # identity: a tensor field has no truth value to compare by
class TileRows:
    """x [rows, cols] rounded to bfloat16 in the tiles' own order (each 16 rows' 32 values of each step of
    K side by side; rows and cols padded with zeros to multiples of 32): what one kernel of a wide step
    hands the next on the tiles (a norm to its projection, the gated product to the down projection),
    instead of float32 rows each consumer would round and reorder again."""

    data: torch.Tensor  # int16, at least _padded(rows) * _padded(cols) values, contiguous
    rows: int
    cols: int

    @classmethod
    def empty(cls, rows: int, cols: int) -> TileRows:
        return cls(torch.empty(_padded(rows) * _padded(cols), dtype=torch.int16), rows, cols)

    def __attrs_post_init__(self) -> None:
        if self.data.dtype is not torch.int16 or not self.data.is_contiguous() or not self.data.is_cpu:
            raise ValueError("TileRows hold a contiguous int16 CPU buffer")
        if self.data.numel() < _padded(self.rows) * _padded(self.cols):
            raise ValueError(f"a buffer of {self.data.numel()} values cannot hold {self.rows} x {self.cols} in tiles")

    def floats(self) -> torch.Tensor:
        """The values as float32 [rows, cols] (for checks: the kernels read them in place)."""
        R, C = _padded(self.rows), _padded(self.cols)
        blocks = self.data[: R * C].view(R // 16, C // _STEP, 16, _STEP)  # [row block, K step, row, value]
        bits = blocks.permute(0, 2, 1, 3).reshape(R, C)[: self.rows, : self.cols]
        return (bits.to(torch.int32) << 16).view(torch.float32)


def pack(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    out: TileRows | None = None,
    num_threads: int | None = None,
) -> TileRows:
    """float32 x [M, K] (unit column stride) as ``TileRows``, each row first RMS-normed with
    ``norm_weight`` (as ``cpu_ops.rms_norm`` norms it, the same floats) where one is given."""
    if x.dtype is not _F32 or x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1) or not x.is_cpu:
        raise ValueError(f"x must be float32 [M, K] with unit column stride, got {x.dtype} {tuple(x.shape)}")
    M, K = x.shape
    if norm_weight is not None and (norm_weight.dtype is not _F32 or norm_weight.shape != (K,)):
        raise ValueError(f"norm_weight must be float32 [{K}]")
    out = TileRows.empty(M, K) if out is None else out
    if (out.rows, out.cols) != (M, K):
        raise ValueError(f"out holds {out.rows} x {out.cols}, not {M} x {K}")
    w = norm_weight.contiguous() if norm_weight is not None else None
    threads = max(1, num_threads if num_threads is not None else torch.get_num_threads())
    rc = _KERNEL.functions()[6](
        x.data_ptr(), x.stride(0), w.data_ptr() if w is not None else None, eps, M, K, out.data.data_ptr(), threads
    )
    _raise_for(rc)
    return out


GATED = {"silu": 1, "gelu_tanh": 2}  # the gated MLP activations ``gated`` applies as products leave the tiles


def gated_parts(weight: object) -> tuple[Any, int, Any, int, int] | None:
    """A gated MLP's gate/up projection as (gate weight, its first row, up weight, its first row,
    intermediate size) for ``gated``: two parts of one size side by side, or one weight holding
    both (gate rows first); None for anything else."""
    if isinstance(weight, Stacked):
        if len(weight.parts) != 2 or not all(handles(p) for p in weight.parts):
            return None
        gate, up = weight.parts
        size = gate.shape[0]
        return (gate, 0, up, 0, size) if up.shape == gate.shape else None
    if handles(weight) and weight.shape[0] % 2 == 0:  # type: ignore[attr-defined]
        size = weight.shape[0] // 2  # type: ignore[attr-defined]
        return weight, 0, weight, size, size
    return None


def gated(
    x: torch.Tensor | TileRows, weight: object, activation: str, out: torch.Tensor | TileRows | None = None
) -> Any:
    """act(x @ Wgate.T) * (x @ Wup.T) in one pass on the tiles (``gated_parts`` says which weights):
    the rounding of ``matmul`` for both products, no [M, 2 I] product in memory, the activation
    applied as the sums leave the tiles (cpu_ops' forms, its exp within 3e-6). For wide steps:
    every row of x past panels paired once per call. x float32 rows or ``TileRows``; into float32
    rows, or (``out`` a ``TileRows``) rounded to bfloat16 in the tiles' order for the next product."""
    parts = gated_parts(weight)
    if parts is None or activation not in GATED:
        raise ValueError(f"no gated product on the tiles for {type(weight).__name__} / {activation}")
    gate, gate0, up, up0, size = parts
    K = gate.shape[1]
    M = _rows_of(x, K)
    if out is None:
        out = torch.empty(M, size, dtype=_F32)
    elif isinstance(out, TileRows):
        if (out.rows, out.cols) != (M, size):
            raise ValueError(f"out holds {out.rows} x {out.cols}, not {M} x {size}")
    elif out.dtype is not _F32 or out.shape != (M, size) or (size > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be float32 [{M}, {size}] with unit column stride")
    g, u = _cached(gate), _cached(up)
    threads = max(1, torch.get_num_threads())
    rows_out = out if isinstance(out, torch.Tensor) else None
    tiles_out = out.data.data_ptr() if isinstance(out, TileRows) else None
    if isinstance(x, TileRows):
        rc = _KERNEL.functions()[5](
            x.data.data_ptr(), g.address, gate0, u.address, up0, size,
            rows_out.data_ptr() if rows_out is not None else None, rows_out.stride(0) if rows_out is not None else 0,
            tiles_out, M, GATED[activation], threads,
        )  # fmt: skip
    elif rows_out is not None:
        rc = _KERNEL.functions()[3](
            x.data_ptr(), x.stride(0), g.address, gate0, u.address, up0, size, rows_out.data_ptr(),
            rows_out.stride(0), M, GATED[activation], threads,
        )  # fmt: skip
    else:
        return gated(pack(x), weight, activation, out)
    _raise_for(rc)
    return out


def _rows_of(x: torch.Tensor | TileRows, K: int) -> int:
    """Rows of x, checked to be float32 [M, K] with unit column stride or ``TileRows`` of K values."""
    if isinstance(x, TileRows):
        if x.cols != K:
            raise ValueError(f"x holds rows of {x.cols} values, not {K}")
        return x.rows
    if x.dtype is not _F32 or x.dim() != 2 or x.shape[1] != K or (K > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be float32 [M, {K}] with unit column stride, got {x.dtype} {tuple(x.shape)}")
    return x.shape[0]


def _raise_for(rc: int) -> None:
    if rc == 3:
        raise RuntimeError("no AMX-BF16 tiles here (amx_tiles.available() is False)")
    if rc:
        raise (
            MemoryError("the AMX kernel could not allocate its buffers")
            if rc == 1
            else ValueError("the weight's decoder failed" if rc == 2 else "the weights do not fit together")
        )


def _address(function: Any) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value or 0


class AmxWeight:
    """A weight's ``_Layout`` and everything it points into, kept alive together."""

    def __init__(self, weight: GGUFWeight | BlockWeight, min_rows: int) -> None:
        N, K = weight.shape
        if isinstance(weight, GGUFWeight):
            inner: object = cpu_gguf.layout(weight)
            inner_address = ctypes.addressof(inner)  # type: ignore[arg-type]
            decode, below = cpu_gguf._KERNEL.functions()[6], cpu_gguf.layout_matmul_address()
            decode16 = cpu_gguf._KERNEL.functions()[7]
        elif isinstance(weight, (Q4_1Weight, Q8_0Weight)):
            inner = weight
            inner_address = cpu_matmul._layout(weight)[2]
            decode, below = cpu_matmul._functions()[4], _address(cpu_matmul._functions()[0])
            decode16 = cpu_matmul._functions()[5]
        else:
            raise TypeError(f"no AMX tiles for a {type(weight).__name__}")
        self.inner = inner
        self.weight = weight
        self.shape = (N, K)
        rows, stride = None, 0
        if _form(weight) == "BF16" and K % 32 == 0 and isinstance(weight, GGUFWeight):  # read in place by the tiles
            rows, stride = weight.data.data_ptr(), weight.data.stride(0) // 2
        self.layout = _Layout(
            _address(decode), inner_address, N, K, below, inner_address, min_rows, _address(decode16), rows, stride
        )

    @property
    def address(self) -> int:
        return ctypes.addressof(self.layout)


_cache: dict[int, tuple[weakref.ref, AmxWeight]] = {}


def layout(weight: GGUFWeight | BlockWeight, min_rows: int = 0) -> AmxWeight:
    """``weight`` for ``trillm_amx_layout_matmul`` (the fused loop's matmul signature): from
    ``min_rows`` rows on the tiles, below them the weight's own kernel. The caller keeps the
    returned object alive as long as the address is used."""
    return AmxWeight(weight, min_rows)


def layout_matmul_address() -> int:
    """The address of ``trillm_amx_layout_matmul`` (cpu_matmul's matmul signature)."""
    return _address(_KERNEL.functions()[2])


def _cached(weight: GGUFWeight | BlockWeight) -> AmxWeight:
    key = id(weight)
    entry = _cache.get(key)
    if entry is None or entry[0]() is not weight:
        cache = _cache  # the callback may run at exit, after the module's globals are gone

        def forget(_: object) -> None:
            cache.pop(key, None)

        entry = (weakref.ref(weight, forget), AmxWeight(weight, 0))
        _cache[key] = entry
    return entry[1]


def matmul(
    x: torch.Tensor | TileRows,
    weight: GGUFWeight | BlockWeight,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    num_threads: int | None = None,
) -> torch.Tensor:
    """out[M, N] (float32) = x @ W.T on the tiles, or += with ``accumulate``; x float32 [M, K]
    with unit column stride, or ``TileRows`` (read as they are)."""
    amx = _cached(weight)
    N, K = amx.shape
    M = _rows_of(x, K)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True adds into out, so out must be given")
        out = torch.empty(M, N, dtype=_F32)
    elif out.dtype is not _F32 or out.shape != (M, N) or (N > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be float32 [{M}, {N}] with unit column stride")
    threads = max(1, num_threads if num_threads is not None else torch.get_num_threads())
    flags = _ACCUMULATE if accumulate else 0
    if isinstance(x, TileRows):
        rc = _KERNEL.functions()[4](x.data.data_ptr(), amx.address, out.data_ptr(), out.stride(0), M, flags, threads)
        _raise_for(rc)
        return out
    rc = _KERNEL.functions()[1](
        x.data_ptr(),
        x.stride(0),
        amx.address,
        out.data_ptr(),
        out.stride(0),
        M,
        flags,
        threads,
    )
    _raise_for(rc)
    return out
