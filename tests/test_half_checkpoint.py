"""A bfloat16 checkpoint on the CPU: served in float32 with its matrices kept as they are.

``--dtype auto`` on a bfloat16 Hugging Face folder once served it in bfloat16 through the Python
layer loop (20 tok/s on SmolLM2 at one stream where its weights allow ~100). Kept as BF16 rows
(``layers.half_rows``: 2 bytes a weight, what bfloat16 reads) in a float32 model, the projections
run in ``cpu_gguf``'s kernels and the fused C decode loop, and the values are the checkpoint's own:
logits equal ``transformers``' float32 upcast of the same weights, greedy tokens too.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from trillm.engine.config import EngineConfig
from trillm.engine.execution import dtype_choice, loading
from trillm.engine.execution.model_runner import ModelRunner
from trillm.kernels import cpu_gguf, cpu_matmul
from trillm.kernels.gguf_blocks import GGUFWeight
from trillm.kernels.stacked import Stacked

from tests.families import tiny_qwen3
from tests.test_gguf_quality import _all_logits

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not (cpu_gguf.available() and cpu_matmul.simd() != "plain"), reason="the block path"),
]


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, model_dir):
    """A tiny Qwen3 (q/k norms, tied embedding) saved in bfloat16, as most checkpoints on the Hub are."""
    folder = tiny_qwen3(tmp_path_factory.mktemp("bf16"), model_dir, seed=11, tie_word_embeddings=False)
    weights = load_file(folder / "model.safetensors")
    save_file({k: v.bfloat16() for k, v in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16", "dtype": "bfloat16"}))
    return folder


@pytest.fixture(scope="module")
def hf_model(bf16_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32).eval()


def _kinds(weight: object) -> set[str]:
    parts = weight.parts if isinstance(weight, Stacked) else (weight,)
    return {p.kind.name if isinstance(p, GGUFWeight) else type(p).__name__ for p in parts}


def test_auto_serves_it_in_float32_with_its_rows_kept(bf16_dir):
    config = EngineConfig(model=str(bf16_dir))
    plan = loading.plan_load(config)
    assert plan.dtype.dtype == torch.float32
    assert "bfloat16/float16 rows (2.00 bytes a weight" in plan.dtype.reason
    model = loading.load_planned(plan)[0]
    assert all(_kinds(w) == {"BF16"} for w in model.projections())
    assert _kinds(model.embed) == {"BF16"} and _kinds(model.lm_head) == {"BF16"}
    assert model.num_block_weights == len(model.projections())
    # 2 bytes a weight, as in bfloat16, not float32's 4
    assert model.projection_bytes == model.shape.dense_projection_bytes(torch.bfloat16)
    runner = ModelRunner(model, 64, 4)
    assert runner._bound is not None  # the fused C decode loop takes it


def test_its_logits_and_greedy_tokens_are_transformers_float32_ones(bf16_dir, hf_model):
    # a float32 cache: the exact path (the default float16 one: test_the_engine_gives_transformers_greedy_tokens)
    model = loading.load_model(EngineConfig(model=str(bf16_dir), gemm_dtype="float32", kv_cache_dtype="float32"))[0]
    ids = list(range(40, 140))
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0]
    for chunk in (100, 7, 1):  # one prefill; chunks beside a cached prefix; a token a step (the C loop)
        torch.testing.assert_close(_all_logits(model, ids, chunk), theirs, atol=2e-4, rtol=1e-4)


def test_the_engine_gives_transformers_greedy_tokens(bf16_dir, hf_model):
    from trillm import LLM, SamplingParams

    prompts = [list(range(5, 45)), [7, 8, 9], list(range(100, 119))]
    with LLM(str(bf16_dir), speculative="off") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16, pad_token_id=0
            )[0, len(prompt) :]
        assert list(out.outputs[0].token_ids) == ref.tolist()


def test_a_float32_checkpoint_is_still_probed_as_before(model_dir):
    """The default model's float32 folder: 4 bytes a weight, so the decode probe decides (not the rows)."""
    config = EngineConfig(model=str(model_dir), weight_format="auto")
    probed = dtype_choice.first_layer_bytes(model_dir)
    assert probed is not None and probed[0] < 2 * probed[1]  # its values are exact Q4_1/Q8_0 blocks
    choice = dtype_choice.choose_dtype(config, torch.device("cpu"), model_dir, {}, lambda *a: 1.0)
    assert choice.dtype == torch.float32 and "exact GGUF blocks" in choice.reason


def test_a_tensor_parallel_rank_converts_its_shard_so_the_probe_decides_as_before(bf16_dir):
    from tests.test_dtype_choice import amx_like

    config = EngineConfig(model=str(bf16_dir), tp=2)
    model_config = json.loads((bf16_dir / "config.json").read_text())
    choice = dtype_choice.choose_dtype(config, torch.device("cpu"), bf16_dir, model_config, amx_like)
    assert choice.dtype == torch.bfloat16 and "dense weights" in choice.reason  # 4 bytes a weight in float32


def test_a_half_matrix_not_kept_is_converted_to_float32():
    from trillm.engine.execution.layers import make_weight

    w = torch.randn(32, 64).bfloat16()
    dense = make_weight(w, blocks=False)
    assert isinstance(dense, torch.Tensor) and dense.dtype is torch.float32 and dense.shape == (64, 32)
    kept = make_weight(w, blocks=True)
    assert isinstance(kept, GGUFWeight) and kept.kind.name == "BF16" and kept.data.data_ptr() == w.data_ptr()
