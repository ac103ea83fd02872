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


TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Water boils at one hundred degrees Celsius at sea level because",
]


DECISIVE = 0.01  # a top-2 log-probability gap the cache's rounding cannot close (it moved them by 0.0023 at most)


def _decisive_prefix(tokens: list[int], logprobs: tuple) -> int:
    """How many of ``tokens`` come before the first one the reference chose by less than ``DECISIVE``."""
    for i, entry in enumerate(logprobs):
        if len(entry.top) > 1 and entry.top[0][1] - entry.top[1][1] < DECISIVE:
            return i
    return len(tokens)


def test_the_default_cache_gives_the_float32_caches_greedy_tokens_in_every_step_shape(tokenizer):
    """Whole prompts, prompts in 8-token chunks (later chunks read earlier ones from the float16
    pages), decode steps in the C loop, the prefix cache hit by the second round: the tokens of the
    same engine over a float32 cache, up to a position where that engine's top two were within
    ``DECISIVE`` (56 of the 72 tokens: the first prompt has such a near-tie at its ninth token, where
    the path's int16 activations already part from transformers). Agreement with transformers is
    measured teacher-forced in ``test_gguf_quality``."""
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(kv_cache_dtype="float32", speculative="off") as llm:
        ref = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [list(r.token_ids)[: _decisive_prefix(list(r.token_ids), r.logprobs)] for r in ref]
    assert sum(map(len, want)) >= 48  # most of the 72 tokens are decisive: the test compares something
    for budget in (2048, 8 + 3):  # three decode rows and an 8-token chunk a step
        with LLM(max_batch_tokens=budget, max_num_seqs=3, speculative="off") as llm:
            assert llm._engine.model.kv_dtype is torch.float16
            for _ in range(2):
                outs = llm.generate(prompts, params, use_tqdm=False)
                got = [list(o.outputs[0].token_ids) for o in outs]
                assert [g[: len(w)] for g, w in zip(got, want)] == want


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
