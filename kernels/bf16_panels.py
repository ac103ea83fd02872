"""Wide steps' GEMMs in bfloat16 over float32-served weights: AMX tiles through oneDNN.

A decode step reads every weight once and is bound by memory, so float32 activations against
the weights' blocks (``cpu_gguf``, ``cpu_matmul``) are what it wants. A prefill chunk multiplies
hundreds of rows by each weight and is bound by arithmetic: float32 FMAs peak at ~300 GFLOP/s
on two Sapphire Rapids cores, AMX bfloat16 tiles at 1-2.7 TFLOP/s (measured through torch's
oneDNN on the prefill shapes of SmolLM2). So from a weight's ``crossover`` rows on, it is decoded
panel by panel (as the float32 GEMM path does), rounded to bfloat16 and multiplied with x in
bfloat16; the products are summed in float32 by the tiles and the result, rounded once to
bfloat16 by oneDNN, lands in the float32 output. The weights stay in their blocks: nothing
decoded is kept (a file's BF16 rows are multiplied as they are). Where our own AMX kernel runs
(``amx_tiles.available()``) it takes every form it handles at every width instead: the same
rounding, without the panels, the bfloat16 copy of x or the product's conversion back.

``amx_bf16()`` says whether this CPU has the tiles (Linux: ``/proc/cpuinfo``); elsewhere
bfloat16 GEMMs are slower than float32 ones, so ``--gemm-dtype auto`` keeps float32 there.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from trillm.kernels import amx_tiles, cpu_gguf, cpu_matmul
from trillm.kernels.block_weights import BlockWeight, Q4_1Weight, Q8_0Weight
from trillm.kernels.gguf_blocks import GGUFWeight
from trillm.kernels.stacked import Stacked, out_features

MIN_PADDED = 64  # x's rows are padded to a power of two, at least this
ROWS = 64  # rows of a step from which its prefill spans attend in bfloat16
# Rows of x from which a weight multiplies here rather than in its float32 kernel: where that kernel
# would decode panels for a float32 GEMM itself (a file's blocks, ``cpu_gguf``), and for repacked Q4_1/Q8_0
# and dense float32, whose register-decoding and MKL kernels are as fast up to ~80 and ~60 rows (two
# Sapphire Rapids cores). Below these, decode steps keep their float32 kernels and the fused loop: a
# bfloat16 product at 32 rows decodes every panel of the model each step, measured slower there. Where
# the AMX tiles run (``amx_tiles``), they take over from their own MIN_ROWS with panels kept in L2.
CROSSOVER = {"BF16": cpu_gguf.FLOAT_GEMM_ROWS, "GGUF": cpu_gguf.GEMM_ROWS, "REPACKED": 80, "DENSE": 64}
PANEL_VALUES = 1 << 21  # weight values per GEMM (4 MiB of bfloat16): most of a small model's weights are one
DECODE_FLOATS = 1 << 17  # decoded to float32 at a time (512 KiB, in L2), then rounded into the panel
_BF16, _F32 = torch.bfloat16, torch.float32


class Scratch:
    """A model's panels and GEMM output, grown to its largest step and reused: fresh, they would be
    new pages every call (the engine pins glibc's mmap threshold at 128 KiB so that freed memory goes
    back), and faulting them in doubled a prefill chunk's GEMM time. The backend owns one, for steps
    run one at a time; bounded by the largest step's rows times one panel (~6 MiB at 512 rows)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffers[name] = torch.empty(numel, dtype=dtype)
        return buffer[:numel]


@functools.cache
def amx_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 on AMX tiles (Linux only: elsewhere False)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and " amx_bf16" in line for line in text.splitlines())


def crossover(weight: object) -> int:
    """Rows of x from which ``matmul`` beats the float32 path for ``weight`` (``CROSSOVER``, or where
    ``amx_tiles`` runs, its ``min_rows``)."""
    if amx_tiles.handles(weight) and amx_tiles.available():
        return amx_tiles.min_rows(weight)
    if isinstance(weight, GGUFWeight):
        return CROSSOVER["BF16" if weight.kind.name == "BF16" else "GGUF"]
    if isinstance(weight, Stacked):
        return max(crossover(part) for part in weight.parts)
    return CROSSOVER["DENSE" if isinstance(weight, torch.Tensor) else "REPACKED"]


def _decode(weight: GGUFWeight | BlockWeight, start: int, stop: int, panel: torch.Tensor) -> torch.Tensor:
    if isinstance(weight, GGUFWeight):
        return cpu_gguf.dequantize(weight, start, stop, panel)
    return cpu_matmul.dequantize_rows(weight, start, stop, panel)


def _into(out: torch.Tensor, y: torch.Tensor, accumulate: bool) -> None:
    out.add_(y) if accumulate else out.copy_(y)


def _blocks(
    x: torch.Tensor, weight: GGUFWeight | BlockWeight, out: torch.Tensor, accumulate: bool, scratch: Scratch
) -> None:
    N, K = weight.shape
    # Panels of equal rows, a multiple of 64: oneDNN runs a narrow leftover panel several times slower.
    panels = -(-N // max(64, PANEL_VALUES // max(K, 1)))
    per_panel = -(-N // panels)
    rows = -(-per_panel // 64) * 64
    M, most = x.shape[0], min(rows, N)
    panel16 = scratch.take("panel16", most * K, _BF16)
    product = scratch.take("product", M * most, _BF16)
    step = max(1, min(most, DECODE_FLOATS // max(K, 1)))
    decoded = scratch.take("decoded", step * K, _F32)
    for start in range(0, N, rows):
        n = min(start + rows, N) - start
        w = panel16[: n * K].view(n, K)
        for first in range(0, n, step):  # decoded a few rows at a time: rounded to bfloat16 while in cache
            k = min(step, n - first)
            w[first : first + k].copy_(_decode(weight, start + first, start + first + k, decoded[: k * K].view(k, K)))
        y = product[: M * n].view(M, n)
        torch.mm(x, w.t(), out=y)
        _into(out[:, start : start + n], y[: out.shape[0]], accumulate)


def matmul(
    x: torch.Tensor | amx_tiles.TileRows,
    weight: object,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """out[M, N] (float32) = x @ W, or += with ``accumulate``; x is float32 or bfloat16 [M, K] (rounded
    to bfloat16 here) and ``weight`` any form the CPU backend serves: a file's blocks, exact Q4_1/Q8_0
    blocks, ``Stacked`` parts, or a dense float32 [K, N] (``layers.transposed``). ``scratch``: buffers
    to reuse (fresh ones when None). x may be ``amx_tiles.TileRows``: read in place on the tiles."""
    scratch = scratch if scratch is not None else Scratch()
    parts = weight.parts if isinstance(weight, Stacked) else (weight,)
    on_tiles = all(amx_tiles.handles(p) for p in parts) and amx_tiles.available()
    if isinstance(x, amx_tiles.TileRows):
        if on_tiles and x.rows >= amx_tiles.WIDE_ROWS:
            out = torch.empty(x.rows, out_features(weight), dtype=_F32) if out is None else out
            if out.dtype is not _F32 or out.shape != (x.rows, out_features(weight)):
                raise ValueError(f"out must be float32 [{x.rows}, {out_features(weight)}]")
            _on_tiles(x, parts, out, accumulate)
            return out
        x = x.floats()
    if x.dtype not in (_BF16, _F32) or x.dim() != 2:
        raise ValueError(f"x must be float32 or bfloat16 [M, K], got {x.dtype} {tuple(x.shape)}")
    M, K = x.shape
    if not isinstance(weight, (torch.Tensor, Stacked, GGUFWeight, Q4_1Weight, Q8_0Weight)):
        raise TypeError(f"no bfloat16 GEMM for a {type(weight).__name__}")
    N = out_features(weight)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True adds into out, so out must be given")
        out = torch.empty(M, N, dtype=_F32)
    elif out.dtype is not _F32 or out.shape != (M, N):
        raise ValueError(f"out must be float32 [{M}, {N}]")
    if on_tiles:
        _on_tiles(x.float(), parts, out, accumulate)  # x rounded to bfloat16 in C
        return out
    # x's rows rounded up to a power of two (the extra rows' products are not read): oneDNN builds and
    # keeps a kernel per shape, and a prefill chunk's rows vary with every prompt. Measured over random
    # prompt lengths: resident memory rose ~10 MiB before levelling off with the rows as they came,
    # ~2 MiB rounded to powers of two (multiples of 64 were between).
    padded = max(MIN_PADDED, 1 << (M - 1).bit_length())
    x16 = scratch.take("x", padded * K, _BF16).view(padded, K)
    x16[:M].copy_(x)
    x16[M:].zero_()
    _matmul(x16, weight, out, accumulate, scratch)
    return out


def _on_tiles(x: torch.Tensor | amx_tiles.TileRows, parts: tuple, out: torch.Tensor, accumulate: bool) -> None:
    """Panels decoded in L2 (or a file's BF16 rows read in place) onto AMX tiles: the same rounding of
    x and W, the float32 sums not rounded again; no panels, x or product in memory. At every width:
    from 2,048-row steps down they beat oneDNN's panels counted with their conversions (a 2,000-token
    prefill of SmolLM2: 0.74 -> 0.57 s in Q4_1, 0.66 -> 0.58 s in BF16)."""
    start = 0
    for part in parts:
        stop = start + out_features(part)
        amx_tiles.matmul(x, part, out=out[:, start:stop], accumulate=accumulate)
        start = stop


def _matmul(x: torch.Tensor, weight: object, out: torch.Tensor, accumulate: bool, scratch: Scratch) -> None:
    if isinstance(weight, torch.Tensor):
        _into(out, torch.mm(x, weight.to(_BF16))[: out.shape[0]], accumulate)
    elif isinstance(weight, Stacked):
        start = 0
        for part in weight.parts:
            stop = start + out_features(part)
            _matmul(x, part, out[:, start:stop], accumulate, scratch)
            start = stop
    elif isinstance(weight, GGUFWeight) and weight.kind.name == "BF16":  # the file's rows as they are
        N = out.shape[1]
        y = scratch.take("product", x.shape[0] * N, _BF16).view(x.shape[0], N)
        torch.mm(x, weight.data.view(_BF16).t(), out=y)
        _into(out, y[: out.shape[0]], accumulate)
    elif isinstance(weight, (GGUFWeight, Q4_1Weight, Q8_0Weight)):
        _blocks(x, weight, out, accumulate, scratch)
    else:
        raise TypeError(f"no bfloat16 GEMM for a {type(weight).__name__}")
