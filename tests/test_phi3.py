"""Phi-3 / Phi-4-mini (fused ``qkv_proj`` and ``gate_up_proj`` in the checkpoint, LongRoPE, a
partial rotary of 3/4 of each head as Phi-4-mini's, a sliding window as Phi-3-mini's) through
every backend and at two ranks, against ``transformers`` on the same random weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from trillm.engine.execution.backends import create_backend
from trillm.engine.execution.gguf_header import read_header
from trillm.engine.execution.gguf_model import gguf_config
from trillm.engine.execution.gguf_support import check_servable
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.rope import cos_sin_table
from trillm.engine.execution.shape import ModelShape

from tests.families import (
    GGUFFromFolder,
    config_of,
    engine_serves_transformers_tokens,
    every_backend,
    save_random,
    steps_match_transformers,
    two_ranks_give_transformers_tokens,
)
from tests.test_gguf_quality import _all_logits

HEAD_DIM, ROTARY = 32, 24
PHI3 = dict(
    vocab_size=49152,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    partial_rotary_factor=0.75,  # Phi-4-mini: 96 of 128
    max_position_embeddings=1024,
    original_max_position_embeddings=256,  # longer than the tests' sequences: the short factors apply
    rope_scaling={
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(ROTARY // 2)],
        "long_factor": [1.5 + 0.3 * i for i in range(ROTARY // 2)],
    },
    sliding_window=14,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, model_dir):
    torch.manual_seed(0)
    return save_random(Phi3ForCausalLM(Phi3Config(**PHI3)).eval(), tmp_path_factory.mktemp("phi3"), model_dir)


@pytest.fixture(scope="module")
def hf_phi3(phi3_dir):
    return Phi3ForCausalLM.from_pretrained(phi3_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_shape_reads_the_partial_rotary_longrope_and_window(phi3_dir):
    shape = ModelShape.from_config(config_of(phi3_dir))
    assert shape.head_dim == HEAD_DIM and shape.rope_dim == ROTARY and shape.layer_windows == (14, 14)
    assert shape.rope_scaling is not None and shape.rope_scaling["rope_type"] == "longrope"
    cos, _ = cos_sin_table(shape.rope_dim, shape.rope_theta, shape.rope_scaling, 1024)
    # The attention factor scales both tables: sqrt(1 + ln 4 / ln 256) from 1,024 over 256 positions.
    assert cos[0, 0].item() == pytest.approx((1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(256.0))) ** 0.5)
    # Past the original context the long factors turn slower frequencies.
    assert not torch.allclose(
        cos[300],
        cos_sin_table(
            ROTARY, shape.rope_theta, {**shape.rope_scaling, "long_factor": shape.rope_scaling["short_factor"]}, 1024
        )[0][300],
    )


@pytest.mark.gpu
def test_every_step_matches_transformers_on_every_backend(phi3_dir, hf_phi3):
    models = every_backend(phi3_dir)
    assert all(layer.qkv.shape[1] == (4 + 2 * 2) * HEAD_DIM for layer in models["reference"].layers)  # [in, out]
    steps_match_transformers(models, hf_phi3, PHI3["vocab_size"])


async def test_engine_loads_and_serves_the_folder(phi3_dir, hf_phi3):
    model = await engine_serves_transformers_tokens(phi3_dir, hf_phi3)
    assert model.cos.shape[1] == ROTARY


@pytest.mark.slow  # rank processes
async def test_tp_2_gives_transformers_greedy_tokens(phi3_dir, hf_phi3):
    """The fused checkpoint matrices are cut into Q, K, V and gate, up before each rank takes its heads."""
    model = await two_ranks_give_transformers_tokens(phi3_dir, hf_phi3)
    assert model.shape.num_heads == 2


def _phi3_gguf(folder, path) -> None:
    """The folder as llama.cpp's converter writes Phi-3: attn_qkv and ffn_up (gate and up) fused,
    the projections in Q8_0 (their values are exact Q8_0 blocks), LongRoPE's factors as tensors."""
    out = GGUFFromFolder(folder, path, "phi3", PHI3)
    w, writer, q8 = out.w, out.writer, out.q8
    writer.add_rope_dimension_count(ROTARY)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_scaling_orig_ctx_len(PHI3["original_max_position_embeddings"])
    writer.add_sliding_window(PHI3["sliding_window"])
    scaling = PHI3["rope_scaling"]
    writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))

    writer.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    writer.add_tensor("output.weight", w["lm_head.weight"])
    writer.add_tensor("output_norm.weight", w["model.norm.weight"])
    for i in range(PHI3["num_hidden_layers"]):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        writer.add_tensor(g + "attn_norm.weight", w[p + "input_layernorm.weight"])
        writer.add_tensor(g + "ffn_norm.weight", w[p + "post_attention_layernorm.weight"])
        q8(g + "attn_qkv.weight", w[p + "self_attn.qkv_proj.weight"])
        q8(g + "attn_output.weight", w[p + "self_attn.o_proj.weight"])
        q8(g + "ffn_up.weight", w[p + "mlp.gate_up_proj.weight"])
        q8(g + "ffn_down.weight", w[p + "mlp.down_proj.weight"])
    out.close()


def test_a_phi3_gguf_file_is_transformers(phi3_dir, hf_phi3, tmp_path):
    """llama.cpp's Phi-3 layout: the fused matrices cut in their blocks (exactly: a block never spans
    rows), the partial rotary from rope.dimension_count, LongRoPE from its factor tensors."""
    path = tmp_path / "phi3-q8_0.gguf"
    _phi3_gguf(phi3_dir, path)
    header = read_header(path)
    check_servable(header, available=1 << 40, native=True)
    config = gguf_config(header)
    shape = ModelShape.from_config(config)
    assert shape.rope_dim == ROTARY and shape.layer_windows == (14, 14)
    assert shape.rope_scaling is not None and shape.rope_scaling["rope_type"] == "longrope"
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.from_gguf(header, config, torch.float32, 256, backend=cpu, block_weights=True)
    assert model.num_block_weights == len(model.projections()) - 1  # all but the float32 head
    ids = list(range(3, 45))
    with torch.inference_mode():
        theirs = hf_phi3(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids, 64), theirs, atol=1e-4, rtol=1e-4)
