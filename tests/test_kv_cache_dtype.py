"""``--kv-cache-dtype``: which dtype the KV cache takes, what it costs in memory, and that the default
(float16 where the CPU path serves GGUF blocks) still gives ``transformers``' greedy tokens.

The kernels' side (each form read and stored alike by every path) is in ``test_cpu_decode``,
``test_flash_prefill`` and ``test_cpu_forward``; its agreement with ``transformers`` on a file of
every block type in ``test_gguf_quality``."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from trillm import LLM, SamplingParams
from trillm.engine.config import EngineConfig
from trillm.engine.execution import loading
from trillm.engine.execution.model_runner import ModelRunner, kv_bytes_per_token

pytestmark = pytest.mark.model


def test_the_default_model_gets_a_float16_cache_of_half_the_bytes(caplog):
    caplog.set_level(logging.INFO, logger="trillm.engine")
    model = loading.load_model(EngineConfig())[0]
    assert model.num_block_weights and model.kv_dtype is torch.float16
    assert "KV cache float16: auto" in caplog.text
    runner = ModelRunner(model, 8, 16)
    assert all(k.dtype is torch.float16 and v.dtype is torch.float16 for k, v in runner.kv_cache)
    assert runner._bound is not None  # the fused C decode loop takes a float16 cache
    assert 2 * kv_bytes_per_token(model) == model.shape.kv_bytes_per_token(torch.float32)


@pytest.mark.parametrize("asked", ["float32", "bfloat16", "float16"])
def test_a_dtype_asked_for_is_the_caches(asked):
    model = loading.load_model(EngineConfig(kv_cache_dtype=asked))[0]
    assert model.kv_dtype is getattr(torch, asked)
    runner = ModelRunner(model, 4, 16)
    assert runner.kv_cache[0][0].dtype is getattr(torch, asked)


def test_dense_float32_weights_keep_a_float32_cache(model_dir):
    """A float32 checkpoint served dense: the exact path, cache and all."""
    model = loading.load_model(EngineConfig(model=str(model_dir), weight_format="dense"))[0]
    assert model.num_block_weights == 0 and model.kv_dtype is torch.float32


def test_kernels_that_keep_the_models_dtype_refuse_another_before_loading(monkeypatch):
    def no_loading(*_args, **_kwargs):
        raise AssertionError("the refusal must come before any weight is read")

    monkeypatch.setattr(loading, "load_planned", no_loading)
    with pytest.raises(ValueError, match="--kv-cache-dtype float16: the reference kernels keep the KV cache"):
        loading.load_model(EngineConfig(kernels="reference", dtype="float32", kv_cache_dtype="float16"))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="float8")


def test_the_default_cache_gives_transformers_greedy_tokens_in_every_step_shape(model_dir):
    """Whole prompts, prompts in 8-token chunks (later chunks read earlier ones from the float16
    pages), decode steps in the C loop; the prefix cache hit by the second round."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [list(range(200, 260)), [1, 504, 2329, 282, 253, 1565, 30], list(range(1000, 1033))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = []
    for prompt in prompts:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
        want.append(out[0, len(prompt) :].tolist())
    for budget in (2048, 8 + 3):  # three decode rows and an 8-token chunk a step
        with LLM(max_batch_tokens=budget, max_num_seqs=3, speculative="off") as llm:
            assert llm._engine.model.kv_dtype is torch.float16
            for _ in range(2):
                outs = llm.generate(prompts, params, use_tqdm=False)
                assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_without_c_kernels_a_16_bit_cache_is_read_as_the_c_kernels_read_it(model_dir):
    """Where no C compiler exists the torch path gathers the pages and widens them: the logits of
    decode steps and of chunks beside a cached prefix are the C path's over the same cache form,
    within its rounding."""
    from trillm.engine.execution.backends import CpuBackend
    from trillm.engine.execution.model import DecoderModel

    from tests.test_gguf_quality import _all_logits

    config = json.loads((model_dir / "config.json").read_text())
    models = {
        c: DecoderModel.load(
            model_dir, config, torch.float32, 512, backend=CpuBackend(torch.device("cpu"), torch.float32, c)
        )
        for c in (True, False)
    }
    ids = list(range(300, 324))
    for kv_dtype, bound in ((torch.float16, 0.02), (torch.bfloat16, 0.1)):
        for chunk in (1, 7):  # a token a step (the C decode kernel, or gather + SDPA), then 7-token chunks
            logits = {}
            for c, model in models.items():
                model.kv_dtype = kv_dtype
                logits[c] = _all_logits(model, ids, chunk)
            # Not bit for bit: float32 differences of the two paths' kernels (~1e-6) move a K or V value
            # across a 16-bit rounding boundary now and then, and that one step (float16 5e-4, bfloat16
            # 4e-3 relative) is what reaches the logits; bytes misread would be whole units off.
            assert (logits[True] - logits[False]).abs().max() < bound
            assert (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean() >= 0.95
