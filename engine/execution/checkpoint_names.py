"""A checkpoint's tensors under the one set of names the model reads, whatever family wrote them.

Mixtral's mixture names, Phi-3's fused Q/K/V and gate/up matrices, gpt-oss's experts (one tensor
per layer, gate and up interleaved; in its published checkpoints MXFP4 blocks) are made the
names and shapes of a Llama-style checkpoint before sharding and fusing: every later step
(``parallel/sharding.py``, ``model.DecoderModel``) treats every family alike.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from trillm.engine.execution.shape import ModelShape
from trillm.kernels import cpu_gguf
from trillm.kernels.gguf_blocks import BLOCK_TYPES, GGUFWeight, reference_dequantize, rows_of

# Mixtral's checkpoint names for its mixture, and ours (Qwen3-MoE's): w1 is the gate, w3 the up, w2 the down.
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FUSED = (".qkv_proj.weight", ".gate_up_proj.weight")  # Phi-3's checkpoints


def _gpt_oss_experts(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """gpt-oss's experts, one tensor per layer ([E, H, 2I] with gate and up interleaved, [E, I, H],
    their biases), as one matrix ([out, in]) and bias per expert and projection."""
    stem, leaf = name.rsplit(".", 1)  # model.layers.N.mlp.experts, gate_up_proj(_bias) / down_proj(_bias)
    out: dict[str, torch.Tensor] = {}
    for e in range(w.shape[0]):
        x = f"{stem}.{e}."
        if leaf == "gate_up_proj":
            out[x + "gate_proj.weight"] = w[e, :, 0::2].t().contiguous()
            out[x + "up_proj.weight"] = w[e, :, 1::2].t().contiguous()
        elif leaf == "gate_up_proj_bias":
            out[x + "gate_proj.bias"], out[x + "up_proj.bias"] = w[e, 0::2].contiguous(), w[e, 1::2].contiguous()
        elif leaf == "down_proj":
            out[x + "down_proj.weight"] = w[e].t().contiguous()
        else:
            out[x + "down_proj.bias"] = w[e]
    return out


_GPT_OSS_EXPERTS = (
    ".experts.gate_up_proj",
    ".experts.gate_up_proj_bias",
    ".experts.down_proj",
    ".experts.down_proj_bias",
)


def split_rows(w: Any, sizes: list[int]) -> list[Any]:
    """A matrix [out, in] cut into row blocks of ``sizes``: dense (views), a GGUF file's blocks, or
    blocks repacked (``block_weights``): a block never spans rows, so each cut is exact."""
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    pieces = list(zip(bounds, bounds[1:]))
    if isinstance(w, torch.Tensor):
        return [w[a:b] for a, b in pieces]
    if isinstance(w, GGUFWeight):
        return [rows_of(w, w.data[a:b]) for a, b in pieces]
    return [type(w)(*(t[a:b] for t in attrs.astuple(w, recurse=False))) for a, b in pieces]


def _mxfp4_experts(name: str, blocks: torch.Tensor, scales: torch.Tensor, keep: bool) -> dict[str, Any]:
    """gpt-oss's MXFP4 checkpoint tensors (``…experts.gate_up_proj_blocks`` [E, rows, K/32, 16] and
    ``_scales`` [E, rows, K/32]; gate and up rows interleaved) as one matrix per expert and
    projection: in GGUF's MXFP4 blocks with ``keep`` (the same scales; each block's nibbles
    reordered, from value pairs to halves), else decoded to float32."""
    stem, leaf = name.removesuffix("_blocks").rsplit(".", 1)  # …mlp.experts, gate_up_proj / down_proj
    experts, rows, count, _ = blocks.shape
    nibbles = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(experts, rows, count, 32)  # value order
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)  # GGUF: value j low, value j + 16 high
    raw = torch.cat([scales.unsqueeze(-1), packed], dim=-1).reshape(experts, rows, count * 17).contiguous()
    decoded = cpu_gguf.dequantize if cpu_gguf.available() else reference_dequantize
    out: dict[str, Any] = {}
    for e in range(experts):
        weight = GGUFWeight(BLOCK_TYPES["MXFP4"], raw[e], count * 32)
        if leaf == "down_proj":
            parts = {"down_proj": weight}
        else:  # gate and up rows interleaved
            parts = {"gate_proj": _rows_every(weight, 0), "up_proj": _rows_every(weight, 1)}
        for proj, w in parts.items():
            out[f"{stem}.{e}.{proj}.weight"] = w if keep else decoded(w)
    return out


def _rows_every(w: GGUFWeight, start: int) -> GGUFWeight:
    """Rows start, start + 2, ... of ``w`` (gate and up interleaved), copied: a view cannot skip rows."""
    return rows_of(w, w.data[start::2].contiguous())


# An image-and-text checkpoint's parts the text model does not read, and its language model's prefixes
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_BASE_MODEL_PREFIXES = ("embed_tokens.", "layers.", "norm.")
_LANGUAGE_PREFIXES = {
    "language_model.model.": "model.",  # the published Gemma 3 checkpoints
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",  # transformers 5's own layout
}


def text_name(name: str) -> str | None:
    """A checkpoint tensor's name for the text model: a multimodal checkpoint's language model
    under a Llama-style name, None for its vision tower and projector (not read); a base model's
    (``Qwen3Model``, as embedding models are saved: no ``model.`` prefix, no head) under the
    causal model's; others as they are."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, ours in _LANGUAGE_PREFIXES.items():
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    if name.startswith(_BASE_MODEL_PREFIXES):  # a base model's checkpoint (embedding models): no ``model.``
        return "model." + name
    return name


def canonical_names(weights: dict[str, Any], shape: ModelShape, blocks: bool = False) -> dict[str, Any]:
    """``weights`` under the names the model reads: Mixtral's ``block_sparse_moe.experts.E.w1``
    as ``mlp.experts.E.gate_proj`` (and so on), its router ``block_sparse_moe.gate`` as ``mlp.gate``;
    gpt-oss's experts (a tensor per layer, gate and up interleaved) one matrix per expert, its
    ``mlp.router`` as ``mlp.gate``;
    Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` cut into their parts (views, nothing copied),
    so that sharding and fusing treat every family alike."""
    if not any(
        ".block_sparse_moe." in name
        or name.endswith(_FUSED + _GPT_OSS_EXPERTS + ("_blocks",))
        or ".mlp.router." in name
        for name in weights
    ):
        return weights
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    out: dict[str, Any] = {}
    for name, w in weights.items():
        if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in weights:
            continue  # read with its blocks
        if name.endswith("_blocks") and isinstance(w, torch.Tensor):  # gpt-oss's MXFP4 experts
            out.update(_mxfp4_experts(name, w, weights[name.removesuffix("_blocks") + "_scales"], blocks))
            continue
        if name.endswith(".qkv_proj.weight"):
            stem = name.removesuffix("qkv_proj.weight")
            out.update(zip((stem + f"{x}_proj.weight" for x in "qkv"), split_rows(w, [q, kv, kv])))
            continue
        if name.endswith(".gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            half = w.shape[0] // 2
            out.update(zip((stem + "gate_proj.weight", stem + "up_proj.weight"), split_rows(w, [half, half])))
            continue
        if name.endswith(_GPT_OSS_EXPERTS) and isinstance(w, torch.Tensor):
            out.update(_gpt_oss_experts(name, w))
            continue
        if ".mlp.router." in name:  # gpt-oss's router, with its bias
            out[name.replace(".mlp.router.", ".mlp.gate.")] = w
            continue
        if ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            parts = name.split(".")
            if len(parts) > 2 and parts[-2] in _MIXTRAL_NAMES:
                parts[-2] = _MIXTRAL_NAMES[parts[-2]]
            name = ".".join(parts)
        out[name] = w
    return out
