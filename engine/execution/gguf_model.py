"""A GGUF file served as it is: its config from the metadata, its weights from the mapped file.

No float32 detour and no conversion cache: the header says what the model is
(``gguf_config``, in the config.json names the rest of the engine reads), and each matrix is
taken from a memory map of the file, kept in its blocks (``kernels/gguf_blocks``) where the
backend runs them, or decoded to the served dtype where it does not (``--weight-format dense``,
bfloat16, a GPU, or tensor parallelism for now). Only the tokenizer is written once, to the
cache folder (``model_source.gguf_folder``), since building it from the metadata takes seconds.

The names here are the HF checkpoint's (``model.layers.0.self_attn.q_proj.weight``), so the
model is built as from any checkpoint. Llama-architecture files hold Q and K with each head's
rows interleaved for llama.cpp's rotary layout; rows are put back in HF's order (a row
permutation, exact in blocks: a block never spans rows).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from trillm.engine.execution.file_checks import check_finite
from trillm.engine.execution.gguf_header import GGUFHeader, TensorInfo
from trillm.engine.execution.prefault import release, within
from trillm.engine.execution.prefault import start as prefault_start
from trillm.kernels import cpu_gguf
from trillm.kernels.block_weights import BlockWeight
from trillm.kernels.gguf_blocks import BY_ID, GGUFWeight, from_bytes, reference_dequantize, repacked, rows_of

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# Architectures whose converter interleaved Q/K rows per head (llama.cpp's convert_hf_to_gguf)
PERMUTED_QK = frozenset({"llama", "mistral"})
# Mixtures whose router renormalises the top-k weights (llama.cpp's norm_w: Mixtral and Qwen3-MoE)
NORMALISED_MIXTURES = frozenset({"llama", "qwen3moe"})
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a mixture's router
    # Qwen2-MoE's shared expert, and its gate (a vector in the file, [1, hidden] in the checkpoint)
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# A mixture's experts, one 3-D tensor each [experts, rows, cols], and their checkpoint names
_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
_EXPERT_BIASES = {"ffn_gate_exps.bias": "gate_proj", "ffn_up_exps.bias": "up_proj", "ffn_down_exps.bias": "down_proj"}
# Gemma's layer norms: llama.cpp calls the MLP's input norm ffn_norm, as for Llama, but the
# checkpoint's post_attention_layernorm is the attention output's (post_attention_norm).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# gpt-oss: the MLP's input norm is post_attention_norm; the sinks, O's and the router's biases.
_GPT_OSS_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate_inp.bias": "mlp.gate.bias",
}
# Phi-3: Q, K and V in one matrix, gate and up in another (cut at load: ``checkpoint_names.canonical_names``)
_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
_LAYER_NAMES_OF = {
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3": _GEMMA_LAYER_NAMES,
    "gpt-oss": _GPT_OSS_LAYER_NAMES,
    "phi3": _PHI3_LAYER_NAMES,
}
# Architectures whose converter stored each RMSNorm weight as 1 + w (the checkpoint keeps w)
NORM_PLUS_ONE = frozenset({"gemma2", "gemma3"})
# Gemma 3 (llama.cpp's reading, the file says neither): every 6th layer global, the others
# windowed with a rope base of 10,000.
GEMMA3_PATTERN, GEMMA3_LOCAL_BASE = 6, 10_000.0
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The checkpoint name of a GGUF tensor (None: one the model does not use, e.g. ``rope_freqs``)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    names = _LAYER_NAMES_OF.get(arch, _LAYER_NAMES)
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def gguf_config(header: GGUFHeader) -> dict[str, Any]:
    """The model's config.json, from the file's metadata (what ``ModelShape.from_config`` reads)."""
    meta = header.metadata
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    tensors = {t.name: t for t in header.tensors}
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = tensors["token_embd.weight"].dims[1]
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length") or get("expert_feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    for key, token in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        value = meta.get(f"tokenizer.ggml.{token}_token_id")
        if isinstance(value, int):
            config[key] = value
    scaling = _rope_scaling(header, arch)
    if scaling:
        config["rope_scaling"] = scaling
    if arch == "gemma3":
        config.update(_gemma3_config(header, config))
    if arch == "gemma2":
        config.update(_gemma2_config(header, config))
    experts = int(get("expert_count", 0) or 0)
    if experts:
        config.update(_mixture_config(arch, experts, int(get("expert_used_count", 2))))
        if arch in ("qwen2moe", "qwen3moe"):
            config["moe_intermediate_size"] = int(get("expert_feed_forward_length", config["intermediate_size"]))
        if arch == "qwen2moe":
            config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length", 0) or 0)
    if arch == "phi3":
        config.update(_phi3_config(header, config))
    if arch == "gpt-oss":  # every other layer windowed, from the first (llama.cpp's pattern of 2)
        layers = config["num_hidden_layers"]
        config["sliding_window"] = int(get("attention.sliding_window", 128))
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        config["intermediate_size"] = int(get("expert_feed_forward_length", config["intermediate_size"]))
    return config


def _phi3_config(header: GGUFHeader, config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's keys beyond a Llama's: the rotated part of each head, its window (0: none, Phi-4),
    and LongRoPE's factors (two tensors of the file) with the context they extend."""
    meta = header.metadata
    extra: dict[str, Any] = {}
    rotary = meta.get("phi3.rope.dimension_count")
    if rotary:
        extra["partial_rotary_factor"] = int(rotary) / config["head_dim"]
    window = int(meta.get("phi3.attention.sliding_window", 0) or 0)
    if window:
        extra["sliding_window"] = window
    tensors = {t.name: t for t in header.tensors}
    if "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        original = int(meta.get("phi3.rope.scaling.original_context_length", config["max_position_embeddings"]))
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": _dense(header, tensors["rope_factors_long.weight"]).tolist(),
            "short_factor": _dense(header, tensors["rope_factors_short.weight"]).tolist(),
            "original_max_position_embeddings": original,
        }
        if meta.get("phi3.rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(meta["phi3.rope.scaling.attn_factor"])
        extra["rope_scaling"] = scaling
        extra["original_max_position_embeddings"] = original
    return extra


def _mixture_config(arch: str, experts: int, used: int) -> dict[str, Any]:
    """A mixture's config.json keys: Mixtral's files say ``llama`` with experts."""
    if arch == "llama":
        return {"architectures": ["MixtralForCausalLM"], "num_local_experts": experts, "num_experts_per_tok": used}
    return {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": arch in NORMALISED_MIXTURES}


def _gemma2_config(header: GGUFHeader, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's keys, as llama.cpp reads its files: every other layer windowed from the first,
    the two soft caps (llama.cpp's defaults 50 and 30 where the file has none), the score scale
    (27B, 46 layers: hidden / heads; else the head size), the turn's end an end of sequence."""
    meta = header.metadata
    layers = config["num_hidden_layers"]
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 46 else config["head_dim"]
    extra: dict[str, Any] = {
        "sliding_window": int(meta.get("gemma2.attention.sliding_window", 4096)),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": float(meta.get("gemma2.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(meta.get("gemma2.final_logit_softcapping", 30.0)),
        "hidden_activation": "gelu_pytorch_tanh",
    }
    return extra | _end_of_turn(header, config)


def _end_of_turn(header: GGUFHeader, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma's ``<end_of_turn>`` as a second end of sequence (chat replies stop there)."""
    tokens = header.metadata.get("tokenizer.ggml.tokens") or []
    eos = config.get("eos_token_id")
    if "<end_of_turn>" in tokens and isinstance(eos, int):
        return {"eos_token_id": [eos, tokens.index("<end_of_turn>")]}
    return {}


def _gemma3_config(header: GGUFHeader, config: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 3's config.json says beyond a Llama's, as llama.cpp reads the file: the window
    and its pattern, the local rope base, the score scale (27B: hidden / heads; else the head
    size), and the turn's end as a second end of sequence (chat replies stop there). A rope
    scaling in the file (4B and up: linear, factor 8) is the global layers'."""
    meta = header.metadata
    layers = config["num_hidden_layers"]
    pattern = int(meta.get("gemma3.attention.sliding_window_pattern", GEMMA3_PATTERN))
    scalar = config["hidden_size"] // config["num_attention_heads"] if layers == 62 else config["head_dim"]
    extra: dict[str, Any] = {
        "sliding_window": int(meta.get("gemma3.attention.sliding_window", 4096)),
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "rope_local_base_freq": GEMMA3_LOCAL_BASE,
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    return extra | _end_of_turn(header, config)


def _rope_scaling(header: GGUFHeader, arch: str) -> dict[str, Any] | None:
    meta = header.metadata
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:  # gpt-oss: transformers' reading of its config (no truncation)
        original = meta.get(f"{arch}.rope.scaling.original_context_length", 4096)
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(original),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        }
    if kind not in (None, "none", "linear"):
        from trillm.engine.execution.gguf_support import UnsupportedModel

        raise UnsupportedModel(f"{header.path}: rope scaling {kind!r} is not served yet")
    freqs = next((t for t in header.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3.1+: llama.cpp keeps the per-frequency divisors as a tensor
        return {"rope_type": "freq_factors", "factors": _dense(header, freqs).tolist()}
    return None


def _mapped(header: GGUFHeader) -> np.ndarray:
    """The file, mapped copy-on-write: torch wants writable arrays, and pages never written stay the file's."""
    return np.memmap(header.path, dtype=np.uint8, mode="c")


def _raw(file: np.ndarray, info: TensorInfo) -> np.ndarray:
    return file[info.offset : info.offset + info.nbytes]


def _dense(header: GGUFHeader, info: TensorInfo, file: np.ndarray | None = None) -> torch.Tensor:
    """A tensor decoded to float32, in the file's order (a matrix is [N, K])."""
    file = _mapped(header) if file is None else file
    raw = _raw(file, info)
    shape = tuple(reversed(info.dims))
    if info.type == 0:  # F32
        return torch.from_numpy(raw.view(np.float32).reshape(shape))
    weight = from_bytes(BY_ID[info.type], raw, math.prod(shape[:-1]), info.dims[0])
    values = cpu_gguf.dequantize(weight) if cpu_gguf.available() else reference_dequantize(weight)
    return values.reshape(shape)


def _experts(
    header: GGUFHeader,
    info: TensorInfo,
    file: np.ndarray,
    prefix: str,
    kind: str,
    blocks: bool,
    activation_bits: int = 16,
) -> dict[str, Tensorish]:
    """Each expert's matrix of a [experts, rows, cols] tensor, named ``{prefix}.E.{kind}.weight``:
    with ``blocks`` each a view of its own rows of the mapped file (nothing copied), else decoded."""
    cols, rows, experts = info.dims
    names = [f"{prefix}.{e}.{kind}.weight" for e in range(experts)]
    if blocks and info.type in BY_ID:
        whole = from_bytes(BY_ID[info.type], _raw(file, info), experts * rows, cols, activation_bits)
        return {name: repacked(rows_of(whole, whole.data[e * rows : (e + 1) * rows])) for e, name in enumerate(names)}
    dense = _dense(header, info, file).reshape(experts, rows, cols)
    check_finite(header.path, info.name, dense, "replace it with an intact copy")
    return {name: dense[e] for e, name in enumerate(names)}


def _unpermute_rows(heads: int, rows: int) -> torch.Tensor:
    """For each HF row, the GGUF row holding it: GGUF keeps each head's rows as (pair, half), HF as (half, pair)."""
    d = rows // heads
    index = torch.arange(rows).view(heads, d // 2, 2).transpose(1, 2)
    return index.reshape(rows)


Tensorish = torch.Tensor | GGUFWeight | BlockWeight


def gguf_weights(
    header: GGUFHeader, blocks: bool, activation_bits: int = 16, prefault: bool = False, huge_pages: bool = False
) -> dict[str, Tensorish]:
    """The checkpoint-named weights of ``header``'s file. With ``blocks``, every matrix stays in the
    file's blocks (``GGUFWeight``, or repacked into ``block_weights``' layouts where that is
    exact); else each is decoded to float32. Vectors (norms, biases) are float32 tensors. What is
    decoded is checked to be finite (a damaged file is refused, ``file_checks``); blocks are not
    read here (a mapped page is read when the model first runs it). ``activation_bits``: what the
    blocks' integer dot products quantize x to (``GGUFWeight.activation_bits``). ``prefault``: with
    ``blocks``, the mapping's pages are read in the background (``prefault.start``), with ``huge_pages``
    into anonymous huge pages."""
    arch = header.metadata["general.architecture"]
    config = gguf_config(header)
    file = _mapped(header)
    out: dict[str, Tensorish] = {}
    copied: list[tuple[int, int]] = []  # byte ranges of the file whose weights were copied out
    for info in header.tensors:
        layer, _, leaf = info.name.removeprefix("blk.").partition(".")
        if leaf in _EXPERT_NAMES:  # one tensor of every expert: each expert's rows kept apart
            prefix = f"model.layers.{layer}.mlp.experts"
            out.update(_experts(header, info, file, prefix, _EXPERT_NAMES[leaf], blocks, activation_bits))
            continue
        if leaf in _EXPERT_BIASES:  # gpt-oss: [experts, rows], one bias per expert
            dense = _dense(header, info, file)
            kind = _EXPERT_BIASES[leaf]
            out.update({f"model.layers.{layer}.mlp.experts.{e}.{kind}.bias": dense[e] for e in range(dense.shape[0])})
            continue
        name = hf_name(info.name, arch)
        if name is None:
            continue
        order = None
        if arch in PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            order = _unpermute_rows(heads, info.dims[1])
        if blocks and len(info.dims) == 2 and info.type in BY_ID:
            weight = from_bytes(BY_ID[info.type], _raw(file, info), info.dims[1], info.dims[0], activation_bits)
            if order is not None:
                weight = rows_of(weight, weight.data[order])
            kept = repacked(weight)
            out[name] = kept
            if not (isinstance(kept, GGUFWeight) and within(file, kept.data.data_ptr())):
                copied.append((info.offset, info.nbytes))  # never read from the mapping again
        else:
            dense = _dense(header, info, file)
            check_finite(header.path, info.name, dense, "replace it with an intact copy")
            if arch in NORM_PLUS_ONE and name.endswith("norm.weight"):
                dense = dense - 1.0  # back to the checkpoint's w: the model adds 1 to every norm's
            if name.endswith("shared_expert_gate.weight"):
                dense = dense.reshape(1, -1)
            out[name] = dense[order] if order is not None else dense
    if blocks:
        release(file, copied)  # resident once, as the copy
    if blocks and prefault:
        prefault_start(file, header.path.name, skip=copied, huge=huge_pages)
    return out
