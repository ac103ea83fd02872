"""Our decoder-only model over the paged KV cache: every family ``shape.ModelShape`` describes
(Llama, Mistral, Qwen2, Qwen3, SmolLM2, Gemma 2, Gemma 3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss), one
implementation read by its switches.

Weights are plain tensors held by the model; Q/K/V and gate/up projections are fused into one
matmul each at load time. ``transformers`` supplies only the config. The model embeds tokens and
projects logits; its backend (``backends/``), chosen by the composition root (``loading.py``) and
handed in, runs the decoder layers. Where the backend allows it (the CPU fast path in float32),
projections whose values are exactly GGUF blocks stay in those blocks (``kernels/block_weights.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open

from trillm.engine.execution.backends import Backend, KVCache
from trillm.engine.execution.checkpoint_names import canonical_names, text_name
from trillm.engine.execution.dummy_weights import dummy_weights
from trillm.engine.execution.experts import blocks_groupable
from trillm.engine.execution.file_checks import check_finite, cure_for
from trillm.engine.execution.gguf_header import GGUFHeader
from trillm.engine.execution.gguf_model import gguf_weights
from trillm.engine.execution.layers import (
    LayerWeights,
    MoEWeights,
    Weight,
    embed_rows,
    fuse,
    half_rows,
    kept_half,
    make_weight,
    soft_cap,
    transposed,
    weight_bytes,
)
from trillm.engine.execution.parallel.group import SINGLE, TensorParallel
from trillm.engine.execution.parallel.sharding import local_shape, shard_weights
from trillm.engine.execution.rope import RotaryTable
from trillm.engine.execution.shape import ModelShape
from trillm.engine.step import StepMetadata
from trillm.kernels.stacked import Stacked, nbytes


def fingerprint(weights: dict[str, Any]) -> str:
    """What must be equal on every tensor-parallel rank: the tensors' names, shapes and dtypes,
    and a sample of their values (reading a whole 70B checkpoint again would cost minutes)."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        w = weights[name]
        fields = (w,) if isinstance(w, torch.Tensor) else attrs.astuple(w, recurse=False)
        t = next(f for f in fields if isinstance(f, torch.Tensor))  # of blocks: their first tensor
        digest.update(f"{name}:{type(w).__name__}:{tuple(w.shape)}:{t.dtype}".encode())
        digest.update(t.reshape(-1)[:64].float().cpu().numpy().tobytes())
    return digest.hexdigest()


class DecoderModel:
    """Weights, the embedding and the LM head; the backend runs the layers. The KV cache
    is owned by the caller."""

    def __init__(
        self,
        shape: ModelShape,
        weights: dict[str, Any],
        dtype: torch.dtype,
        max_len: int,
        device: torch.device | str = "cpu",
        *,
        backend: Backend,
        block_weights: bool = False,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """``backend``: what runs the layers (``backends.create_backend`` makes one from the
        ``--kernels`` setting), for ``device`` and ``dtype``. ``block_weights`` keeps
        projections that are exact GGUF blocks in that form, where the backend can run them.
        ``tp``: this model is one rank's shard (``parallel/sharding.py``): ``shape`` is the
        rank's own, ``weights`` already cut to it."""
        self.shape = shape
        self.tp = tp
        self.fingerprint = ""  # of the whole checkpoint (``sharded``): ranks compare it at start
        self.dtype = dtype
        self.kv_dtype = dtype  # the KV cache's (``dtype_choice.choose_kv_dtype``: float16 where CPUs serve blocks)
        self.device = torch.device(device)
        self.backend = backend
        if (self.backend.device.type, self.backend.dtype) != (self.device.type, dtype):
            raise ValueError(
                f"a backend for {self.backend.device} {self.backend.dtype} cannot run a model "
                f"on {self.device} in {dtype}"
            )
        if block_weights and not self.backend.supports_block_weights:
            raise ValueError("block weights run on the CPU fast path in float32 only")
        # Tensors move to the device and dtype; weights a GGUF file keeps in blocks stay as they are, and so
        # do a bfloat16 / float16 checkpoint's matrices where blocks are asked, in one process
        # (``layers.half_rows``; a rank's shard of the embedding is looked up by the group instead).
        keep_half = block_weights and tp.size == 1 and self.device.type == "cpu"
        w = {
            k: v.to(self.device, dtype) if isinstance(v, torch.Tensor) and not (keep_half and kept_half(k, v)) else v
            for k, v in weights.items()
        }
        if shape.norm_plus_one:  # Gemma's checkpoints store w - 1: the norms multiply by 1 + w
            for key in [k for k in w if k.endswith("norm.weight")]:
                w[key] = (1.0 + w[key].float()).to(dtype)
        embed = w["model.embed_tokens.weight"]
        self.embed = half_rows(embed) if keep_half and kept_half("model.embed_tokens.weight", embed) else embed
        head = self.embed if shape.tie_word_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]
        self.lm_head = make_weight(head, block_weights) if isinstance(head, torch.Tensor) else head
        self.final_norm = w["model.norm.weight"]
        # A sequence classifier's head (``*ForSequenceClassification``: [labels, hidden]), applied by
        # ``/v1/rerank`` and ``/v1/score`` to the last prompt token's final-normed hidden state.
        score = weights.get("score.weight")
        self.classifier = score.float().cpu() if isinstance(score, torch.Tensor) else None
        self.layers: list[LayerWeights] = []
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if shape.attention_bias and a + "q_proj.bias" in w:
                bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
            # With norms around each block's output (Gemma), post_attention_layernorm is the
            # attention output's, and the MLP's input norm is pre_feedforward_layernorm.
            sandwich = shape.sandwich_norms
            pre_mlp = p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")
            moe = self._experts(w, i, block_weights) if shape.is_moe(i) else None
            self.layers.append(
                LayerWeights(
                    input_norm=w[p + "input_layernorm.weight"],
                    qkv=fuse([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]], block_weights),
                    qkv_bias=bias,
                    o_proj=fuse([w[a + "o_proj.weight"]], block_weights),
                    post_norm=w[pre_mlp],
                    gate_up=None
                    if moe
                    else fuse([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], block_weights),
                    down=None if moe else fuse([w[p + "mlp.down_proj.weight"]], block_weights),
                    q_norm=w[a + "q_norm.weight"] if shape.qk_norm else None,
                    k_norm=w[a + "k_norm.weight"] if shape.qk_norm else None,
                    attn_out_norm=w[p + "post_attention_layernorm.weight"] if sandwich else None,
                    mlp_out_norm=w[p + "post_feedforward_layernorm.weight"] if sandwich else None,
                    moe=moe,
                    sinks=w[a + "sinks"].float().contiguous() if shape.attention_sinks else None,
                    o_bias=w.get(a + "o_proj.bias") if shape.output_bias else None,
                )
            )
        self.rope = RotaryTable.make(shape.rope_dim, shape.rope_theta, shape.rope_scaling, max_len, self.device, dtype)
        local = shape.local_rope_theta  # Gemma 3's windowed layers rotate by their own base (no scaling)
        self.local_rope = (
            self.rope if local is None else RotaryTable.make(shape.rope_dim, local, None, max_len, self.device, dtype)
        )
        self.scale = shape.scale
        self.embed_scale = torch.tensor(shape.embed_scale, dtype=dtype)  # rounded as the checkpoint's model does

    def _experts(self, w: dict[str, Any], layer: int, block_weights: bool) -> MoEWeights:
        """Layer ``layer``'s mixture: its router (kept dense) and each expert's fused gate/up and down."""
        p = f"model.layers.{layer}.mlp."
        experts = range(self.shape.num_experts)
        gate_up = [
            fuse([w[f"{p}experts.{e}.gate_proj.weight"], w[f"{p}experts.{e}.up_proj.weight"]], block_weights)
            for e in experts
        ]
        down = [fuse([w[f"{p}experts.{e}.down_proj.weight"]], block_weights) for e in experts]
        stacks: list[torch.Tensor | None] = [None, None]
        for i, mats in enumerate((gate_up, down)):
            if all(isinstance(m, torch.Tensor) for m in mats):  # dense: one tensor, the list its views
                stacks[i] = torch.stack(mats)  # type: ignore[arg-type]
                mats[:] = list(stacks[i].unbind(0))  # type: ignore[union-attr]
        return MoEWeights(
            router=transposed(w[p + "gate.weight"]),
            gate_up=gate_up,
            down=down,
            top_k=self.shape.experts_per_token,
            normalize=self.shape.normalize_top_k,
            router_bias=w.get(p + "gate.bias"),
            gate_up_bias=torch.stack(
                [torch.cat([w[f"{p}experts.{e}.{x}_proj.bias"] for x in ("gate", "up")]) for e in experts]
            )
            if self.shape.expert_bias
            else None,
            down_bias=torch.stack([w[f"{p}experts.{e}.down_proj.bias"] for e in experts])
            if self.shape.expert_bias
            else None,
            gate_up_stack=stacks[0],
            down_stack=stacks[1],
            grouped_blocks=blocks_groupable(gate_up, down),
            **(self._shared_expert(w, p, block_weights) if self.shape.shared_expert_intermediate_size else {}),
        )

    @staticmethod
    def _shared_expert(w: dict[str, Any], p: str, block_weights: bool) -> dict[str, Any]:
        """Qwen2-MoE's shared expert (``p``: the layer's ``mlp.``): its gated MLP and its gate."""
        s = p + "shared_expert."
        return dict(
            shared_gate_up=fuse([w[s + "gate_proj.weight"], w[s + "up_proj.weight"]], block_weights),
            shared_down=fuse([w[s + "down_proj.weight"]], block_weights),
            shared_gate=transposed(w[p + "shared_expert_gate.weight"]),
        )

    def projections(self) -> list[Weight]:
        """Every matrix: the LM head and each layer's (the experts' included)."""
        return [self.lm_head, *(p for layer in self.layers for p in layer.projections())]

    cos = property(lambda self: self.rope.whole()[0])  # the whole tables, for the kernels (made to max_len)
    sin = property(lambda self: self.rope.whole()[1])
    local_cos = property(lambda self: self.local_rope.whole()[0])  # Gemma 3's windowed layers'; else cos
    local_sin = property(lambda self: self.local_rope.whole()[1])

    @property
    def resident_bytes(self) -> int:
        """Bytes the weights take, each storage once (a tied head, the experts' views of their
        stack): with the KV pool, what loading this model costs (``Engine.footprint_bytes``)."""
        seen: dict[object, int] = {}

        def count(w: object) -> None:
            if isinstance(w, torch.Tensor):
                storage = w.untyped_storage()
                seen[("storage", storage.data_ptr())] = storage.nbytes()
            elif isinstance(w, Stacked):
                for part in w.parts:
                    count(part)
            elif w is not None:
                seen[id(w)] = nbytes(w)

        for w in [self.embed, self.final_norm, *self.projections()]:
            count(w)
        for layer in self.layers:
            values = attrs.astuple(layer, recurse=False)
            if layer.moe is not None:
                values += attrs.astuple(layer.moe, recurse=False)
            for value in values:
                if isinstance(value, torch.Tensor):
                    count(value)
        return sum(seen.values())

    @property
    def projection_bytes(self) -> int:
        """Bytes of projection weights a one-token decode step reads (of a mixture's experts, the
        ``top_k`` it runs): the floor of its memory traffic."""
        return weight_bytes(self.lm_head) + sum(layer.active_bytes() for layer in self.layers)

    @property
    def num_block_weights(self) -> int:
        """How many projections stayed in GGUF blocks (0: all dense)."""
        return sum(not isinstance(p, torch.Tensor) for p in self.projections())

    @classmethod
    def dummy(
        cls,
        config: dict[str, Any],
        dtype: torch.dtype,
        max_len: int,
        device: torch.device | str = "cpu",
        *,
        backend: Backend,
        seed: int = 0,
        tp: TensorParallel = SINGLE,
    ) -> DecoderModel:
        """Random weights for ``config``: throughput of any model size can be measured
        without downloading it. Every rank makes the whole model's (same seed) and keeps its part."""
        return cls.sharded(
            ModelShape.from_config(config),
            lambda shape: dummy_weights(shape, dtype, device, seed),
            dtype,
            max_len,
            device,
            backend=backend,
            block_weights=False,
            tp=tp,
        )

    @classmethod
    def sharded(
        cls,
        shape: ModelShape,
        weights: Callable[[ModelShape], dict[str, Any]],
        dtype: torch.dtype,
        max_len: int,
        device: torch.device | str,
        *,
        backend: Backend,
        block_weights: bool,
        tp: TensorParallel,
    ) -> DecoderModel:
        """The model of the whole ``shape``, or ``tp``'s rank's shard of it: ``weights`` (of the whole
        model) are cut before they are moved or fused, and the rest freed."""
        whole = canonical_names(weights(shape), shape, blocks=block_weights and tp.part is None)
        if tp.part is None:
            model = cls(shape, whole, dtype, max_len, device, backend=backend, block_weights=block_weights)
        else:
            mine = shard_weights(whole, shape, tp.part)
            part = local_shape(shape, tp.part)
            model = cls(part, mine, dtype, max_len, device, backend=backend, block_weights=block_weights, tp=tp)
        model.fingerprint = fingerprint(whole)
        return model

    @classmethod
    def load(
        cls,
        folder: Path,
        config: dict[str, Any],
        dtype: torch.dtype,
        max_len: int,
        device: torch.device | str = "cpu",
        *,
        backend: Backend,
        block_weights: bool = False,
        tp: TensorParallel = SINGLE,
    ) -> DecoderModel:
        def read(shape: ModelShape) -> dict[str, torch.Tensor]:
            weights: dict[str, torch.Tensor] = {}
            cure = cure_for(folder)
            for file in sorted(folder.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        name = text_name(key)
                        if name is None:
                            continue  # an image-and-text checkpoint's vision part: the text model is served
                        weights[name] = f.get_tensor(key)
                        check_finite(file, key, weights[name], cure)  # damaged weights are refused, not served
            if not weights:
                raise FileNotFoundError(f"no .safetensors files in {folder}")
            return weights

        shape = ModelShape.from_config(config)
        return cls.sharded(shape, read, dtype, max_len, device, backend=backend, block_weights=block_weights, tp=tp)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, torch.Tensor):
            h = self.tp.embed(self.embed, ids)
        else:
            h = embed_rows(self.embed, ids)  # in blocks: one process, decoded row by row
        return h if self.shape.embed_scale == 1.0 else h.mul_(self.embed_scale.to(h.device))

    @classmethod
    def from_gguf(
        cls,
        header: GGUFHeader,
        config: dict[str, Any],
        dtype: torch.dtype,
        max_len: int,
        device: torch.device | str = "cpu",
        *,
        backend: Backend,
        block_weights: bool = False,
        tp: TensorParallel = SINGLE,
        activation_bits: int = 16,
        prefault: bool = False,
        huge_pages: bool = False,
    ) -> DecoderModel:
        """The model of a GGUF file, its matrices kept in the file's blocks with ``block_weights``
        (in one process: tensor-parallel ranks cut dense weights, and keep what is exactly Q4_1 or
        Q8_0 in those blocks), else decoded to ``dtype``; the rest as ``gguf_model.gguf_weights`` takes them."""
        in_blocks = block_weights and tp.part is None
        shape = ModelShape.from_config(config)

        def read(shape: ModelShape) -> dict[str, Any]:
            return gguf_weights(header, in_blocks, activation_bits, prefault, huge_pages)

        return cls.sharded(shape, read, dtype, max_len, device, backend=backend, block_weights=block_weights, tp=tp)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: StepMetadata,  # as the backend's ``prepare`` made it
        logits_rows: torch.Tensor,  # [S] rows whose next-token logits are wanted
        bound: Any = None,
    ) -> torch.Tensor:
        """Run the batch through every layer; return float32 logits [S, vocab].

        ``bound``: what the backend's ``bind`` made for this ``kv_cache``, if the caller
        keeps it (the runner does; on the CPU path, the C layer loop of decode steps)."""
        return self.forward_with_hidden(input_ids, positions, kv_cache, meta, logits_rows, None, bound)[0]

    def forward_with_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: StepMetadata,
        logits_rows: torch.Tensor,
        hidden_rows: torch.Tensor | None,
        bound: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``'s logits, and the final-normed hidden states of ``hidden_rows`` (float32
        [H, hidden]: what embeddings pool, as transformers' ``last_hidden_state``), which skip the head."""
        rows = logits_rows if hidden_rows is None else torch.cat([logits_rows, hidden_rows])
        h = self.backend.run_layers(self, self._embed(input_ids), positions, kv_cache, meta, rows, bound)
        sampled = logits_rows.shape[0]
        heads = h[:sampled] if hidden_rows is not None else h
        logits = self.tp.gather_vocab(self.backend.head(heads, self.lm_head, self.backend.kernel_rows(meta)).float())
        hidden = h[sampled:].float() if hidden_rows is not None else None
        return soft_cap(logits, self.shape.final_logit_softcap), hidden
