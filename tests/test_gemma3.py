"""Gemma 3 (interleaved sliding-window and global layers with their own rope bases, per-head Q/K
norms, norms around each block's output, GeGLU, a scaled embedding, ``1 + w`` norms, scores
scaled by ``query_pre_attn_scalar``, soft-capped logits) through every backend, against
``transformers`` on the same random weights saved as a HF folder.

The window is 8 tokens and the prompts 3 to 40, so windowed layers see only part of what the
global layer sees, in prefill chunks, in decode steps and across a cached prefix. The folder's
projections are exact Q8_0 blocks, so the CPU path also runs them as blocks in its C layer loop.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import trio
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine
from trillm.engine.execution.backends import CpuBackend, create_backend
from trillm.engine.execution.loading import load_model
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_runner import ModelRunner
from trillm.engine.execution.shape import ModelShape
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.prefix_cache import PrefixCache
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.kernels import cpu_matmul

from tests.helpers import wait_idle
from tests.server import MODEL, client, in_thread, running_server
from tests.test_cpu_forward import _counting, _fused_equals_plain
from tests.test_qwen3 import PROJECTIONS, _q8_0_exact

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
PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 119)), list(range(5, 37))]  # the last shares 32 tokens


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, model_dir):
    """A HF folder: config, safetensors written by transformers, the default model's tokenizer."""
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA3)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # stored as w - 1: zeros would hide a missing or misplaced norm
                p.copy_(0.3 * torch.randn_like(p))
            elif name.split(".")[-2] in PROJECTIONS:
                p.copy_(_q8_0_exact(p))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(p * 0.125)  # scaled by sqrt(64) on the way in
    folder = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_dir):
    return Gemma3ForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_shape_reads_every_switch(gemma3_dir):
    shape = ModelShape.from_config(_config(gemma3_dir))
    assert shape.layer_windows == (8, 8, 0, 8)
    assert [shape.local_rope(i) for i in range(4)] == [True, True, False, True]
    assert shape.rope_theta == 1_000_000.0 and shape.local_rope_theta == 10_000.0
    assert shape.qk_norm and shape.sandwich_norms and shape.norm_plus_one and shape.activation == "gelu_tanh"
    assert shape.scale == 24**-0.5 and shape.embed_scale == 8.0 and shape.final_logit_softcap == 30.0
    assert shape.tie_word_embeddings and not shape.attention_bias


def test_older_configs_and_what_is_not_served():
    """A config of the sliding_window_pattern era; Gemma 2's attention soft-capping is refused in one line."""
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
    with pytest.raises(ValueError, match="soft-capping"):
        ModelShape.from_config({**old, "attn_logit_softcapping": 50.0})


def _device(backend: str) -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() and backend != "cpu" else "cpu")


def _models(folder) -> dict[str, DecoderModel]:
    cfg = _config(folder)
    models = {
        name: DecoderModel.load(
            folder, cfg, torch.float32, 256, _device(name), backend=create_backend(name, _device(name), torch.float32)
        )
        for name in ("cpu", "reference", "triton")
    }
    no_c = CpuBackend(torch.device("cpu"), torch.float32, c_kernels=False)
    models["cpu-torch"] = DecoderModel.load(folder, cfg, torch.float32, 256, backend=no_c)
    if cpu_matmul.available():
        cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
        models["cpu-blocks"] = DecoderModel.load(folder, cfg, torch.float32, 256, backend=cpu, block_weights=True)
    return models


@pytest.mark.gpu
def test_every_step_matches_transformers_on_every_backend(gemma3_dir, hf_gemma3):
    """Chunked prefills beside decodes and a cached prefix, step by step: every backend's
    logits equal transformers' within float32 tolerance, and their greedy tokens agree."""
    models = _models(gemma3_dir)
    allocator = PageAllocator(40)
    sched = Scheduler(allocator, 4, 8, 24, PrefixCache(allocator, 4))
    runners = {name: ModelRunner(model, 40, 4) for name, model in models.items()}
    if "cpu-blocks" in runners:  # blocks: decode steps in the C layer loop, windows and output norms included
        assert runners["cpu-blocks"]._bound is not None
    seqs = [
        Sequence(f"p{i}", ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), 256, frozenset())
        for i, ids in enumerate(PROMPTS)
    ]
    for seq in seqs[:3]:
        sched.add(seq)
    steps = mixed = decodes = 0
    while sched.has_work or seqs[3].num_computed == 0:
        if steps == 4:
            sched.add(seqs[3])
        batch = sched.schedule()
        logits = {}
        for name, runner in runners.items():
            with torch.inference_mode():
                logits[name] = runner.execute_logits(runner.prepare(batch)).cpu()
        sampled = [chunk.seq for chunk in batch.chunks if chunk.samples]
        with torch.inference_mode():
            rows = [hf_gemma3(torch.tensor([s.prompt_ids + s.output_ids])).logits[0, -1] for s in sampled]
        ref = torch.stack(rows) if rows else torch.empty(0, GEMMA3["vocab_size"])
        for name, mine in logits.items():
            torch.testing.assert_close(mine, ref, atol=5e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
            assert mine.argmax(-1).tolist() == ref.argmax(-1).tolist(), name
        mixed += any(c.length == 1 for c in batch.chunks) and any(c.length > 1 for c in batch.chunks)
        decodes += all(c.length == 1 for c in batch.chunks)
        sched.complete(batch, [int(row.argmax()) for row in ref])
        steps += 1
    assert all(len(seq.output_ids) == 12 for seq in seqs)
    assert mixed >= 2 and decodes >= 2 and seqs[3].num_cached_tokens >= 28


@pytest.mark.skipif(not cpu_matmul.available(), reason="needs a C compiler")
def test_the_c_layer_loop_runs_gemma_bit_for_bit(gemma3_dir, monkeypatch):
    """Windows, local rope, output norms and GeGLU in the C loop: the Python loop's logits and KV, exactly."""
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.load(gemma3_dir, _config(gemma3_dir), torch.float32, 256, backend=cpu, block_weights=True)
    assert cpu.fusable(model)
    _fused_equals_plain(model, _counting(monkeypatch))
    model.backend.fuse_decode = True


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids) :].tolist()


async def test_engine_loads_and_serves_the_folder(gemma3_dir, hf_gemma3):
    """``--model FOLDER`` end to end: the engine's greedy tokens are transformers' past the window,
    and the HTTP server answers from the folder."""
    config = EngineConfig(model=str(gemma3_dir), dtype="float32", num_pages=64, page_size=16)
    parts = load_model(config)
    assert parts[0].shape.layer_windows == (8, 8, 0, 8)
    engine = Engine(config, *parts)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with engine.generate(PROMPTS[0], params) as outputs:
            tokens = [t async for o in outputs for t in o.token_ids]
        await wait_idle(engine)
        nursery.cancel_scope.cancel()
    assert tokens == _hf_greedy(hf_gemma3, PROMPTS[0], 24)

    tokenizer = parts[1]
    async with running_server(parts, num_pages=64) as srv:
        reply = await in_thread(
            client(srv).completions.create,
            model=MODEL,
            prompt=PROMPTS[2],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert reply.choices[0].text == tokenizer.decode(_hf_greedy(hf_gemma3, PROMPTS[2], 6))


@pytest.mark.slow  # rank processes
async def test_tp_2_gives_transformers_greedy_tokens(gemma3_dir, hf_gemma3):
    """Two ranks, a KV head and two query heads each: per-head norms, windows and the output norms
    (after the all-reduce) as at one rank."""
    config = EngineConfig(model=str(gemma3_dir), dtype="float32", num_pages=64, page_size=16, tp=2)
    engine = await trio.to_thread.run_sync(Engine.load, config)
    assert engine.ranks is not None and engine.model.shape.num_heads == 2
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        for prompt in (PROMPTS[0], PROMPTS[2]):
            async with engine.generate(prompt, params) as outputs:
                got.append([t async for o in outputs for t in o.token_ids])
        await wait_idle(engine)
        nursery.cancel_scope.cancel()
    assert got == [_hf_greedy(hf_gemma3, p, 16) for p in (PROMPTS[0], PROMPTS[2])]
