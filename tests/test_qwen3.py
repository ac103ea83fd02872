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
import trio
from transformers import Qwen3Config, Qwen3ForCausalLM

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine
from trillm.engine.execution.backends import CpuBackend, create_backend
from trillm.engine.execution.loading import load_model
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_runner import ModelRunner, kv_bytes_per_token
from trillm.engine.execution.shape import ModelShape
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.prefix_cache import PrefixCache
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.kernels import cpu_matmul

from tests.helpers import wait_idle
from tests.server import MODEL, client, in_thread, running_server

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
PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 119)), list(range(5, 37))]  # the last shares 32 tokens
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _q8_0_exact(w: torch.Tensor) -> torch.Tensor:
    """``w`` rounded to values of the form d * q per block of 32 inputs (GGUF Q8_0)."""
    blocks = w.view(w.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    return (d * (blocks / d).round().clamp(-127, 127)).view_as(w)


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


def _device(backend: str) -> torch.device:
    """The kernel backends run on the GPU when there is one (Triton compiled, not interpreted)."""
    return torch.device("cuda" if torch.cuda.is_available() and backend != "cpu" else "cpu")


def _models(folder) -> dict[str, DecoderModel]:
    cfg = _config(folder)
    models = {
        name: DecoderModel.load(
            folder, cfg, torch.float32, 256, _device(name), backend=create_backend(name, _device(name), torch.float32)
        )
        for name in ("cpu", "reference", "triton")
    }
    # The CPU path without its C kernels (no compiler): torch ops, gather + SDPA for decodes.
    no_c = CpuBackend(torch.device("cpu"), torch.float32, c_kernels=False)
    models["cpu-torch"] = DecoderModel.load(folder, cfg, torch.float32, 256, backend=no_c)
    if cpu_matmul.available():
        cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
        models["cpu-blocks"] = DecoderModel.load(folder, cfg, torch.float32, 256, backend=cpu, block_weights=True)
    return models


@pytest.mark.gpu
def test_every_step_matches_transformers_on_every_backend(qwen3_dir, hf_qwen3):
    """Chunked prefills beside decodes and a cached prefix, step by step: every backend's
    logits equal transformers' within float32 tolerance, and their greedy tokens agree."""
    models = _models(qwen3_dir)
    if "cpu-blocks" in models:
        blocks = models["cpu-blocks"]
        assert blocks.num_block_weights == len(blocks.projections()) - 1  # all but the (inexact) tied head
    allocator = PageAllocator(40)
    sched = Scheduler(allocator, 4, 8, 24, PrefixCache(allocator, 4))
    runners = {name: ModelRunner(model, 40, 4) for name, model in models.items()}
    assert runners["cpu"]._bound is None  # dense weights: the Python layer loop
    if "cpu-blocks" in runners:  # blocks: decode steps in the C layer loop, Q/K head norms included
        assert runners["cpu-blocks"]._bound is not None
    seqs = [
        Sequence(f"p{i}", ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), 256, frozenset())
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
            rows = [hf_qwen3(torch.tensor([s.prompt_ids + s.output_ids])).logits[0, -1] for s in sampled]
        ref = torch.stack(rows) if rows else torch.empty(0, QWEN3["vocab_size"])
        for name, mine in logits.items():
            torch.testing.assert_close(mine, ref, atol=5e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
            assert mine.argmax(-1).tolist() == ref.argmax(-1).tolist(), name
        mixed += any(c.length == 1 for c in batch.chunks) and any(c.length > 1 for c in batch.chunks)
        decodes += all(c.length == 1 for c in batch.chunks)
        sched.complete(batch, [int(row.argmax()) for row in ref])
        steps += 1
    assert all(len(seq.output_ids) == 8 for seq in seqs)
    assert mixed >= 2 and decodes >= 2 and seqs[3].num_cached_tokens >= 28


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids) :].tolist()


async def test_engine_loads_and_serves_the_folder(qwen3_dir, hf_qwen3):
    """``--model FOLDER`` end to end: the engine's greedy tokens are transformers', and the
    HTTP server answers a chat request from the folder's tokenizer and template."""
    config = EngineConfig(model=str(qwen3_dir), dtype="float32", num_pages=64, page_size=16)
    parts = load_model(config)
    assert parts[0].shape.qk_norm
    engine = Engine(config, *parts)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with engine.generate(PROMPTS[0], params) as outputs:
            tokens = [t async for o in outputs for t in o.token_ids]
        await wait_idle(engine)
        nursery.cancel_scope.cancel()
    assert tokens == _hf_greedy(hf_qwen3, PROMPTS[0], 10)

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
    assert reply.choices[0].text == tokenizer.decode(_hf_greedy(hf_qwen3, PROMPTS[2], 6))
