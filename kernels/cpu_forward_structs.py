"""What ``cpu_forward.c``'s layer loop reads, declared for ctypes, and the specs Python fills them from.

Each ``_Name`` structure mirrors ``Name`` in the C file field for field (a change to one is a
change to the other); ``LayerSpec`` and ``MixtureSpec`` are a layer's weights as the backend hands
them to ``cpu_forward.DecodeLayers``, which lays them out in these structures once.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, ClassVar, TypeAlias

import attrs
import torch

from trillm.kernels.block_weights import BlockWeight
from trillm.kernels.gguf_blocks import GGUFWeight
from trillm.kernels.stacked import Stacked

_P, _I64 = ctypes.c_void_p, ctypes.c_int64

MAX_PARTS = 4  # cpu_forward.c's: parts of one projection side by side

# A projection the loop runs: repacked blocks, a GGUF file's blocks, or several of these side by side.
Projection: TypeAlias = BlockWeight | GGUFWeight | Stacked


class _Model(ctypes.Structure):
    _fields_: ClassVar[Any] = (
        [(name, _P) for name in ("rms_norm", "rotary", "gated_mul", "decode")]
        + [
            (name, _I64)
            for name in (
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "intermediate",
                "num_pages",
                "page_size",
                "rotary_dim",
            )
        ]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("grouped", _P)]
        + [("swiglu_oai", _I64), ("alpha", ctypes.c_float), ("limit", ctypes.c_float), ("kv", _I64)]
    )


class _Mixture(ctypes.Structure):
    _fields_ = (
        [("router", _P)]
        + [
            (name, _I64)
            for name in (
                "experts",
                "top_k",
                "normalize",
                "inter",
                "gate_up_type",
                "gate_up_row_bytes",
                "down_type",
                "down_row_bytes",
                "flags",
            )
        ]
        + [("gate", _P), ("up", _P), ("down", _P), ("router_bias", _P), ("gate_up_bias", _P), ("down_bias", _P)]
        + [("shared_gate_up", _P), ("shared_down", _P), ("shared_gate", _P), ("shared_inter", _I64)]
    )


class _Part(ctypes.Structure):
    _fields_ = [("matmul", _P), ("layout", _P), ("col0", _I64)]


class _Projection(ctypes.Structure):
    _fields_ = [("count", _I64), ("part", _Part * MAX_PARTS)]


class _Layer(ctypes.Structure):
    _fields_: ClassVar[Any] = [
        (name, _P)
        for name in (
            "input_norm",
            "post_norm",
            "q_norm",
            "k_norm",
            "attn_out_norm",
            "mlp_out_norm",
            "qkv",
            "o",
            "gate_up",
            "down",
            "k_cache",
            "v_cache",
        )
    ] + [("window", _I64), ("local_rope", _I64), ("moe", _P), ("qkv_bias", _P), ("sinks", _P), ("o_bias", _P)]


MAX_TOP_K = 16  # cpu_forward.c's


@attrs.frozen
class MixtureSpec:
    """A mixture of experts as the loop runs it: a float32 router [hidden, experts] and each
    expert's gate, up and down in a GGUF file's blocks (``cpu_gguf.matmul_grouped`` runs them)."""

    router: torch.Tensor
    top_k: int
    normalize: bool
    gate: Sequence[GGUFWeight]
    up: Sequence[GGUFWeight]
    down: Sequence[GGUFWeight]
    router_bias: torch.Tensor | None = None  # gpt-oss: [experts], [experts, 2 inter], [experts, hidden]
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    shared_gate_up: Projection | None = None  # Qwen2-MoE's shared expert, and its gate [hidden, 1]
    shared_down: Projection | None = None
    shared_gate: torch.Tensor | None = None


@attrs.frozen
class LayerSpec:
    """One decoder layer as the loop runs it: its weights, and how it attends and rotates."""

    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection | None  # None where ``moe`` takes the MLP's place
    down: Projection | None
    q_norm: torch.Tensor | None = None  # Qwen3, Gemma 3: per-head norms
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma: norms of each block's output
    mlp_out_norm: torch.Tensor | None = None
    window: int = 0  # > 0: attends its last ``window`` tokens
    local_rope: bool = False  # rotates by the local tables (Gemma 3's windowed layers)
    moe: MixtureSpec | None = None  # a mixture of experts in place of gate_up / down
    qkv_bias: torch.Tensor | None = None  # Qwen2, gpt-oss
    sinks: torch.Tensor | None = None  # gpt-oss: [heads]
    o_bias: torch.Tensor | None = None  # gpt-oss: [hidden]
