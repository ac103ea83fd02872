"""Gemma 2 (every other layer a sliding window, attention scores soft-capped as cap * tanh(s / cap),
norms around each block's output, GeGLU, a scaled embedding, ``1 + w`` norms, soft-capped logits)
through every backend, against ``transformers`` on the same random weights saved as a HF folder.

The attention cap is small (2.0) so that it bends most scores: without it the logits are far from
transformers' (checked, so the cap is shown to matter). The window is 8 tokens and the prompts up
to 40, so the windowed layers see part of what the global ones see. The projections are exact Q8_0
blocks: the CPU path runs them in its C layer loop, the cap included.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

from trillm.engine.execution.backends import create_backend
from trillm.engine.execution.gguf_header import read_header
from trillm.engine.execution.gguf_model import gguf_config
from trillm.engine.execution.gguf_support import check_servable
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.shape import ModelShape
from trillm.kernels import cpu_matmul

from tests.families import (
    GGUFFromFolder,
    c_loop_equals_python_loop,
    config_of,
    engine_serves_transformers_tokens,
    every_backend,
    save_random,
    steps_match_transformers,
    two_ranks_give_transformers_tokens,
)
from tests.test_gguf_quality import _all_logits

GEMMA2 = dict(
    vocab_size=49152,  # the default model's tokenizer, so the folder can be served
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,  # one windowed layer, one global: every kind, at half the time of four
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=16,
    sliding_window=8,
    attn_logit_softcapping=2.0,
    final_logit_softcapping=30.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory, model_dir):
    """Norms stored as w - 1 (around 0), the embedding small (scaled by sqrt(64) on the way in)."""
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(**GEMMA2)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.125)
    folder = save_random(model, tmp_path_factory.mktemp("gemma2"), model_dir, norm_offset=0.0)
    with torch.no_grad():  # larger Q and K: scores of several units, where the cap bends them
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    model.save_pretrained(folder)  # (the scaled values are still exact Q8_0: d scales with them)
    return folder


@pytest.fixture(scope="module")
def hf_gemma2(gemma2_dir):
    return Gemma2ForCausalLM.from_pretrained(gemma2_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_shape_reads_every_switch(gemma2_dir):
    shape = ModelShape.from_config(config_of(gemma2_dir))
    assert shape.layer_windows == (8, 0) and shape.local_rope_theta is None
    assert shape.attn_logit_softcap == 2.0 and shape.final_logit_softcap == 30.0
    assert not shape.qk_norm and shape.sandwich_norms and shape.norm_plus_one and shape.activation == "gelu_tanh"
    assert shape.scale == 16**-0.5 and shape.embed_scale == 8.0 and shape.rope_theta == 10_000.0


def test_the_cap_matters(gemma2_dir, hf_gemma2):
    """The same model without the attention cap is far from transformers; with it, within float error."""
    reference = create_backend("reference", torch.device("cpu"), torch.float32)
    model = DecoderModel.load(gemma2_dir, config_of(gemma2_dir), torch.float32, 256, backend=reference)
    ids = list(range(3, 83, 2))
    with torch.inference_mode():
        theirs = hf_gemma2(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids, 64), theirs, atol=5e-5, rtol=1e-4)
    model.shape = attrs.evolve(model.shape, attn_logit_softcap=None)
    assert (_all_logits(model, ids, 64) - theirs).abs().max() > 0.05


@pytest.mark.gpu
def test_every_step_matches_transformers_on_every_backend(gemma2_dir, hf_gemma2):
    models = every_backend(gemma2_dir)
    if "cpu-blocks" in models:  # blocks: decode steps in the C layer loop, the cap included
        assert models["cpu-blocks"].backend.fusable(models["cpu-blocks"])
    steps_match_transformers(models, hf_gemma2, GEMMA2["vocab_size"], max_tokens=12, atol=5e-5)


@pytest.mark.skipif(not cpu_matmul.available(), reason="needs a C compiler")
def test_the_c_layer_loop_runs_gemma2_bit_for_bit(gemma2_dir, monkeypatch):
    """The capped scores in the C loop: the Python loop's logits and KV, exactly."""
    c_loop_equals_python_loop(gemma2_dir, monkeypatch)


async def test_engine_loads_and_serves_the_folder(gemma2_dir, hf_gemma2):
    """Greedy tokens past the window, and the HTTP server answering from the folder."""
    model = await engine_serves_transformers_tokens(gemma2_dir, hf_gemma2, n=24)
    assert model.shape.attn_logit_softcap == 2.0


@pytest.mark.slow  # rank processes
async def test_tp_2_gives_transformers_greedy_tokens(gemma2_dir, hf_gemma2):
    """Two ranks, a KV head and two query heads each: the cap applies per head, as at one rank."""
    model = await two_ranks_give_transformers_tokens(gemma2_dir, hf_gemma2, n=16)
    assert model.shape.num_heads == 2


def _gemma2_gguf(folder, path) -> None:
    """The folder as llama.cpp's converter writes Gemma 2: norms stored as 1 + w, the embedding tied,
    the projections in Q8_0 (their values are exact Q8_0 blocks), the caps and window as keys."""
    out = GGUFFromFolder(folder, path, "gemma2", GEMMA2)
    w, writer, q8 = out.w, out.writer, out.q8
    writer.add_key_length(GEMMA2["head_dim"])
    writer.add_value_length(GEMMA2["head_dim"])
    writer.add_sliding_window(GEMMA2["sliding_window"])
    writer.add_attn_logit_softcapping(GEMMA2["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(GEMMA2["final_logit_softcapping"])

    writer.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", w["model.norm.weight"] + 1)
    norms = {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    for i in range(GEMMA2["num_hidden_layers"]):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in norms.items():
            writer.add_tensor(g + ours + ".weight", w[p + theirs + ".weight"] + 1)
        for ours, theirs in (
            ("attn_q", "q_proj"),
            ("attn_k", "k_proj"),
            ("attn_v", "v_proj"),
            ("attn_output", "o_proj"),
        ):
            q8(g + ours + ".weight", w[p + "self_attn." + theirs + ".weight"])
        for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            q8(g + ours + ".weight", w[p + "mlp." + theirs + ".weight"])
    out.close()


def test_a_gemma2_gguf_file_is_transformers(gemma2_dir, tmp_path):
    """llama.cpp's Gemma 2 layout: every other layer windowed, the caps from the file's keys, the
    score scale from the head size (a file has no query_pre_attn_scalar: transformers is given
    the head size too), the projections in their blocks, in the C layer loop."""
    path = tmp_path / "gemma2-q8_0.gguf"
    _gemma2_gguf(gemma2_dir, path)
    header = read_header(path)
    check_servable(header, available=1 << 40, native=True)
    config = gguf_config(header)
    shape = ModelShape.from_config(config)
    assert shape.layer_windows == (8, 0) and shape.attn_logit_softcap == 2.0 and shape.final_logit_softcap == 30.0
    assert shape.scale == GEMMA2["head_dim"] ** -0.5 and shape.norm_plus_one
    hf = Gemma2ForCausalLM.from_pretrained(
        gemma2_dir, dtype=torch.float32, attn_implementation="eager", query_pre_attn_scalar=GEMMA2["head_dim"]
    ).eval()
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.from_gguf(header, config, torch.float32, 256, backend=cpu, block_weights=True)
    assert cpu.fusable(model)
    ids = list(range(3, 45))
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids, 64), theirs, atol=1e-4, rtol=1e-4)
    assert (_all_logits(model, ids, 1).argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.95
