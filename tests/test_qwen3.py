"""Qwen3 (per-head Q/K RMSNorm, ``head_dim`` apart from hidden / heads, no QKV bias) through
every backend, against ``transformers`` on the same random weights saved as a HF folder.

The folder's projections are exact Q8_0 blocks, so the CPU path also runs them as block
weights: its C layer loop has no Q/K norm, and must leave Qwen3 to the Python loop.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trillm.engine.execution.backends import create_backend
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_runner import kv_bytes_per_token
from trillm.engine.execution.shape import ModelShape

from tests.families import engine_serves_transformers_tokens, every_backend, q8_0_exact, steps_match_transformers

QWEN3 = dict(
    vocab_size=49152,  # the default model's tokenizer, so the folder can be served
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # != 64 / 4: Q is 128 wide, o_proj maps 128 back to 64
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


_q8_0_exact = q8_0_exact


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, model_dir):
    """A HF folder: config, safetensors written by transformers, the default model's tokenizer."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # unit norms would hide a missing or misplaced norm
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.split(".")[-2] in PROJECTIONS:
                p.copy_(_q8_0_exact(p))
    folder = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def hf_qwen3(qwen3_dir):
    return Qwen3ForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_shape_reads_head_dim_norms_and_no_bias(qwen3_dir):
    shape = ModelShape.from_config(_config(qwen3_dir))
    assert shape.head_dim == 32 and shape.qk_norm and not shape.attention_bias and shape.tie_word_embeddings
    assert shape.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 32 * 4  # K and V, layers, kv heads, head_dim
    reference = create_backend("reference", torch.device("cpu"), torch.float32)
    model = DecoderModel.load(qwen3_dir, _config(qwen3_dir), torch.float32, 256, backend=reference)
    assert kv_bytes_per_token(model) == shape.kv_bytes_per_token(torch.float32)
    assert model.projection_bytes == shape.dense_projection_bytes(torch.float32)
    assert all(layer.q_norm is not None and layer.q_norm.shape == (32,) for layer in model.layers)


@pytest.mark.gpu
def test_every_step_matches_transformers_on_every_backend(qwen3_dir, hf_qwen3):
    models = every_backend(qwen3_dir)
    if "cpu-blocks" in models:
        blocks = models["cpu-blocks"]
        assert blocks.num_block_weights == len(blocks.projections()) - 1  # all but the (inexact) tied head
        # Blocks: decode steps in the C layer loop, Q/K head norms included; dense: the Python loop.
        assert blocks.backend.fusable(blocks) and not models["cpu"].backend.fusable(models["cpu"])
    steps_match_transformers(models, hf_qwen3, QWEN3["vocab_size"], max_tokens=8, atol=5e-5)


async def test_engine_loads_and_serves_the_folder(qwen3_dir, hf_qwen3):
    """``--model FOLDER`` end to end: the engine's greedy tokens are transformers', and the
    HTTP server answers a completion from the folder's tokenizer and template."""
    model = await engine_serves_transformers_tokens(qwen3_dir, hf_qwen3, n=10)
    assert model.shape.qk_norm
