"""Gemma 3 (interleaved sliding-window and global layers with their own rope bases, per-head Q/K
norms, norms around each block's output, GeGLU, a scaled embedding, ``1 + w`` norms, scores
scaled by ``query_pre_attn_scalar``, soft-capped logits) through every backend, against
``transformers`` on the same random weights saved as a HF folder.

The window is 8 tokens and the prompts 3 to 40, so windowed layers see only part of what the
global layer sees, in prefill chunks, in decode steps and across a cached prefix. The folder's
projections are exact Q8_0 blocks, so the CPU path also runs them as blocks in its C layer loop.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from trillm.engine.execution.backends import create_backend
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.shape import ModelShape
from trillm.kernels import cpu_matmul

from tests.families import (
    c_loop_equals_python_loop,
    config_of,
    engine_serves_transformers_tokens,
    every_backend,
    save_random,
    steps_match_transformers,
    two_ranks_give_transformers_tokens,
)
from tests.test_gguf_quality import _all_logits

GEMMA3 = dict(
    vocab_size=49152,  # the default model's tokenizer, so the folder can be served
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,  # != head_dim: the scale is read from the config
    sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    final_logit_softcapping=30.0,  # Gemma 3 ships none; the switch is tested here
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, model_dir):
    """Norms stored as w - 1 (around 0), the embedding small (scaled by sqrt(64) on the way in)."""
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.125)
    return save_random(model, tmp_path_factory.mktemp("gemma3"), model_dir, norm_offset=0.0)


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_dir):
    return Gemma3ForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_shape_reads_every_switch(gemma3_dir):
    shape = ModelShape.from_config(config_of(gemma3_dir))
    assert shape.layer_windows == (8, 8, 0, 8)
    assert [shape.local_rope(i) for i in range(4)] == [True, True, False, True]
    assert shape.rope_theta == 1_000_000.0 and shape.local_rope_theta == 10_000.0
    assert shape.qk_norm and shape.sandwich_norms and shape.norm_plus_one and shape.activation == "gelu_tanh"
    assert shape.scale == 24**-0.5 and shape.embed_scale == 8.0 and shape.final_logit_softcap == 30.0
    assert shape.tie_word_embeddings and not shape.attention_bias


def test_older_configs_and_what_is_not_served():
    """A config of the sliding_window_pattern era; an activation not served is refused in one line."""
    old = {
        **{k: v for k, v in GEMMA3.items() if k != "layer_types"},
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 7,
        "sliding_window_pattern": 6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    shape = ModelShape.from_config(old)
    assert shape.layer_windows == (8, 8, 8, 8, 8, 0, 8)
    assert shape.rope_scaling == {"rope_type": "linear", "factor": 8.0} and shape.local_rope_theta == 10_000.0
    assert ModelShape.from_config({**old, "attn_logit_softcapping": 50.0}).attn_logit_softcap == 50.0
    with pytest.raises(ValueError, match="activation"):
        ModelShape.from_config({**old, "hidden_activation": "relu"})


@pytest.mark.gpu
def test_every_step_matches_transformers_on_every_backend(gemma3_dir, hf_gemma3):
    models = every_backend(gemma3_dir)
    if "cpu-blocks" in models:  # blocks: decode steps in the C layer loop, windows and output norms included
        assert models["cpu-blocks"].backend.fusable(models["cpu-blocks"])
    steps_match_transformers(models, hf_gemma3, GEMMA3["vocab_size"], max_tokens=12, atol=5e-5)


@pytest.mark.skipif(not cpu_matmul.available(), reason="needs a C compiler")
def test_the_c_layer_loop_runs_gemma_bit_for_bit(gemma3_dir, monkeypatch):
    """Windows, local rope, output norms and GeGLU in the C loop: the Python loop's logits and KV, exactly."""
    c_loop_equals_python_loop(gemma3_dir, monkeypatch)


async def test_engine_loads_and_serves_the_folder(gemma3_dir, hf_gemma3):
    """Greedy tokens past the window, and the HTTP server answering from the folder."""
    model = await engine_serves_transformers_tokens(gemma3_dir, hf_gemma3, n=24)
    assert model.shape.layer_windows == (8, 8, 0, 8)


@pytest.mark.slow  # rank processes
async def test_tp_2_gives_transformers_greedy_tokens(gemma3_dir, hf_gemma3):
    """Two ranks, a KV head and two query heads each: per-head norms, windows and the output norms
    (after the all-reduce) as at one rank."""
    model = await two_ranks_give_transformers_tokens(gemma3_dir, hf_gemma3, n=16)
    assert model.shape.num_heads == 2


@pytest.fixture(scope="module")
def gemma3_multimodal_dir(tmp_path_factory, model_dir):
    """An image-and-text checkpoint (``Gemma3ForConditionalGeneration``, as google/gemma-3-4b-it and
    larger are published): the language model under ``language_model.model.*``, a SigLIP tower beside it."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(4)
    text = {k: v for k, v in GEMMA3.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    config = Gemma3Config(
        text_config=text,
        vision_config={**vision, "patch_size": 14},
        mm_tokens_per_image=4,
        boi_token_index=49149,
        eoi_token_index=49150,
        image_token_index=49151,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.mul_(0.125)
    return save_random(model, tmp_path_factory.mktemp("gemma3mm"), model_dir, norm_offset=0.0)


async def test_an_image_and_text_checkpoint_serves_its_language_model(gemma3_multimodal_dir):
    """Its text config (defaults filled as transformers fills them) and its language model's weights,
    the vision tower not read: text-only logits and greedy tokens as transformers' whole model gives."""
    from transformers import Gemma3ForConditionalGeneration

    folder = gemma3_multimodal_dir
    raw = config_of(folder)
    assert raw["architectures"] == ["Gemma3ForConditionalGeneration"] and "text_config" in raw
    shape = ModelShape.from_config(raw)
    assert shape.layer_windows == (8, 8, 0, 8) and shape.qk_norm and shape.scale == 24**-0.5
    hf = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    reference = create_backend("reference", torch.device("cpu"), torch.float32)
    model = DecoderModel.load(folder, raw, torch.float32, 256, backend=reference)
    ids = list(range(5, 45))
    with torch.inference_mode():
        theirs = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids, 64), theirs, atol=5e-5, rtol=1e-4)
    served = await engine_serves_transformers_tokens(folder, hf, n=12)
    assert served.num_block_weights == len(served.projections()) - 1  # every text projection; the tied head not
