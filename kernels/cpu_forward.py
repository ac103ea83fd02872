"""The layers of a decode-only step in one C call: ``cpu_forward.c``, built on first use.

The C loop calls the same kernels as the Python layer loop of ``CpuBackend`` (the
block matmul, RMSNorm, rotary, SiLU-mul and decode attention), in the same order on
the same buffers, so the logits are bit for bit the same; what goes is ~10 Python
wrappers per layer, a third of a one-row step. ``ctypes`` releases the GIL for the
whole call. Float32 CPU tensors, block weights, no QKV bias.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, TypeAlias

import torch

from trillm.kernels import cpu_build, cpu_decode, cpu_gguf, cpu_matmul, cpu_ops
from trillm.kernels.block_weights import BlockWeight
from trillm.kernels.gguf_blocks import GGUFWeight
from trillm.kernels.stacked import Stacked

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {"trillm_decode_layers": [_P, _P, _I64, _P, _I64, _P, _P, _P, _P, _P, _I64, _P, _INT]}
_KERNEL = cpu_build.CKernel("cpu_forward", _SIGNATURES, ctypes.c_int)
_F32, _I32, _CPU = torch.float32, torch.int32, torch.device("cpu")
MAX_PARTS = 4  # cpu_forward.c's: parts of one projection side by side

# A projection the loop runs: repacked blocks, a GGUF file's blocks, or several of these side by side.
Projection: TypeAlias = BlockWeight | GGUFWeight | Stacked


class _Model(ctypes.Structure):
    _fields_ = (
        [(name, _P) for name in ("rms_norm", "rotary", "silu_mul", "decode")]
        + [
            (name, _I64)
            for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "num_pages", "page_size")
        ]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
    )


class _Part(ctypes.Structure):
    _fields_ = [("matmul", _P), ("layout", _P), ("col0", _I64)]


class _Projection(ctypes.Structure):
    _fields_ = [("count", _I64), ("part", _Part * MAX_PARTS)]


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, _P)
        for name in (
            "input_norm",
            "post_norm",
            "q_norm",
            "k_norm",
            "qkv",
            "o",
            "gate_up",
            "down",
            "k_cache",
            "v_cache",
        )
    ]


def available() -> bool:
    """Whether this loop and the kernels every model's loop calls could be built here (a GGUF
    file's blocks need ``cpu_gguf`` too: ``fusable``)."""
    return all(k.available() for k in (_KERNEL, cpu_ops._KERNEL, cpu_matmul._KERNEL, cpu_decode._KERNEL))


def _address(function: Any) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value or 0


def fusable(weight: object) -> bool:
    """Whether the loop runs ``weight``: blocks of either kind, alone or side by side."""
    parts = weight.parts if isinstance(weight, Stacked) else (weight,)
    return len(parts) <= MAX_PARTS and all(
        isinstance(p, BlockWeight) or (isinstance(p, GGUFWeight) and cpu_gguf.available()) for p in parts
    )


class DecodeLayers:
    """One model's layer weights and one KV cache, laid out for the C loop once.

    ``layers`` holds, per layer: input norm, QKV, O, post norm, gate-up, down, and Qwen3's Q and K
    head norms (or None). It keeps a reference to every tensor and struct whose address the C
    structs hold. ``max_rows``: the most rows a step may have here (a GGUF weight's matmul hands
    larger batches to torch's GEMM, which the C loop cannot call).
    """

    def __init__(
        self,
        layers: Sequence[tuple[Any, ...]],
        kv_cache: Sequence[tuple[torch.Tensor, torch.Tensor]],
        heads: int,
        eps: float,
        scale: float,
    ) -> None:
        k0 = kv_cache[0][0]
        num_pages, page_size, kv_heads, head_dim = k0.shape
        hidden = layers[0][0].shape[0]
        intermediate = layers[0][4].shape[0] // 2
        self._structs: list[Any] = []  # every ctypes struct whose address a _Layer holds
        self.max_rows = 1 << 30
        for norm, qkv, o, post, gate_up, down, q_norm, k_norm in layers:
            if any(t.dtype is not _F32 or not t.is_cpu or not t.is_contiguous() for t in (norm, post)):
                raise ValueError("norm weights must be contiguous float32 CPU tensors")
            if not all(fusable(w) for w in (qkv, o, gate_up, down)):
                raise ValueError("the C loop runs block weights only (repacked or a GGUF file's, up to 4 side by side)")
            shapes = [w.shape for w in (qkv, o, gate_up, down)]
            expected = [
                ((heads + 2 * kv_heads) * head_dim, hidden),
                (hidden, heads * head_dim),
                (2 * intermediate, hidden),
                (hidden, intermediate),
            ]
            if shapes != expected or norm.shape != (hidden,) or post.shape != (hidden,):
                raise ValueError(f"layer shapes {shapes} do not match {expected}")
            for head_norm in (q_norm, k_norm):
                if head_norm is not None and (
                    head_norm.dtype is not _F32
                    or head_norm.shape != (head_dim,)
                    or not (head_norm.is_cpu and head_norm.is_contiguous())
                ):
                    raise ValueError(f"Q/K norms must be contiguous float32 CPU [{head_dim}]")
        for k, v in kv_cache:
            if any(t.shape != k0.shape or t.dtype is not _F32 or not t.is_cpu or not t.is_contiguous() for t in (k, v)):
                raise ValueError("the KV cache must be contiguous float32 CPU tensors of one shape")
        if len(kv_cache) != len(layers):
            raise ValueError(f"{len(layers)} layers but {len(kv_cache)} caches")
        rms_norm, rotary, silu_mul = cpu_ops._functions()[:3]
        (decode,) = cpu_decode._KERNEL.functions()
        self.model = _Model(
            _address(rms_norm),
            _address(rotary),
            _address(silu_mul),
            _address(decode),
            hidden,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            num_pages,
            page_size,
            eps,
            scale,
        )
        self.layers = (_Layer * len(layers))(
            *(
                _Layer(
                    norm.data_ptr(),
                    post.data_ptr(),
                    q_norm.data_ptr() if q_norm is not None else None,
                    k_norm.data_ptr() if k_norm is not None else None,
                    *(self._projection(w) for w in (qkv, o, gate_up, down)),
                    k.data_ptr(),
                    v.data_ptr(),
                )
                for (norm, qkv, o, post, gate_up, down, q_norm, k_norm), (k, v) in zip(layers, kv_cache)
            )
        )
        self._keep = (list(layers), list(kv_cache))
        self.hidden, self.head_dim = hidden, head_dim
        q_size, qkv_size = heads * head_dim, (heads + 2 * kv_heads) * head_dim
        self._work_per_row = hidden + qkv_size + 2 * q_size + 3 * intermediate

    def _projection(self, weight: Projection) -> int:
        """The address of a _Projection of ``weight``'s parts (kept alive in ``_structs``)."""
        parts = weight.parts if isinstance(weight, Stacked) else (weight,)
        projection = _Projection(len(parts))
        col0 = 0
        for i, part in enumerate(parts):
            if isinstance(part, GGUFWeight):
                layout: Any = cpu_gguf.layout(part)
                self._structs.append(layout)
                projection.part[i] = _Part(cpu_gguf.layout_matmul_address(), ctypes.addressof(layout), col0)
                self.max_rows = min(self.max_rows, cpu_gguf.max_fused_rows(part))
            else:
                projection.part[i] = _Part(_address(cpu_matmul._functions()[0]), cpu_matmul._layout(part)[2], col0)
            col0 += part.shape[0]
        self._structs.append(projection)
        return ctypes.addressof(projection)

    def run(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        num_threads: int,
    ) -> torch.Tensor:
        """Every layer on h [M, hidden] (updated in place and returned): M sequences decoding
        one token each, at KV slots ``slots`` [M] (int64), rotated by cos/sin [M, head_dim],
        attending ``context_lens`` [M] tokens (int32) through ``block_tables`` [M, pages] (int32)."""
        M = h.shape[0]
        if h.dtype is not _F32 or not h.is_contiguous() or h.shape != (M, self.hidden):
            raise ValueError(f"h must be contiguous float32 [M, {self.hidden}], got {tuple(h.shape)}")
        if (
            cos.shape != (M, self.head_dim)
            or sin.shape != (M, self.head_dim)
            or not (cos.is_contiguous() and sin.is_contiguous())
        ):
            raise ValueError("cos and sin must be contiguous [M, head_dim]")
        if slots.dtype is not torch.int64 or slots.shape != (M,) or not slots.is_contiguous():
            raise ValueError("slots must be contiguous int64 [M]")
        if (
            block_tables.dtype is not _I32
            or context_lens.dtype is not _I32
            or block_tables.dim() != 2
            or block_tables.shape[0] != M
            or context_lens.shape != (M,)
            or not (block_tables.is_contiguous() and context_lens.is_contiguous())
        ):
            raise ValueError("block_tables [M, pages] and context_lens [M] must be contiguous int32")
        if M > self.max_rows:  # a GGUF weight's matmul multiplies panels in torch from there on
            raise ValueError(f"{M} rows: the C loop takes at most {self.max_rows} with these weights")
        if M == 0:
            return h
        work = torch.empty(M * self._work_per_row, dtype=_F32, device=_CPU)
        rc = _KERNEL.functions()[0](
            ctypes.addressof(self.model),
            ctypes.addressof(self.layers),
            len(self.layers),
            h.data_ptr(),
            M,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            block_tables.shape[1],
            work.data_ptr(),
            max(1, num_threads),
        )
        if rc == 1:
            raise ValueError("a KV slot, context length or page index is out of range for the cache")
        if rc != 0:
            raise MemoryError("a CPU kernel could not allocate its buffers")
        return h
