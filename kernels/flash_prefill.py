"""Prefill attention on AMX bfloat16 tiles, read straight from the paged cache: ``cpu_flash.c``.

The CPU backend's bfloat16 prefill attention otherwise gathers each span's keys and values from
their pages, pads and converts them for torch's flash kernel and converts its output back; here
one C call per step does it for every span with the rounding of that path (Q, K, V and the softmax weights
in bfloat16, sums and softmax in float32). Measured on two Sapphire Rapids cores at 2,000 tokens
of SmolLM2 (9 heads of 64): see ``docs/benchmarks.md``. Where the CPU or the build has no AMX
(``available()`` False), or a layer soft-caps its scores, the torch path stays.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from trillm.kernels import amx_tiles, cpu_build, cpu_decode

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "trillm_flash_prefill": [_P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64]
    + [ctypes.c_float, _I64, _P, _P, _I64, _INT, _INT],
}
_KERNEL = cpu_build.CKernel("cpu_flash", _SIGNATURES, ctypes.c_int)
MAX_HEAD_DIM = 256  # head dims: multiples of 32 up to this


def available() -> bool:
    """Whether the kernel runs here: AMX tiles granted (``amx_tiles.available``) and built."""
    return amx_tiles.available() and _KERNEL.available()


def handles(head_dim: int, heads: int, kv_heads: int, softcap: float, cache_dtype: torch.dtype) -> bool:
    """Whether a layer of this shape attends here (no soft cap; a cache the decode kernel reads too)."""
    return (
        not softcap
        and head_dim % 32 == 0
        and head_dim <= MAX_HEAD_DIM
        and heads % kv_heads == 0
        and cache_dtype in cpu_decode.KV_FORMS
        and available()
    )


def span_table(spans: Sequence[tuple[int, int, int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end, context length, pages) of each span as the kernel reads them: an int64 [S, 4] table
    (start, end, length, offset of its pages) and every span's pages one after another."""
    offsets, at = [], 0
    for _, _, _, pages in spans:
        offsets.append(at)
        at += pages.numel()
    table = torch.tensor([[a, b, n, o] for (a, b, n, _), o in zip(spans, offsets)], dtype=torch.int64).view(-1, 4)
    pages = torch.cat([p.to(torch.int64) for *_, p in spans]) if spans else torch.empty(0, dtype=torch.int64)
    return table, pages


def attend_spans(
    q: torch.Tensor,  # [T, H, D] float32, rows and heads of unit-stride head dims (a view into qkv)
    k_cache: torch.Tensor,  # [num_pages, page_size, KVH, D] float32, float16 or bfloat16
    v_cache: torch.Tensor,
    table: torch.Tensor,  # ``span_table``'s
    pages: torch.Tensor,
    scale: float,
    window: int,
    sinks: torch.Tensor | None,  # [H] float32
    out: torch.Tensor,  # [T, H, D] float32, same layout rules as q
    num_threads: int | None = None,
) -> None:
    """out[r] = attention of q[r] (row r - start of its span, at position length - (end - start) + that)
    over the cached keys it sees, for every span of a step in one call."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    for name, t in (("q", q), ("out", out)):
        if t.dtype is not torch.float32 or t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be float32 [n, H, D] with whole rows of heads")
    if (
        not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or k_cache.dtype not in cpu_decode.KV_FORMS
        or v_cache.dtype != k_cache.dtype
    ):
        raise ValueError("the caches must be contiguous float32, float16 or bfloat16, both alike")
    if table.dtype is not torch.int64 or pages.dtype is not torch.int64 or not table.is_contiguous():
        raise ValueError("the span table and pages must be int64 (span_table)")
    sink = sinks.float().contiguous() if sinks is not None else None
    rc = _KERNEL.functions()[0](
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        table.data_ptr(),
        pages.data_ptr(),
        table.shape[0],
        k_cache.shape[1],
        heads,
        kv_heads,
        head_dim,
        scale,
        window,
        sink.data_ptr() if sink is not None else None,
        out.data_ptr(),
        out.stride(0),
        max(1, num_threads if num_threads is not None else torch.get_num_threads()),
        cpu_decode.KV_FORMS[k_cache.dtype],
    )
    if rc:
        raise {1: MemoryError("no buffer for the keys' layout"), 3: RuntimeError("no AMX tiles here")}.get(
            rc, ValueError(f"head dim {head_dim} / heads {heads}:{kv_heads} not taken")
        )


def attend(
    q: torch.Tensor,  # [n, H, D] float32: one span's rows
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # [P] pages covering the context
    length: int,  # tokens of context, the n rows' own last
    scale: float,
    window: int,
    sinks: torch.Tensor | None,
    out: torch.Tensor,  # [n, H, D]
    num_threads: int | None = None,
) -> None:
    """``attend_spans`` for one span: out[r] = attention of q[r] (at position length - n + r)."""
    table, flat = span_table([(0, q.shape[0], length, pages)])
    attend_spans(q, k_cache, v_cache, table, flat, scale, window, sinks, out, num_threads)
