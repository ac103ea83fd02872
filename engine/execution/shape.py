"""The description of a decoder-only model that the forward pass, the sharding and the KV pool use.

One description for every family served: the numbers of a Llama-style config, and the switches
that carry each family's differences (per-layer sliding windows and rope bases, per-head Q/K
norms, norms around each block's output, GeGLU, a scaled embedding, soft-capped logits). The
model (``model.py``), the backends and ``parallel/`` read the switches, never the family's name.

At the bottom of ``execution/``: the model, the backends and ``parallel/`` all read it.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

LLAMA_LIKE = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"}
MIXTURES = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"}
GEMMA = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}
# Image-and-text checkpoints whose language model is served alone (its text config and weights;
# the vision tower and projector are not read): the architecture their text part is
MULTIMODAL_TEXT = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# Base models, as embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) are saved: the causal
# model's layers without its head, which is then the embeddings (tied) for the one token such a
# request samples.
BASE_MODELS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    # Sequence classifiers (cross-encoder rerankers): the same layers, and a ``score`` head
    # ``DecoderModel.classifier`` keeps for ``/v1/rerank``.
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = LLAMA_LIKE | MIXTURES | GEMMA | set(MULTIMODAL_TEXT) | set(BASE_MODELS)
# Families whose sliding_window (when set) applies to every layer; Qwen2/3 need use_sliding_window.
_WINDOWED_ALL = {"MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"}
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
_GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@attrs.frozen
class ModelShape:
    """The numbers of a model's config, and its family's switches (their defaults are Llama's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each Q and K head before RoPE
    # Gemma: checkpoints store each RMSNorm weight as w - 1 (the norm multiplies by 1 + w); loaders add 1.
    norm_plus_one: bool = False
    # Gemma 2/3: an RMSNorm on the attention output and on the MLP output, before each residual add.
    sandwich_norms: bool = False
    # Of the gated MLP: silu (SwiGLU), gelu_tanh (GeGLU), or swiglu_oai (gpt-oss: gate and up clamped
    # at ``swiglu_limit``, gate * sigmoid(alpha gate) * (up + 1))
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    embed_scale: float = 1.0  # the embedded tokens times this (Gemma: sqrt(hidden_size))
    query_scale: float | None = None  # of the attention scores; None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcap: float | None = None  # Gemma 2: each attention score s = cap * tanh(s / cap)
    # Per layer: 0 attends the whole context; W > 0 only its last W tokens (sliding window). (): all whole.
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # the rope base of windowed layers (Gemma 3); None: rope_theta
    rotary_dim: int = 0  # the rotated part of each head (Phi-4-mini: 3/4 of it); 0: all of it
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax's denominator
    output_bias: bool = False  # gpt-oss: o_proj has a bias (added once, after the all-reduce)
    # Mixtures of experts (Mixtral, Qwen3-MoE): the MLP of each layer not in ``dense_layers`` is
    # ``num_experts`` gated MLPs of ``expert_intermediate_size``; a router picks ``experts_per_token``
    # of them per token (softmax, top-k, renormalised with ``normalize_top_k``), their outputs weighed.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_top_k: bool = True
    dense_layers: tuple[int, ...] = ()
    expert_bias: bool = False  # gpt-oss: the router and every expert's projections have biases
    # Qwen2-MoE: beside the routed experts, one shared expert every token runs (a gated MLP of this
    # size), its output weighed by sigmoid(x . shared_gate); 0: none
    shared_expert_intermediate_size: int = 0

    def __attrs_post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")

    @property
    def rope_dim(self) -> int:
        """How many values of each head rotary embedding turns."""
        return self.rotary_dim or self.head_dim

    @property
    def scale(self) -> float:
        """Of the attention scores."""
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int:
        """How many of its last tokens layer ``layer`` attends (0: all of them)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_span(self) -> int:
        """How many of its last tokens every layer attends: the widest window where every layer
        has one (older tokens' KV is read by no layer), else 0 (some layer attends them all)."""
        if not self.layer_windows or not all(self.layer_windows):
            return 0
        return max(self.layer_windows)

    def local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates by the local rope table (a windowed layer of Gemma 3)."""
        return self.local_rope_theta is not None and self.window(layer) > 0

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token over every layer: what the KV pool is sized by."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8

    def dense_projection_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the projections (and the LM head) one token's decode step reads as dense ``dtype``
        matrices, unless they are kept in blocks (``DecoderModel.projection_bytes``): of a mixture's
        experts, the ``experts_per_token`` it runs, and its router."""
        d, h = self.head_dim, self.hidden_size
        attention = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        total = self.vocab_size * h
        for layer in range(self.num_layers):
            if self.is_moe(layer):
                mlp = self.experts_per_token * 3 * h * self.expert_intermediate_size + h * self.num_experts
                if self.shared_expert_intermediate_size:
                    mlp += 3 * h * self.shared_expert_intermediate_size + h
            else:
                mlp = 3 * h * self.intermediate_size
            total += attention + mlp
        return total * torch.finfo(dtype).bits // 8

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelShape:
        cfg = language_config(cfg)
        archs = set(cfg.get("architectures") or ["LlamaForCausalLM"])
        if not archs & SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {sorted(archs)}; trillm serves {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if archs & GEMMA:
            return _gemma(cfg, gemma2="Gemma2ForCausalLM" in archs)
        # transformers 5 folds rope_theta/rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial = float(rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
        common = _common(cfg)
        if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):  # Phi-3: the lengths its factor comes from
            rope["rope_type"] = "longrope"
            rope.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
            rope.setdefault("max_position_embeddings", common["max_position_embeddings"])
        return cls(
            **common,
            rope_theta=theta,
            rope_scaling=rope or None,
            rotary_dim=int(common["head_dim"] * partial) if partial < 1.0 else 0,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", "Qwen2ForCausalLM" in archs))),
            qk_norm=bool(archs & {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}),
            layer_windows=_windows(cfg, bool(archs & _WINDOWED_ALL)),
            **(_mixture(cfg, archs) if archs & MIXTURES else {}),
        )


def language_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """An image-and-text checkpoint's config (``MULTIMODAL_TEXT``) as its language model's own: the
    ``text_config``, its unset keys filled with transformers' defaults (published configs list only
    what differs from them); any other config as it is."""
    archs = cfg.get("architectures") or []
    base = next((BASE_MODELS[a] for a in archs if a in BASE_MODELS), None)
    if base is not None:
        return {**cfg, "architectures": [base], "tie_word_embeddings": True}
    text = next((MULTIMODAL_TEXT[a] for a in archs if a in MULTIMODAL_TEXT), None)
    if text is None:
        return cfg
    from transformers import Gemma3TextConfig

    inner = Gemma3TextConfig(**(cfg.get("text_config") or {})).to_dict()
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):  # where the outer config says them
        if key in cfg and cfg[key] is not None:
            inner.setdefault(key, cfg[key])
    return {**inner, "architectures": [text]}


def _common(cfg: dict[str, Any]) -> dict[str, Any]:
    heads = cfg["num_attention_heads"]
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
    )


def _windows(cfg: dict[str, Any], every_layer: bool) -> tuple[int, ...]:
    """Per-layer sliding windows: from ``layer_types`` where the config lists them, else every layer's
    for Mistral and Mixtral (``sliding_window``, 4,096 in Mistral 7B v0.1), and for Qwen2/3 only
    with ``use_sliding_window``, from layer ``max_window_layers`` on (as transformers reads them)."""
    window = int(cfg.get("sliding_window") or 0)
    n = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if not window:
        return ()
    if kinds:
        windows = tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
    elif every_layer:
        windows = (window,) * n
    elif cfg.get("use_sliding_window"):
        first = int(cfg.get("max_window_layers", n))
        windows = tuple(window if i >= first else 0 for i in range(n))
    else:
        return ()
    return windows if any(windows) else ()


def _mixture(cfg: dict[str, Any], archs: set[str]) -> dict[str, Any]:
    """Mixtral's, Qwen2-MoE's and Qwen3-MoE's experts: their count, how many a token runs, their
    size, Qwen2-MoE's shared expert, and which layers keep a dense MLP (Qwen's ``mlp_only_layers``,
    ``decoder_sparse_step``)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts < 1:
        raise ValueError(f"a mixture of experts ({sorted(archs)[0]}) with no experts in its config")
    n = cfg["num_hidden_layers"]
    if "GptOssForCausalLM" in archs:  # softmax over the top-k logits: renormalised top-k probabilities
        return dict(
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok", 4)),
            expert_intermediate_size=cfg["intermediate_size"],
            normalize_top_k=True,
            expert_bias=True,
            activation="swiglu_oai",
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
            attention_sinks=True,
            output_bias=bool(cfg.get("attention_bias", True)),
        )
    if "MixtralForCausalLM" in archs:
        return dict(
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok", 2)),
            expert_intermediate_size=cfg["intermediate_size"],
            normalize_top_k=True,
        )
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()} | {i for i in range(n) if (i + 1) % step}
    return dict(
        num_experts=experts,
        experts_per_token=int(cfg.get("num_experts_per_tok", 8)),
        expert_intermediate_size=int(cfg["moe_intermediate_size"]),
        normalize_top_k=bool(cfg.get("norm_topk_prob", False)),
        dense_layers=tuple(sorted(dense)),
        shared_expert_intermediate_size=(
            int(cfg.get("shared_expert_intermediate_size") or 0) if "Qwen2MoeForCausalLM" in archs else 0
        ),
    )


def _gemma(cfg: dict[str, Any], gemma2: bool) -> ModelShape:
    """Gemma 2's and 3's text models: interleaved sliding-window and global layers, norms around
    both blocks' outputs, GeGLU, an embedding scaled by sqrt(hidden), scores scaled by
    ``query_pre_attn_scalar``, `1 + w` norms. Gemma 3: each kind of layer with its own rope base
    (the global ones with the config's rope scaling), per-head Q/K norms. Gemma 2: one rope,
    attention scores soft-capped (``attn_logit_softcapping``), every other layer windowed."""
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _GEMMA_ACTIVATIONS:
        raise ValueError(f"Gemma with the activation {activation!r} is not served")
    n = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if not kinds:  # older configs: every `sliding_window_pattern`-th layer is global (Gemma 2: every other)
        default = 2 if gemma2 else 6
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default)
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    window = int(cfg.get("sliding_window") or 0)
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
    params = cfg.get("rope_parameters") or {}
    if gemma2:  # one rope for every layer
        full = dict(params or cfg.get("rope_scaling") or {})
        full.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        local = None
    elif "full_attention" in params:  # transformers 5: one rope per kind of layer
        full = dict(params["full_attention"])
        local = dict(params.get("sliding_attention") or {"rope_theta": 10000.0})
    else:
        full = dict(cfg.get("rope_scaling") or {})
        full["rope_theta"] = cfg.get("rope_theta", 1_000_000.0)
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    if local is not None and local.get("rope_type", "default") != "default":
        raise ValueError(f"a rope scaling of Gemma 3's sliding layers ({local['rope_type']!r}) is not served")
    theta = float(full.pop("rope_theta", 1_000_000.0))
    scalar = cfg.get("query_pre_attn_scalar")
    cap, attn_cap = cfg.get("final_logit_softcapping"), cfg.get("attn_logit_softcapping")
    return ModelShape(
        **_common(cfg),
        rope_theta=theta,
        rope_scaling=full if full.get("rope_type", "default") != "default" else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=not gemma2,
        norm_plus_one=True,
        sandwich_norms=True,
        activation=_GEMMA_ACTIVATIONS[activation],
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        query_scale=float(scalar) ** -0.5 if scalar else None,
        final_logit_softcap=float(cap) if cap else None,
        attn_logit_softcap=float(attn_cap) if attn_cap else None,
        layer_windows=windows if any(windows) else (),
        local_rope_theta=float(local.get("rope_theta", 10000.0)) if local is not None else None,
    )
