"""The numbers of a Llama-family config that the forward pass, the sharding and the KV pool use.

At the bottom of ``execution/``: the model, the backends and ``parallel/`` all read it.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


@attrs.frozen
class LlamaShape:
    """The numbers of a Llama-family config that the forward pass uses."""

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
    qk_norm: bool = False  # Qwen3: RMSNorm over each Q and K head before RoPE

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token over every layer: what the KV pool is sized by."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8

    def dense_projection_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of every projection (and the LM head) as dense ``dtype`` matrices: what one decode
        step reads of the weights unless they are kept in blocks (``LlamaModel.projection_bytes``)."""
        d, h = self.head_dim, self.hidden_size
        per_layer = (
            h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h + 3 * h * self.intermediate_size
        )
        return (self.num_layers * per_layer + self.vocab_size * h) * torch.finfo(dtype).bits // 8

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> LlamaShape:
        archs = set(cfg.get("architectures") or ["LlamaForCausalLM"])
        if not archs & SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {sorted(archs)}; trillm serves {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers 5 folds rope_theta/rope_scaling into rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", "Qwen2ForCausalLM" in archs)),
            qk_norm="Qwen3ForCausalLM" in archs,
        )
