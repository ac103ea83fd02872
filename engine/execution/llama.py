"""Our Llama-family forward pass (Llama, Mistral, Qwen2, SmolLM2) over the paged KV cache.

Weights are plain tensors held by the model; Q/K/V and gate/up projections are
fused into one matmul each at load time. ``transformers`` supplies only the config.
On the CPU fast path, projections whose float32 values are exactly GGUF blocks (as
the default model's are) stay in those blocks (``kernels/block_weights.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from safetensors import safe_open

from trillm.engine.execution.attention import AttentionMetadata, KernelMetadata, paged_attention
from trillm.engine.execution.rope import apply_rotary, cos_sin_table
from trillm.kernels import Kernels, cpu_forward, cpu_matmul, cpu_ops
from trillm.kernels.block_weights import BlockWeight, pack_exact

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


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

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "LlamaShape":
        archs = set(cfg.get("architectures") or ["LlamaForCausalLM"])
        if not archs & SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {sorted(archs)}; trillm serves {sorted(SUPPORTED_ARCHITECTURES)}")
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
        )


# A projection: dense and transposed, [in, out], or exact GGUF blocks, [out, in].
Weight = torch.Tensor | BlockWeight


@attrs.define
class LayerWeights:
    """One decoder layer."""

    input_norm: torch.Tensor
    qkv: Weight  # hidden -> (H + 2 KVH) * D
    qkv_bias: torch.Tensor | None
    o_proj: Weight
    post_norm: torch.Tensor
    gate_up: Weight  # hidden -> 2 * intermediate
    down: Weight


def _t(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> contiguous [in, out]: on CPUs ``x @ w_t`` beats ``F.linear(x, w)``
    for small batches (measured 1.2-2x on the decode shapes of SmolLM2)."""
    return weight.t().contiguous()


def _weight(weight: torch.Tensor, blocks: bool) -> Weight:
    """``weight`` [out, in] in exact blocks when asked and possible, else transposed.

    Blocks hold the same values in 6 (Q4_1) or 9 (Q8_0) bits instead of 32 (float32
    scales included), so a decode step, which reads every weight once, moves 3.5-5.3x
    fewer bytes.
    """
    packed = pack_exact(weight) if blocks else None
    return packed if packed is not None else _t(weight)


def _project(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)
    out = cpu_matmul.matmul(x, w)
    return out if bias is None else out.add_(bias)


def _project_add(h: torch.Tensor, x: torch.Tensor, w: Weight) -> torch.Tensor:
    """``h + x @ W``: the residual add rides on the GEMM (in place into ``h`` for blocks)."""
    if isinstance(w, torch.Tensor):
        return torch.addmm(h, x, w)
    return cpu_matmul.matmul(x, w, out=h, accumulate=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 like the reference implementation, then cast back."""
    if x.dtype == torch.float32:  # one fused op, the same arithmetic
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def dummy_weights(shape: LlamaShape, dtype: torch.dtype, device: torch.device | str = "cpu",
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint-named random weights (std 0.02, unit norms), made on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d = shape.hidden_size, shape.head_dim
    q, kv, inter = shape.num_heads * d, shape.num_kv_heads * d, shape.intermediate_size

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    w = {"model.embed_tokens.weight": rand(shape.vocab_size, h), "model.norm.weight": ones(h)}
    if not shape.tie_word_embeddings:
        w["lm_head.weight"] = rand(shape.vocab_size, h)
    for i in range(shape.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        w.update({
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
            a + "q_proj.weight": rand(q, h), a + "k_proj.weight": rand(kv, h), a + "v_proj.weight": rand(kv, h),
            a + "o_proj.weight": rand(h, q), p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h), p + "mlp.down_proj.weight": rand(h, inter),
        })
        if shape.attention_bias:
            w.update({a + "q_proj.bias": rand(q), a + "k_proj.bias": rand(kv), a + "v_proj.bias": rand(kv)})
    return w


class LlamaModel:
    """Weights plus the forward pass; the KV cache is owned by the caller."""

    def __init__(
        self,
        shape: LlamaShape,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        max_len: int,
        device: torch.device | str = "cpu",
        kernels: Kernels | None = None,
        block_weights: bool = False,
    ) -> None:
        """``kernels`` None runs the CPU fast path; otherwise every hot spot goes
        through those kernels (Triton on CUDA, or the torch references).
        ``block_weights`` keeps projections that are exact GGUF blocks in that form
        (CPU fast path in float32 only)."""
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device(device)
        self.kernels = kernels
        if block_weights and not self.block_weights_possible(kernels, dtype, self.device):
            raise ValueError("block weights run on the CPU fast path in float32 only")
        w = {k: v.to(self.device, dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        head = self.embed if shape.tie_word_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]
        self.lm_head = _weight(head, block_weights)
        self.final_norm = w["model.norm.weight"]
        self.layers: list[LayerWeights] = []
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if shape.attention_bias and a + "q_proj.bias" in w:
                bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
            self.layers.append(
                LayerWeights(
                    input_norm=w[p + "input_layernorm.weight"],
                    qkv=_weight(torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]),
                                block_weights),
                    qkv_bias=bias,
                    o_proj=_weight(w[a + "o_proj.weight"], block_weights),
                    post_norm=w[p + "post_attention_layernorm.weight"],
                    gate_up=_weight(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                                    block_weights),
                    down=_weight(w[p + "mlp.down_proj.weight"], block_weights),
                )
            )
        cos, sin = cos_sin_table(shape.head_dim, shape.rope_theta, shape.rope_scaling, max_len)
        self.cos, self.sin = cos.to(self.device, dtype), sin.to(self.device, dtype)
        self.scale = shape.head_dim**-0.5
        # Small C kernels for RMSNorm, rotary and SiLU-mul on the CPU path (float32):
        # at decode sizes each torch op there is mostly dispatch overhead.
        self.c_ops = self.cpu_float32(kernels, dtype, self.device) and cpu_ops.available()
        # Decode-only steps run the whole layer loop in one C call where every piece has
        # its C kernel: the same calls without ~10 Python wrappers per layer.
        self.fuse_decode = self.c_ops and cpu_forward.available() and all(
            layer.qkv_bias is None and all(isinstance(w, BlockWeight) for w in (layer.qkv, layer.o_proj, layer.gate_up,
                                                                                  layer.down))
            for layer in self.layers
        )

    @staticmethod
    def cpu_float32(kernels: Kernels | None, dtype: torch.dtype, device: torch.device) -> bool:
        """The CPU fast path in float32: where the C kernels apply."""
        return kernels is None and dtype == torch.float32 and device.type == "cpu"

    @classmethod
    def block_weights_possible(cls, kernels: Kernels | None, dtype: torch.dtype, device: torch.device) -> bool:
        return cls.cpu_float32(kernels, dtype, device) and cpu_matmul.available()

    def projections(self) -> list[Weight]:
        return [self.lm_head, *(p for layer in self.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))]

    @property
    def projection_bytes(self) -> int:
        """Bytes of projection weights a decode step reads: the floor of its memory traffic."""
        return sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else p.nbytes
                   for p in self.projections())

    @property
    def num_block_weights(self) -> int:
        """How many projections stayed in GGUF blocks (0: all dense)."""
        return sum(not isinstance(p, torch.Tensor) for p in self.projections())

    @classmethod
    def dummy(cls, config: dict[str, Any], dtype: torch.dtype, max_len: int, device: torch.device | str = "cpu",
              kernels: Kernels | None = None, seed: int = 0) -> "LlamaModel":
        """Random weights for ``config``: throughput of any model size can be measured
        without downloading it."""
        shape = LlamaShape.from_config(config)
        return cls(shape, dummy_weights(shape, dtype, device, seed), dtype, max_len, device, kernels)

    @classmethod
    def load(cls, folder: Path, config: dict[str, Any], dtype: torch.dtype, max_len: int,
             device: torch.device | str = "cpu", kernels: Kernels | None = None,
             block_weights: bool = False) -> "LlamaModel":
        weights: dict[str, torch.Tensor] = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    weights[key] = f.get_tensor(key)
        if not weights:
            raise FileNotFoundError(f"no .safetensors files in {folder}")
        return cls(LlamaShape.from_config(config), weights, dtype, max_len, device, kernels, block_weights)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | KernelMetadata,
        logits_rows: torch.Tensor,  # [S] rows whose next-token logits are wanted
        fused: cpu_forward.DecodeLayers | None = None,
    ) -> torch.Tensor:
        """Run the batch through every layer; return float32 logits [S, vocab].

        ``fused``: the C layer loop over this ``kv_cache`` (see ``decode_layers``), which
        decode-only steps of the CPU path take instead of the Python loop."""
        if self.kernels is not None:
            assert isinstance(meta, KernelMetadata)
            return self._forward_kernels(self.kernels, input_ids, positions, kv_cache, meta, logits_rows)
        assert isinstance(meta, AttentionMetadata)
        s = self.shape
        cos, sin = self.cos[positions], self.sin[positions]
        norm = cpu_ops.rms_norm if self.c_ops else rms_norm
        h = self.embed[input_ids]
        d = meta.decode_rows
        if fused is not None and d is not None and d.rows is None:  # a decode-only step
            h = fused.run(h, cos, sin, meta.slot_mapping, d.block_tables, d.context_lens, torch.get_num_threads())
        else:
            h = self._cpu_layers(h, cos, sin, kv_cache, meta)
        h = norm(h.index_select(0, logits_rows), self.final_norm, s.rms_norm_eps)
        return _project(h, self.lm_head).float()

    def _cpu_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    kv_cache: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        s = self.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        norm = cpu_ops.rms_norm if self.c_ops else rms_norm
        for layer, (k_cache, v_cache) in zip(self.layers, kv_cache):
            x = norm(h, layer.input_norm, s.rms_norm_eps)
            qkv = _project(x, layer.qkv, layer.qkv_bias)
            # Q and K sit side by side in the fused projection: one rotary pass for both.
            qk = qkv[:, : q_size + kv_size].view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
            if self.c_ops:
                cpu_ops.rotary_(qk, cos, sin)
            else:
                qk = apply_rotary(qk, cos, sin)
            q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size :].view(-1, s.num_kv_heads, s.head_dim)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            h = _project_add(h, attn.reshape(-1, q_size), layer.o_proj)
            x = norm(h, layer.post_norm, s.rms_norm_eps)
            gate_up = _project(x, layer.gate_up)
            if self.c_ops:
                act = cpu_ops.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            h = _project_add(h, act, layer.down)
        return h

    def decode_layers(self, kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> cpu_forward.DecodeLayers:
        """The C layer loop over these weights and ``kv_cache`` (``fuse_decode`` must hold)."""
        layers = [(la.input_norm, la.qkv, la.o_proj, la.post_norm, la.gate_up, la.down) for la in self.layers]
        return cpu_forward.DecodeLayers(layers, kv_cache, self.shape.num_heads, self.shape.rms_norm_eps, self.scale)

    def _forward_kernels(
        self,
        ops: Kernels,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        meta: KernelMetadata,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """The same layers through ``ops``: residual add fused into each RMSNorm,
        K/V stored by slot, attention read straight from the pages."""
        s = self.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        delta, residual = self.embed[input_ids], None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_cache):
            x, residual = ops.add_rms_norm(delta, residual, layer.input_norm, s.rms_norm_eps)
            qkv = _project(x, layer.qkv, layer.qkv_bias)
            q = qkv[:, :q_size].view(-1, s.num_heads, s.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(-1, s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size :].view(-1, s.num_kv_heads, s.head_dim)
            q, k = ops.rotary(q, k, positions, self.cos, self.sin)
            ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            if meta.decode_only:
                attn = ops.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale)
            else:
                attn = ops.extend_attention(
                    q, k_cache, v_cache, meta.block_tables, meta.query_starts, meta.context_lens, self.scale
                )
            delta = _project(attn.reshape(-1, q_size), layer.o_proj)
            x, residual = ops.add_rms_norm(delta, residual, layer.post_norm, s.rms_norm_eps)
            gate, up = _project(x, layer.gate_up).chunk(2, dim=-1)
            delta = _project(F.silu(gate) * up, layer.down)
        rows = logits_rows.to(delta.device)
        h, _ = ops.add_rms_norm(delta.index_select(0, rows), residual.index_select(0, rows), self.final_norm,
                                s.rms_norm_eps)
        return _project(h, self.lm_head).float()
