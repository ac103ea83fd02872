"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral) through every backend, against ``transformers``
on the same random weights saved as a HF folder: the router's softmax and top-k, renormalised or
not, experts gathered per token, Qwen3-MoE's dense layers beside its mixtures, Qwen2-MoE's shared
expert (gated by a sigmoid) and Q/K/V biases, Mixtral's checkpoint names
(``block_sparse_moe.experts.E.w1``) and its sliding window; at ``--tp 1`` and ``--tp 2`` (every
expert, the shared one too, split over the ranks).

The experts are exact Q8_0 blocks, so the CPU path also runs them as blocks (in the Python loop:
the C loop has no router).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from trillm.engine.execution.backends import create_backend
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.shape import ModelShape

from tests.families import (
    config_of,
    engine_serves_transformers_tokens,
    every_backend,
    save_random,
    steps_match_transformers,
    two_ranks_give_transformers_tokens,
)

COMMON = dict(
    vocab_size=49152,  # the default model's tokenizer, so the folder can be served
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            **COMMON,
            head_dim=32,
            intermediate_size=96,  # the dense layer's
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            mlp_only_layers=[1],  # a dense MLP between two mixtures
            tie_word_embeddings=True,
        ),
    ),
    "qwen2_moe": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig(
            **COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,  # whole Q8_0 blocks in the down projection
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,  # Qwen1.5-MoE's: the top-k probabilities as the softmax gave them
            decoder_sparse_step=1,
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(
            **COMMON,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=12,  # every layer windowed
            tie_word_embeddings=False,
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_dir(request, tmp_path_factory, model_dir):
    cls, config = FAMILIES[request.param]
    torch.manual_seed(0)
    return save_random(cls(config).eval(), tmp_path_factory.mktemp(request.param), model_dir)


@pytest.fixture(scope="module")
def hf_moe(moe_dir):
    config = config_of(moe_dir)
    classes = {cls.__name__: cls for cls, _ in FAMILIES.values()}
    cls = classes[config["architectures"][0]]
    return cls.from_pretrained(moe_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_shape_reads_the_mixture(moe_dir):
    shape = ModelShape.from_config(config_of(moe_dir))
    if shape.shared_expert_intermediate_size:  # Qwen2-MoE
        assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size) == (6, 2, 32)
        assert shape.shared_expert_intermediate_size == 64 and shape.attention_bias and not shape.qk_norm
        assert not shape.normalize_top_k and shape.dense_layers == () and not shape.layer_windows
    elif shape.qk_norm:  # Qwen3-MoE
        assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size) == (8, 3, 32)
        assert shape.normalize_top_k and shape.dense_layers == (1,) and not shape.layer_windows
        assert [shape.is_moe(i) for i in range(3)] == [True, False, True]
    else:  # Mixtral
        assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size) == (4, 2, 64)
        assert shape.normalize_top_k and shape.layer_windows == (12, 12, 12)
    reference = create_backend("reference", torch.device("cpu"), torch.float32)
    model = DecoderModel.load(moe_dir, config_of(moe_dir), torch.float32, 256, backend=reference)
    # What one token's step reads: the top-k experts of each mixture, and the router.
    assert model.projection_bytes == shape.dense_projection_bytes(torch.float32)
    assert sum(layer.moe is not None for layer in model.layers) == sum(shape.is_moe(i) for i in range(3))


@pytest.mark.gpu
def test_every_step_matches_transformers_on_every_backend(moe_dir, hf_moe):
    models = every_backend(moe_dir)
    if "cpu-blocks" in models:
        blocks = models["cpu-blocks"]
        assert blocks.num_block_weights == len(blocks.projections()) - 1  # the experts too; the tied head not
    steps_match_transformers(models, hf_moe, COMMON["vocab_size"])


async def test_engine_loads_and_serves_the_folder(moe_dir, hf_moe):
    model = await engine_serves_transformers_tokens(moe_dir, hf_moe)
    assert any(layer.moe is not None for layer in model.layers)


@pytest.mark.slow  # rank processes
async def test_tp_2_gives_transformers_greedy_tokens(moe_dir, hf_moe):
    """Two ranks, each with its slice of every expert and the whole router: the partial sums of
    the mixture, all-reduced, give one rank's tokens."""
    model = await two_ranks_give_transformers_tokens(moe_dir, hf_moe)
    assert model.shape.num_heads == 2
