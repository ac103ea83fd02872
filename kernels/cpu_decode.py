"""CPU paged decode attention: ``cpu_decode.c`` built on first use and loaded with ctypes.

Built and cached by ``kernels.cpu_build``; ``ctypes.CDLL`` releases the GIL for the
call, so the event loop keeps running while a worker thread computes. Same contract as
``kernels.reference.decode_attention``, on CPU tensors: q float32, the cache float32, float16
or bfloat16 (``--kv-cache-dtype``: half the bytes each step reads, widened as loaded).
"""

from __future__ import annotations

import ctypes

import torch

from trillm.kernels import cpu_build

_ARGTYPES = (
    [ctypes.c_void_p] * 6
    + [ctypes.c_int64] * 7
    + [ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
)
KV_FORMS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the cache's forms, as cpu_common.h numbers them
_SIGNATURES: dict[str, list] = {
    "trillm_decode_attention": _ARGTYPES,
    "trillm_kv_store": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int],
}
_KERNEL = cpu_build.CKernel("cpu_decode", _SIGNATURES, ctypes.c_int, ("-fno-math-errno",))
available = _KERNEL.available


def _library() -> ctypes.CDLL | None:
    """The loaded kernel, built once per process; None (reason logged once) if that failed."""
    return _KERNEL.library()


def _sinks(sinks: torch.Tensor | None, heads: int) -> int | None:
    if sinks is None:
        return None
    if sinks.dtype != torch.float32 or sinks.shape != (heads,) or not (sinks.is_cpu and sinks.is_contiguous()):
        raise ValueError(f"sinks must be contiguous float32 CPU [{heads}]")
    return sinks.data_ptr()


def decode_attention(
    q: torch.Tensor,  # [B, H, D], one new token per sequence
    k_cache: torch.Tensor,  # [num_pages, page_size, KVH, D], contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_pages] int
    context_lens: torch.Tensor,  # [B] int, tokens in the cache including the new one
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    num_threads: int | None = None,
) -> torch.Tensor:
    """Each row attends all ``context_lens[b]`` tokens of its own sequence (CPU; q float32, the cache
    float32, float16 or bfloat16), or
    with ``window`` > 0 only the last ``window`` of them (a sliding-window layer); ``sinks`` [H]
    float32: a logit per query head in each softmax's denominator (gpt-oss); ``softcap`` > 0: each
    score s taken as softcap * tanh(s / softcap) first (Gemma 2)."""
    if any(t.device.type != "cpu" for t in (q, k_cache, v_cache)):
        raise ValueError("cpu_decode.decode_attention takes CPU tensors only")
    if q.dtype != torch.float32 or k_cache.dtype not in KV_FORMS or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"cpu_decode.decode_attention takes float32 q and a float32, float16 or bfloat16 cache, not q {q.dtype}, "
            f"k {k_cache.dtype}, v {v_cache.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous (a copy would cost more than the attention)")
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0: none), not {softcap}")
    B, H, D = q.shape
    num_pages, page_size, kv_heads, d_cache = k_cache.shape
    if v_cache.shape != k_cache.shape or d_cache != D or H % kv_heads != 0:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU decode kernel could not be built; see the trillm.kernels log")
    q = q.contiguous()
    tables = block_tables.to(device="cpu", dtype=torch.int32).contiguous()
    lens = context_lens.to(device="cpu", dtype=torch.int32).contiguous()
    if tables.dim() != 2 or tables.shape[0] != B or lens.shape != (B,):
        raise ValueError(
            f"block_tables {tuple(tables.shape)} / context_lens {tuple(lens.shape)} do not match batch {B}"
        )
    out = torch.empty((B, H, D), dtype=torch.float32)
    threads = num_threads if num_threads is not None else torch.get_num_threads()
    rc = lib.trillm_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        B,
        H,
        kv_heads,
        D,
        num_pages,
        page_size,
        tables.shape[1],
        float(scale),
        max(1, threads),
        int(window),
        _sinks(sinks, H),
        float(softcap),
        KV_FORMS[k_cache.dtype],
    )
    if rc == 1:
        raise ValueError("a context length or page index is out of range for the cache/block table")
    if rc != 0:
        raise MemoryError("the CPU decode kernel could not allocate its score buffers")
    return out


def stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 ``x`` as the C loop stores it in a cache of ``dtype`` (rounded to nearest even;
    float16 saturating at its largest value): what tests hold the Python path's stores to."""
    if x.dtype is not torch.float32 or dtype not in KV_FORMS:
        raise ValueError(f"stores float32 into a {', '.join(map(str, KV_FORMS))} cache, not {x.dtype} into {dtype}")
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU decode kernel could not be built; see the trillm.kernels log")
    src = x.contiguous()
    out = torch.empty(src.shape, dtype=dtype)
    lib.trillm_kv_store(src.data_ptr(), out.data_ptr(), src.numel(), KV_FORMS[dtype])
    return out
