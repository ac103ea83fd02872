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
from typing import Any

import torch

from trillm.kernels import cpu_build, cpu_decode, cpu_matmul, cpu_ops
from trillm.kernels.block_weights import BlockWeight

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {"trillm_decode_layers": [_P, _P, _I64, _P, _I64, _P, _P, _P, _P, _P, _I64, _P, _INT]}
_KERNEL = cpu_build.CKernel("cpu_forward", _SIGNATURES, ctypes.c_int)
_F32, _I32, _CPU = torch.float32, torch.int32, torch.device("cpu")


class _Model(ctypes.Structure):
    _fields_ = (
        [(name, _P) for name in ("matmul", "rms_norm", "rotary", "silu_mul", "decode")]
        + [
            (name, _I64)
            for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "num_pages", "page_size")
        ]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
    )


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "k_cache", "v_cache")]


def available() -> bool:
    """Whether this loop and every kernel it calls could be built here."""
    return all(k.available() for k in (_KERNEL, cpu_ops._KERNEL, cpu_matmul._KERNEL, cpu_decode._KERNEL))


def _address(function: Any) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value or 0


class DecodeLayers:
    """One model's layer weights and one KV cache, laid out for the C loop once.

    ``layers`` holds, per layer: input norm, QKV, O, post norm, gate-up, down. It keeps
    a reference to every tensor whose address the C structs hold.
    """

    def __init__(
        self,
        layers: Sequence[tuple[torch.Tensor, BlockWeight, BlockWeight, torch.Tensor, BlockWeight, BlockWeight]],
        kv_cache: Sequence[tuple[torch.Tensor, torch.Tensor]],
        heads: int,
        eps: float,
        scale: float,
    ) -> None:
        k0 = kv_cache[0][0]
        num_pages, page_size, kv_heads, head_dim = k0.shape
        hidden = layers[0][0].shape[0]
        intermediate = cpu_matmul._layout(layers[0][4])[0] // 2
        for norm, qkv, o, post, gate_up, down in layers:
            if any(t.dtype is not _F32 or not t.is_cpu or not t.is_contiguous() for t in (norm, post)):
                raise ValueError("norm weights must be contiguous float32 CPU tensors")
            shapes = [cpu_matmul._layout(w)[:2] for w in (qkv, o, gate_up, down)]
            expected = [
                ((heads + 2 * kv_heads) * head_dim, hidden),
                (hidden, heads * head_dim),
                (2 * intermediate, hidden),
                (hidden, intermediate),
            ]
            if shapes != expected or norm.shape != (hidden,) or post.shape != (hidden,):
                raise ValueError(f"layer shapes {shapes} do not match {expected}")
        for k, v in kv_cache:
            if any(t.shape != k0.shape or t.dtype is not _F32 or not t.is_cpu or not t.is_contiguous() for t in (k, v)):
                raise ValueError("the KV cache must be contiguous float32 CPU tensors of one shape")
        if len(kv_cache) != len(layers):
            raise ValueError(f"{len(layers)} layers but {len(kv_cache)} caches")
        matmul = cpu_matmul._functions()[0]
        rms_norm, rotary, silu_mul = cpu_ops._functions()[:3]
        (decode,) = cpu_decode._KERNEL.functions()
        self.model = _Model(
            _address(matmul),
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
                    *(cpu_matmul._layout(w)[2] for w in (qkv, o, gate_up, down)),
                    k.data_ptr(),
                    v.data_ptr(),
                )
                for (norm, qkv, o, post, gate_up, down), (k, v) in zip(layers, kv_cache)
            )
        )
        self._keep = (list(layers), list(kv_cache))
        self.hidden, self.head_dim = hidden, head_dim
        q_size, qkv_size = heads * head_dim, (heads + 2 * kv_heads) * head_dim
        self._work_per_row = hidden + qkv_size + 2 * q_size + 3 * intermediate

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
