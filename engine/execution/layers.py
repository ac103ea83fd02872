"""The math every backend shares: decoder-layer weights, projections and RMSNorm.

A projection is dense and transposed, [in, out]; exact GGUF blocks, [out, in]
(``kernels/block_weights.py``); a GGUF file's own blocks, [out, in] (``kernels/gguf_blocks.py``);
or several of these side by side (``Stacked``: Q, K and V of different block types).
``project`` runs each, so the model and each backend's layer loop never ask which.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeAlias

import attrs
import torch
import torch.nn.functional as F

from trillm.kernels import cpu_gguf, cpu_matmul
from trillm.kernels.block_weights import BlockWeight, Q4_1Weight, Q8_0Weight, pack_exact
from trillm.kernels.block_weights import dequantize as dequantize_blocks
from trillm.kernels.gguf_blocks import BLOCK_TYPES, GGUFWeight
from trillm.kernels.stacked import Stacked, nbytes, out_features

# A projection: dense and transposed, [in, out]; blocks, [out, in]; or several side by side.
Weight: TypeAlias = torch.Tensor | BlockWeight | GGUFWeight | Stacked
# Sums a row-parallel projection's partial outputs over the ranks, in place.
Reduce: TypeAlias = Callable[[torch.Tensor], torch.Tensor]
# An RMSNorm over the last dimension: (x, weight, eps) -> normed x of x's shape.
Norm: TypeAlias = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


@attrs.define
class MoEWeights:
    """A mixture-of-experts MLP: the router, and each expert's fused gate/up and down projections."""

    router: torch.Tensor  # [hidden, experts], dense and transposed (routing is where rounding shows)
    gate_up: list[Weight]  # per expert: hidden -> 2 * expert intermediate
    down: list[Weight]  # per expert: expert intermediate -> hidden
    top_k: int
    normalize: bool  # the top-k weights renormalised to sum to 1
    # gpt-oss: the router's bias, and each expert's projections' ([E, 2 I] and [E, hidden], stacked
    # once at load: a step picks its experts' rows)
    router_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    # Dense experts stacked, [E, in, out]: the lists above are views of these (one copy), and the
    # kernel sets multiply every expert's tokens in one launch from them.
    gate_up_stack: torch.Tensor | None = None
    down_stack: torch.Tensor | None = None
    # A GGUF file's experts, all of one type: one token's run as two grouped C calls (``experts.py``)
    grouped_blocks: bool = False
    # Qwen2-MoE: the shared expert every token runs, and its gate ([hidden, 1], dense, transposed)
    shared_gate_up: Weight | None = None
    shared_down: Weight | None = None
    shared_gate: torch.Tensor | None = None

    def _shared(self) -> list[Weight]:
        return [self.shared_gate_up, self.shared_down] if self.shared_gate_up is not None else []  # type: ignore[list-item]

    def projections(self) -> list[Weight]:
        return [*self.gate_up, *self.down, *self._shared()]

    def active_bytes(self) -> int:
        """What one token reads: the router, ``top_k`` average experts and the shared one."""
        experts = sum(nbytes(w) for w in [*self.gate_up, *self.down])
        shared = sum(nbytes(w) for w in self._shared())
        if self.shared_gate is not None:
            shared += self.shared_gate.numel() * self.shared_gate.element_size()
        routed = experts * self.top_k // len(self.gate_up)
        return self.router.numel() * self.router.element_size() + routed + shared


@attrs.define
class LayerWeights:
    """One decoder layer."""

    input_norm: torch.Tensor
    qkv: Weight  # hidden -> (H + 2 KVH) * D
    qkv_bias: torch.Tensor | None
    o_proj: Weight
    post_norm: torch.Tensor
    gate_up: Weight | None  # hidden -> 2 * intermediate; None in a mixture-of-experts layer
    down: Weight | None
    # Qwen3, Gemma 3: RMSNorm of each Q and K head ([head_dim] weights) after the projection, before RoPE.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # Gemma 2/3: RMSNorm of the attention output and of the MLP output, before each residual add.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    moe: MoEWeights | None = None  # the MLP as a mixture of experts (gate_up and down are None; ``experts.py``)
    sinks: torch.Tensor | None = None  # gpt-oss: [heads] float32, a logit in each softmax's denominator
    o_bias: torch.Tensor | None = None  # gpt-oss: o_proj's bias, added once after the all-reduce

    def projections(self) -> list[Weight]:
        """Every matrix of the layer, the experts' included."""
        mlp = self.moe.projections() if self.moe is not None else [self.gate_up, self.down]
        return [w for w in (self.qkv, self.o_proj, *mlp) if w is not None]

    def active_bytes(self) -> int:
        """What one token's decode step reads of the layer's matrices (of a mixture, ``top_k`` experts)."""
        if self.moe is None:
            return sum(nbytes(w) for w in self.projections())
        return nbytes(self.qkv) + nbytes(self.o_proj) + self.moe.active_bytes()


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> contiguous [in, out]: on CPUs ``x @ w_t`` beats ``F.linear(x, w)``
    for small batches (measured 1.2-2x on the decode shapes of SmolLM2)."""
    return weight.t().contiguous()


HALF_KINDS = {torch.bfloat16: "BF16", torch.float16: "F16"}


def half_rows(weight: torch.Tensor) -> GGUFWeight:
    """A bfloat16 or float16 matrix [out, in] as a GGUF file's BF16 / F16 rows: served in float32 by
    ``cpu_gguf`` (2 bytes a weight for decode, in the fused loop) and ``bf16_panels`` (AMX prefill)."""
    N, K = weight.shape
    data = weight.contiguous().view(torch.uint8).view(N, 2 * K)
    return GGUFWeight(BLOCK_TYPES[HALF_KINDS[weight.dtype]], data, K)


_HALF_KEPT = re.compile(
    r"model\.(embed_tokens|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj))\.weight|lm_head\.weight"
)


def kept_half(name: str, tensor: Any) -> bool:
    """Whether ``name`` is a bfloat16 / float16 matrix a float32 CPU model keeps as it is (``half_rows``):
    the embedding, the LM head and the dense layers' projections (not routers, experts or norms)."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.dtype in HALF_KINDS
        and tensor.dim() == 2
        and _HALF_KEPT.fullmatch(name) is not None
        and cpu_gguf.available()  # what runs them
    )


def make_weight(weight: torch.Tensor, blocks: bool) -> Weight:
    """``weight`` [out, in] in exact blocks when asked and possible, else (a bfloat16 or float16
    checkpoint's, with blocks asked) its 2-byte rows as they are, else transposed.

    Blocks hold the same values in 6 (Q4_1) or 9 (Q8_0) bits instead of 32 (float32
    scales included), so a decode step, which reads every weight once, moves 3.5-5.3x
    fewer bytes; 2-byte rows move 2x fewer than float32, as bfloat16 does, and keep the C loop.
    """
    half = weight.dtype in HALF_KINDS
    packed = pack_exact(weight.float() if half else weight) if blocks else None
    if packed is not None:
        return packed
    if half and blocks and cpu_gguf.available():
        return half_rows(weight)
    return transposed(weight.float() if half else weight)  # half only where a float32 model kept it


def weight_bytes(w: Weight) -> int:
    """What one pass over ``w`` reads."""
    return nbytes(w)


def fuse(parts: list[torch.Tensor | Weight], blocks: bool) -> Weight:
    """Matrices [out_i, in] as one projection of their stacked outputs. Dense ones are
    concatenated and made a weight (``make_weight``); repacked blocks are joined row-wise where
    they share a layout; a GGUF file's blocks are kept side by side (``Stacked``), never copied:
    a copy would be resident beside the mapped pages it was read from (measured: 1.85 GB for a
    689 MB file)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return make_weight(torch.cat(parts), blocks)  # type: ignore[arg-type]
    first = parts[0]
    if len(parts) == 1:
        return first  # as it is: a file's blocks stay mapped, not copied
    if all(isinstance(p, Q4_1Weight) for p in parts):
        return Q4_1Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "d", "m")))
    if all(isinstance(p, Q8_0Weight) for p in parts):
        return Q8_0Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "d")))
    return Stacked(tuple(make_weight(p, False) if isinstance(p, torch.Tensor) else p for p in parts))


def embed_rows(table: torch.Tensor | Weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of an embedding table, dense or in blocks (only those rows decoded)."""
    if isinstance(table, torch.Tensor):
        return table[ids]
    if isinstance(table, GGUFWeight):
        return cpu_gguf.embedding(table, ids)
    if isinstance(table, Q4_1Weight):
        return dequantize_blocks(Q4_1Weight(table.qs[ids], table.d[ids], table.m[ids]))
    if isinstance(table, Q8_0Weight):
        return dequantize_blocks(Q8_0Weight(table.qs[ids], table.d[ids]))
    raise TypeError(f"an embedding cannot be a {type(table).__name__}")


def project(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W (+ bias)`` for every form of ``W``."""
    if isinstance(w, torch.Tensor):
        return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)
    if isinstance(w, Stacked):
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        start = 0
        for part in w.parts:
            stop = start + out_features(part)
            _project_into(x, part, out[:, start:stop])
            start = stop
    else:
        out = cpu_gguf.matmul(x, w) if isinstance(w, GGUFWeight) else cpu_matmul.matmul(x, w)
    return out if bias is None else out.add_(bias)


def _project_into(x: torch.Tensor, w: Weight, out: torch.Tensor) -> None:
    """``out[:] = x @ W``, ``out`` a column slice of a wider output."""
    if isinstance(w, GGUFWeight):
        cpu_gguf.matmul(x, w, out=out)
    elif isinstance(w, (Q4_1Weight, Q8_0Weight)):
        cpu_matmul.matmul(x, w, out=out)
    else:
        out.copy_(project(x, w))


def project_add(h: torch.Tensor, x: torch.Tensor, w: Weight, reduce: Reduce | None = None) -> torch.Tensor:
    """``h + x @ W``: the residual add rides on the GEMM (in place into ``h`` for blocks).

    ``reduce``: ``W`` is row-parallel (``parallel/``): ``x @ W`` is this rank's partial sum,
    reduced over the ranks before the residual is added (once, not once per rank)."""
    if reduce is not None:
        return h.add_(reduce(project(x, w)))
    if isinstance(w, torch.Tensor):
        return torch.addmm(h, x, w)
    if isinstance(w, GGUFWeight):
        return cpu_gguf.matmul(x, w, out=h, accumulate=True)
    if isinstance(w, Stacked):
        return h.add_(project(x, w))
    return cpu_matmul.matmul(x, w, out=h, accumulate=True)


def qk_norm_(qk: torch.Tensor, num_heads: int, layer: LayerWeights, eps: float, norm: Norm) -> None:
    """Qwen3's per-head RMSNorm, in place, of ``qk`` [T, heads + kv_heads, head_dim] (Q heads
    first), a view into the fused QKV output: rotary then runs on it as on any model's."""
    if layer.q_norm is None or layer.k_norm is None:
        return
    qk[:, :num_heads] = norm(qk[:, :num_heads], layer.q_norm, eps)
    qk[:, num_heads:] = norm(qk[:, num_heads:], layer.k_norm, eps)


def gated_activation(gate_up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """``act(gate) * up`` of a fused gate/up output [T, 2 I]: SwiGLU (silu), GeGLU (gelu_tanh), or
    gpt-oss's (swiglu_oai: both clamped at ``limit``, gate * sigmoid(alpha gate) * (up + 1))."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swiglu_oai":
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return F.silu(gate) * up


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma's final logits), in place; None: as they are."""
    if cap is None:
        return logits
    return logits.div_(cap).tanh_().mul_(cap)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 like the reference implementation, then cast back."""
    if x.dtype == torch.float32:  # one fused op, the same arithmetic
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _kind(w: Weight) -> str:
    if isinstance(w, GGUFWeight):
        return w.kind.name
    if isinstance(w, Q4_1Weight):
        return "Q4_1 blocks"
    if isinstance(w, Q8_0Weight):
        return "Q8_0 blocks"
    if isinstance(w, Stacked):
        return "+".join(_kind(p) for p in w.parts)
    return f"dense {str(w.dtype).removeprefix('torch.')}"


def _path(kind: str, tiles: bool) -> str:
    """The kernel a kind of weight runs on here (for the start-up log); ``tiles``: steps run on the
    AMX tiles from ``amx_tiles.MIN_ROWS`` (a half-precision checkpoint's rows at every step)."""
    if kind == "BF16" and tiles:
        return "AMX-BF16 tiles at every step, read in place (x rounded to bfloat16; --gemm-dtype float32: float32)"
    if kind.startswith("dense"):
        return "torch"
    if not (cpu_matmul.available() if kind.endswith("blocks") else cpu_gguf.available()):
        return "no C kernel built here (its matmul will refuse)"
    if kind.endswith("blocks"):
        return f"cpu_matmul, {cpu_matmul.simd()}"
    if kind in ("F16", "BF16"):
        rows = cpu_gguf.FLOAT_GEMM_ROWS - 1
        return f"cpu_gguf: rows decoded to float32 up to {rows} rows, decoded panels and float32 GEMM above"
    return (
        f"cpu_gguf, {cpu_gguf.simd()}: int16 activations up to {cpu_gguf.GEMM_ROWS - 1} rows, "
        "decoded panels and float32 GEMM above"
    )


def kernel_paths(roles: dict[str, list[Weight]], tiles: bool = False) -> list[str]:
    """One line per kind of projection (qkv, o_proj, ...): its weights' formats, how many of each,
    and the kernel each runs on, chosen by what this CPU has (``tiles``: as ``_path``)."""
    lines: list[str] = []
    kinds: set[str] = set()
    for role, weights in roles.items():
        counts: dict[str, int] = {}
        for w in weights:
            counts[_kind(w)] = counts.get(_kind(w), 0) + 1
            kinds.update(_kind(p) for p in (w.parts if isinstance(w, Stacked) else (w,)))
        lines.append(f"{role}: " + ", ".join(f"{n} x {k}" for k, n in counts.items()))
    lines += [f"{kind}: {_path(kind, tiles)}" for kind in sorted(kinds)]
    return lines
