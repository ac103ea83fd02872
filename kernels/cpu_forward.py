"""The layers of a decode-only step in one C call: ``cpu_forward.c``, built on first use.

The C loop calls the same kernels as the Python layer loop of ``CpuBackend`` (the
block matmul, RMSNorm, rotary, SiLU- or GELU-mul and decode attention, sliding windows and
Gemma's output norms included), in the same order on
the same buffers, so the logits are bit for bit the same; what goes is ~10 Python
wrappers per layer, a third of a one-row step. ``ctypes`` releases the GIL for the
whole call. Float32 CPU tensors, block weights, no QKV bias. A mixture of experts whose experts
are a GGUF file's blocks runs here too (router, top k, two grouped calls per token: what
``experts.moe_mlp`` does for one token), within float rounding of the Python loop (the router's
dot products are summed in another order than torch's).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from trillm.kernels import amx_tiles, cpu_build, cpu_decode, cpu_gguf, cpu_matmul, cpu_ops
from trillm.kernels.block_weights import BlockWeight
from trillm.kernels.cpu_forward_structs import (
    MAX_PARTS,
    MAX_TOP_K,
    LayerSpec,
    MixtureSpec,
    Projection,
    _Layer,
    _Mixture,
    _Model,
    _Part,
    _Projection,
)
from trillm.kernels.gguf_blocks import GGUFWeight
from trillm.kernels.stacked import Stacked

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {"trillm_decode_layers": [_P, _P, _I64, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, _INT]}
_KERNEL = cpu_build.CKernel("cpu_forward", _SIGNATURES, ctypes.c_int)
_F32, _I32, _CPU = torch.float32, torch.int32, torch.device("cpu")


def available() -> bool:
    """Whether this loop and the kernels every model's loop calls could be built here (a GGUF
    file's blocks need ``cpu_gguf`` too: ``fusable``)."""
    return all(k.available() for k in (_KERNEL, cpu_ops._KERNEL, cpu_matmul._KERNEL, cpu_decode._KERNEL))


def _address(function: Any) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value or 0


def _float32_of(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether ``t`` is what the C loop reads by address: contiguous float32 on the CPU, of ``shape``."""
    return t.dtype is _F32 and t.is_cpu and t.is_contiguous() and t.shape == shape


def fusable(weight: object) -> bool:
    """Whether the loop runs ``weight``: blocks of either kind, alone or side by side."""
    parts = weight.parts if isinstance(weight, Stacked) else (weight,)
    return len(parts) <= MAX_PARTS and all(
        isinstance(p, BlockWeight) or (isinstance(p, GGUFWeight) and cpu_gguf.available()) for p in parts
    )


class DecodeLayers:
    """One model's layer weights and one KV cache, laid out for the C loop once.

    It keeps a reference to every tensor and struct whose address the C structs hold.
    ``max_rows``: the most rows a step may have here (a GGUF weight's matmul hands larger
    batches to torch's GEMM, which the C loop cannot call). ``activation``: of the gated MLP,
    silu or gelu_tanh; ``rotary_dim``: the rotated part of each head (None: all of it);
    ``softcap`` > 0: the attention scores' soft cap (Gemma 2); ``swiglu``: gpt-oss's (alpha, limit).
    ``tiles``: the projections run on AMX bfloat16 tiles from ``amx_tiles.min_rows`` rows on (where
    ``amx_tiles`` is available; ``--gemm-dtype`` bfloat16), which take any number of rows.
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        kv_cache: Sequence[tuple[torch.Tensor, torch.Tensor]],
        heads: int,
        eps: float,
        scale: float,
        activation: str = "silu",
        rotary_dim: int | None = None,
        softcap: float = 0.0,
        swiglu: tuple[float, float] = (1.702, 7.0),
        tiles: bool = False,
    ) -> None:
        k0 = kv_cache[0][0]
        self.tiles = tiles and amx_tiles.available()
        num_pages, page_size, kv_heads, head_dim = k0.shape
        hidden = layers[0].input_norm.shape[0]
        dense = [la for la in layers if la.moe is None]
        intermediate = dense[0].gate_up.shape[0] // 2 if dense and dense[0].gate_up is not None else 0
        self._structs: list[Any] = []  # every ctypes struct whose address a _Layer holds
        self.max_rows = 1 << 30
        for la in layers:
            norms = [la.input_norm, la.post_norm] + [n for n in (la.attn_out_norm, la.mlp_out_norm) if n is not None]
            if any(t.dtype is not _F32 or not t.is_cpu or not t.is_contiguous() for t in norms):
                raise ValueError("norm weights must be contiguous float32 CPU tensors")
            mlp = (la.gate_up, la.down) if la.moe is None else ()
            if not all(w is not None and fusable(w) for w in (la.qkv, la.o, *mlp)):
                raise ValueError("the C loop runs block weights only (repacked or a GGUF file's, up to 4 side by side)")
            shapes = [w.shape for w in (la.qkv, la.o, *mlp) if w is not None]
            expected = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim)]
            if la.moe is None:
                expected += [(2 * intermediate, hidden), (hidden, intermediate)]
            else:
                self._check_mixture(la.moe, hidden)
            if shapes != expected or any(n.shape != (hidden,) for n in norms):
                raise ValueError(f"layer shapes {shapes} do not match {expected}")
            for head_norm in (la.q_norm, la.k_norm):
                if head_norm is not None and not _float32_of(head_norm, (head_dim,)):
                    raise ValueError(f"Q/K norms must be contiguous float32 CPU [{head_dim}]")
            if la.window < 0:
                raise ValueError(f"a window of {la.window} tokens")
            vectors = {
                "qkv_bias": (la.qkv_bias, ((heads + 2 * kv_heads) * head_dim,)),
                "sinks": (la.sinks, (heads,)),
                "o_bias": (la.o_bias, (hidden,)),
            }
            for what, (t, shape) in vectors.items():
                if t is not None and not _float32_of(t, shape):
                    raise ValueError(f"{what} must be contiguous float32 CPU {list(shape)}")
        if k0.dtype not in cpu_decode.KV_FORMS:
            raise ValueError(f"the KV cache must be float32, float16 or bfloat16, not {k0.dtype}")
        for k, v in kv_cache:
            if any(t.shape != k0.shape or t.dtype != k0.dtype or not t.is_cpu or not t.is_contiguous() for t in (k, v)):
                raise ValueError("the KV cache must be contiguous CPU tensors of one shape and dtype")
        if len(kv_cache) != len(layers):
            raise ValueError(f"{len(layers)} layers but {len(kv_cache)} caches")
        if activation not in ("silu", "gelu_tanh", "swiglu_oai"):
            raise ValueError(f"no C kernel for the activation {activation!r}")
        rms_norm, rotary, silu_mul, _, gelu_tanh_mul, *_ = cpu_ops._functions()
        decode = cpu_decode._KERNEL.functions()[0]  # trillm_decode_attention
        self.model = _Model(
            _address(rms_norm),
            _address(rotary),
            _address(gelu_tanh_mul if activation == "gelu_tanh" else silu_mul),
            _address(decode),
            hidden,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            num_pages,
            page_size,
            rotary_dim or head_dim,
            eps,
            scale,
            softcap,
            _address(cpu_gguf._KERNEL.functions()[5]) if cpu_gguf.available() else None,
            int(activation == "swiglu_oai"),
            swiglu[0],
            swiglu[1],
            cpu_decode.KV_FORMS[k0.dtype],
        )

        def address(t: torch.Tensor | None) -> int | None:
            return t.data_ptr() if t is not None else None

        self.layers = (_Layer * len(layers))(
            *(
                _Layer(
                    la.input_norm.data_ptr(),
                    la.post_norm.data_ptr(),
                    address(la.q_norm),
                    address(la.k_norm),
                    address(la.attn_out_norm),
                    address(la.mlp_out_norm),
                    *(self._projection(w) for w in (la.qkv, la.o, la.gate_up, la.down)),
                    k.data_ptr(),
                    v.data_ptr(),
                    la.window,
                    int(la.local_rope),
                    self._mixture(la.moe),
                    address(la.qkv_bias),
                    address(la.sinks),
                    address(la.o_bias),
                )
                for la, (k, v) in zip(layers, kv_cache)
            )
        )
        self._keep = (list(layers), list(kv_cache))
        self.hidden, self.rotary_dim = hidden, rotary_dim or head_dim
        q_size, qkv_size = heads * head_dim, (heads + 2 * kv_heads) * head_dim
        self._work_per_row = 2 * hidden + qkv_size + 2 * q_size + 3 * intermediate

    @staticmethod
    def _check_mixture(moe: MixtureSpec, hidden: int) -> None:
        experts = len(moe.gate)
        inter = moe.gate[0].shape[0]
        if not (1 <= moe.top_k <= min(MAX_TOP_K, experts)) or not (len(moe.up) == len(moe.down) == experts):
            raise ValueError(f"a mixture of {experts} experts, {moe.top_k} a token: the C loop takes up to {MAX_TOP_K}")
        biases = (
            (moe.router, (hidden, experts)),
            (moe.router_bias, (experts,)),
            (moe.gate_up_bias, (experts, 2 * inter)),
            (moe.down_bias, (experts, hidden)),
        )
        for t, shape in biases:
            if t is not None and not _float32_of(t, shape):
                raise ValueError(f"a mixture's router and biases must be contiguous float32 {list(shape)}")
        shared = (moe.shared_gate_up, moe.shared_down, moe.shared_gate)
        if any(s is not None for s in shared):
            gu, down, gate = shared
            if gu is None or down is None or gate is None or not (fusable(gu) and fusable(down)):
                raise ValueError("a shared expert runs here in block weights, with its gate")
            s_inter = down.shape[1]
            if gu.shape != (2 * s_inter, hidden) or down.shape != (hidden, s_inter):
                raise ValueError(f"shared expert shapes {gu.shape}, {down.shape} do not match {hidden}")
            if not _float32_of(gate, (hidden, 1)):
                raise ValueError(f"the shared expert's gate must be contiguous float32 [{hidden}, 1]")
        if not (
            cpu_gguf.groupable([*moe.gate, *moe.up], 1)
            and cpu_gguf.groupable(list(moe.down), 1)
            and moe.gate[0].shape == (inter, hidden)
            and moe.down[0].shape == (hidden, inter)
            and moe.down[0].activation_bits == moe.gate[0].activation_bits
        ):
            raise ValueError("the C loop runs a mixture whose experts are GGUF blocks of one type and shape")

    def _mixture(self, moe: MixtureSpec | None) -> int | None:
        """The address of a _Mixture (its pointer arrays kept alive in ``_structs``), or None."""
        if moe is None:
            return None
        arrays = [(ctypes.c_void_p * len(ws))(*(w.data.data_ptr() for w in ws)) for ws in (moe.gate, moe.up, moe.down)]
        first, down = moe.gate[0], moe.down[0]
        # the experts' grouped calls take their integer path's rows at most (with the other weights on
        # AMX tiles, nothing else would bound a step's rows)
        self.max_rows = min(self.max_rows, cpu_gguf.max_fused_rows(first), cpu_gguf.max_fused_rows(down))
        mixture = _Mixture(
            moe.router.data_ptr(),
            len(moe.gate),
            moe.top_k,
            int(moe.normalize),
            first.shape[0],
            first.kind.id,
            first.data.stride(0),
            down.kind.id,
            down.data.stride(0),
            cpu_gguf.activation_flags(first),
            *(ctypes.addressof(a) for a in arrays),
            *(t.data_ptr() if t is not None else None for t in (moe.router_bias, moe.gate_up_bias, moe.down_bias)),
            self._projection(moe.shared_gate_up),
            self._projection(moe.shared_down),
            moe.shared_gate.data_ptr() if moe.shared_gate is not None else None,
            moe.shared_down.shape[1] if moe.shared_down is not None else 0,
        )
        self._structs += [*arrays, mixture]
        return ctypes.addressof(mixture)

    def _projection(self, weight: Projection | None) -> int | None:
        """The address of a _Projection of ``weight``'s parts (kept alive in ``_structs``); None
        for a mixture's layer (no gate_up / down)."""
        if weight is None:
            return None
        parts = weight.parts if isinstance(weight, Stacked) else (weight,)
        projection = _Projection(len(parts))
        col0 = 0
        for i, part in enumerate(parts):
            if self.tiles and amx_tiles.handles(part):
                amx = amx_tiles.layout(part, amx_tiles.min_rows(part))
                self._structs.append(amx)
                projection.part[i] = _Part(amx_tiles.layout_matmul_address(), amx.address, col0)
            elif isinstance(part, GGUFWeight):
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
        rope: Any,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        num_threads: int,
        kernel_rows: int | None = None,
    ) -> torch.Tensor:
        """Every layer on h [M, hidden] (updated in place and returned): M sequences decoding
        one token each, at KV slots ``slots`` [M] (int64), rotated by ``rope.whole`` (cos, sin)
        [M, head_dim] each (a layer with local_rope by ``rope.local``), attending ``context_lens``
        [M] tokens (int32) through ``block_tables`` [M, pages] (int32). ``kernel_rows``: the
        projections choose their kernels as for that many rows (a step's sequences, whose rows
        include proposed tokens: each row then computed as its sequence's plain step computes it)."""
        (cos, sin), (local_cos, local_sin) = rope.whole, rope.local
        M = h.shape[0]
        if h.dtype is not _F32 or not h.is_contiguous() or h.shape != (M, self.hidden):
            raise ValueError(f"h must be contiguous float32 [M, {self.hidden}], got {tuple(h.shape)}")
        tables = (cos, sin, local_cos, local_sin)
        if any(t.shape != (M, self.rotary_dim) or t.dtype is not _F32 or not t.is_contiguous() for t in tables):
            raise ValueError("cos and sin must be contiguous float32 [M, rotary_dim]")
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
            local_cos.data_ptr(),
            local_sin.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            block_tables.shape[1],
            work.data_ptr(),
            kernel_rows or 0,
            max(1, num_threads),
        )
        if rc == 1:
            raise ValueError("a KV slot, context length or page index is out of range for the cache")
        if rc == 3:
            raise ValueError("a mixture's experts could not run as grouped calls")
        if rc != 0:
            raise MemoryError("a CPU kernel could not allocate its buffers")
        return h
