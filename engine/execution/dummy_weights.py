"""Random weights under a checkpoint's names, shaped by a ``ModelShape``: what ``--load-format
dummy`` serves (any model size measured without its weights) and what the kernel tests run.

Every family's tensors are made (norms in the checkpoint's convention, Gemma's ``w - 1``;
experts, their biases, Qwen2-MoE's shared expert), so a dummy model loads through the same path
as a real checkpoint.
"""

from __future__ import annotations

import torch

from trillm.engine.execution.shape import ModelShape


def dummy_weights(
    shape: ModelShape, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Checkpoint-named random weights (std 0.02, unit norms), made on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d = shape.hidden_size, shape.head_dim
    q, kv, inter = shape.num_heads * d, shape.num_kv_heads * d, shape.intermediate_size

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n: int) -> torch.Tensor:  # unit norms, in the checkpoint's convention
        return torch.full((n,), 0.0 if shape.norm_plus_one else 1.0, device=device, dtype=dtype)

    def mlp(
        prefix: str, size: int
    ) -> dict[str, torch.Tensor]:  # a gated MLP: an expert's, a shared one's, a dense one's
        gate, up = rand(size, h), rand(size, h)
        return {
            prefix + "gate_proj.weight": gate,
            prefix + "up_proj.weight": up,
            prefix + "down_proj.weight": rand(h, size),
        }

    w = {"model.embed_tokens.weight": rand(shape.vocab_size, h), "model.norm.weight": ones(h)}
    if not shape.tie_word_embeddings:
        w["lm_head.weight"] = rand(shape.vocab_size, h)
    for i in range(shape.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        w.update(
            {
                p + "input_layernorm.weight": ones(h),
                p + "post_attention_layernorm.weight": ones(h),
                a + "q_proj.weight": rand(q, h),
                a + "k_proj.weight": rand(kv, h),
                a + "v_proj.weight": rand(kv, h),
                a + "o_proj.weight": rand(h, q),
            }
        )
        if shape.is_moe(i):
            e_inter = shape.expert_intermediate_size
            w[p + "mlp.gate.weight"] = rand(shape.num_experts, h)
            if shape.expert_bias:
                w[p + "mlp.gate.bias"] = rand(shape.num_experts)
            for e in range(shape.num_experts):
                x = f"{p}mlp.experts.{e}."
                w.update(mlp(x, e_inter))
                if shape.expert_bias:
                    w.update({x + "gate_proj.bias": rand(e_inter), x + "up_proj.bias": rand(e_inter)})
                    w[x + "down_proj.bias"] = rand(h)
            if shape.shared_expert_intermediate_size:
                w.update(mlp(p + "mlp.shared_expert.", shape.shared_expert_intermediate_size))
                w[p + "mlp.shared_expert_gate.weight"] = rand(1, h)
        else:
            w.update(mlp(p + "mlp.", inter))
        if shape.qk_norm:
            w.update({a + "q_norm.weight": ones(d), a + "k_norm.weight": ones(d)})
        if shape.sandwich_norms:
            w.update({p + f"{where}_feedforward_layernorm.weight": ones(h) for where in ("pre", "post")})
        if shape.attention_bias:
            w.update({a + "q_proj.bias": rand(q), a + "k_proj.bias": rand(kv), a + "v_proj.bias": rand(kv)})
        if shape.output_bias:
            w[a + "o_proj.bias"] = rand(h)
        if shape.attention_sinks:
            w[a + "sinks"] = rand(shape.num_heads)
    return w
