"""gpt-oss (a mixture with biases everywhere, a router whose softmax is over the top-k logits,
gate and up interleaved in one tensor per layer, a clamped SwiGLU with (up + 1), attention sinks,
sliding-window layers alternating with global ones, YaRN) through every backend and at two ranks,
against ``transformers`` on the same random bf16-free float32 weights."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

from trillm.engine.execution.shape import ModelShape
from trillm.kernels import cpu_decode, reference

from tests.families import (
    config_of,
    engine_serves_transformers_tokens,
    every_backend,
    save_random,
    steps_match_transformers,
    two_ranks_give_transformers_tokens,
)

GPT_OSS = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=10,
    layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=1024,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
        "rope_theta": 150000.0,
    },
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, model_dir):
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**GPT_OSS)).eval()
    folder = save_random(model, tmp_path_factory.mktemp("gpt_oss"), model_dir)
    return folder


@pytest.fixture(scope="module")
def hf_gpt_oss(gpt_oss_dir):
    return GptOssForCausalLM.from_pretrained(gpt_oss_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_shape_reads_sinks_biases_yarn_and_windows(gpt_oss_dir):
    shape = ModelShape.from_config(config_of(gpt_oss_dir))
    assert shape.attention_sinks and shape.output_bias and shape.attention_bias and shape.expert_bias
    assert shape.activation == "swiglu_oai" and shape.layer_windows == (10, 0)
    assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size) == (4, 2, 32)
    assert shape.rope_scaling is not None and shape.rope_scaling["rope_type"] == "yarn"


def test_sinks_in_the_c_decode_kernel_are_the_reference(gpt_oss_dir):
    """A sink per head joins each softmax's denominator, windows or not."""
    torch.manual_seed(1)
    heads, kv_heads, d, pages, page = 8, 2, 32, 6, 4
    q = torch.randn(3, heads, d)
    k_cache, v_cache = torch.randn(pages, page, kv_heads, d), torch.randn(pages, page, kv_heads, d)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0], [3, 2, 1, 0]], dtype=torch.int32)
    lens = torch.tensor([15, 6, 9], dtype=torch.int32)
    sinks = torch.randn(heads) * 2
    for window in (0, 5):
        want = reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.2, window, sinks)
        got = cpu_decode.decode_attention(q, k_cache, v_cache, tables, lens, 0.2, window, sinks)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        plain = reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.2, window)
        assert not torch.allclose(plain, want, atol=1e-3)  # the sinks change the result


@pytest.mark.gpu
def test_every_step_matches_transformers_on_every_backend(gpt_oss_dir, hf_gpt_oss):
    steps_match_transformers(every_backend(gpt_oss_dir), hf_gpt_oss, GPT_OSS["vocab_size"])


async def test_engine_loads_and_serves_the_folder(gpt_oss_dir, hf_gpt_oss):
    model = await engine_serves_transformers_tokens(gpt_oss_dir, hf_gpt_oss)
    assert all(layer.sinks is not None and layer.moe is not None for layer in model.layers)


@pytest.mark.slow  # rank processes
async def test_tp_2_gives_transformers_greedy_tokens(gpt_oss_dir, hf_gpt_oss):
    """Two ranks: each its heads' sinks and its slice of every expert; O's and the experts' down
    biases added once, after the all-reduce."""
    model = await two_ranks_give_transformers_tokens(gpt_oss_dir, hf_gpt_oss)
    assert model.shape.num_heads == 2 and model.layers[0].sinks.shape == (2,)
