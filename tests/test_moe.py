"""Mixtures of experts (Qwen3-MoE, Mixtral) through every backend, against ``transformers`` on the
same random weights saved as a HF folder: the router's softmax and top-k, renormalised or not,
experts gathered per token, Qwen3-MoE's dense layers beside its mixtures, Mixtral's checkpoint
names (``block_sparse_moe.experts.E.w1``) and its sliding window; at ``--tp 1`` and ``--tp 2``
(every expert split over the ranks).

The experts are exact Q8_0 blocks, so the CPU path also runs them as blocks (in the Python loop:
the C loop has no router).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import trio
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

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
from tests.server import client, in_thread, running_server
from tests.test_qwen3 import _q8_0_exact

COMMON = dict(
    vocab_size=49152,  # the default model's tokenizer, so the folder can be served
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "qwen3_moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            **COMMON,
            head_dim=32,
            intermediate_size=96,  # the dense layer's
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            mlp_only_layers=[1],  # a dense MLP between two mixtures
            tie_word_embeddings=True,
        ),
    ),
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(
            **COMMON,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=12,  # every layer windowed
            tie_word_embeddings=False,
        ),
    ),
}
PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 119)), list(range(5, 37))]  # the last shares 32 tokens


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_dir(request, tmp_path_factory, model_dir):
    """A HF folder: config, safetensors written by transformers, the default model's tokenizer."""
    cls, config = FAMILIES[request.param]
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # unit norms would hide a missing or misplaced norm
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.dim() >= 2 and "embed" not in name and "lm_head" not in name:
                p.copy_(torch.randn_like(p) * 0.1)
                if "experts" in name or name.endswith("proj.weight"):  # projections: exact Q8_0 blocks
                    p.copy_(_q8_0_exact(p.reshape(-1, p.shape[-1])).view_as(p))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def hf_moe(moe_dir):
    config = _config(moe_dir)
    cls = MixtralForCausalLM if config["architectures"] == ["MixtralForCausalLM"] else Qwen3MoeForCausalLM
    return cls.from_pretrained(moe_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_shape_reads_the_mixture(moe_dir):
    shape = ModelShape.from_config(_config(moe_dir))
    if shape.qk_norm:  # Qwen3-MoE
        assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size) == (8, 3, 32)
        assert shape.normalize_top_k and shape.dense_layers == (1,) and not shape.layer_windows
        assert [shape.is_moe(i) for i in range(3)] == [True, False, True]
    else:  # Mixtral
        assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size) == (4, 2, 64)
        assert shape.normalize_top_k and shape.layer_windows == (12, 12, 12)
    reference = create_backend("reference", torch.device("cpu"), torch.float32)
    model = DecoderModel.load(moe_dir, _config(moe_dir), torch.float32, 256, backend=reference)
    # What one token's step reads: the top-k experts of each mixture, and the router.
    assert model.projection_bytes == shape.dense_projection_bytes(torch.float32)
    assert sum(layer.moe is not None for layer in model.layers) == sum(shape.is_moe(i) for i in range(3))


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
def test_every_step_matches_transformers_on_every_backend(moe_dir, hf_moe):
    """Chunked prefills beside decodes and a cached prefix, step by step: every backend's
    logits equal transformers' within float32 tolerance, and their greedy tokens agree."""
    models = _models(moe_dir)
    if "cpu-blocks" in models:
        blocks = models["cpu-blocks"]
        assert blocks.num_block_weights >= len(blocks.projections()) - 1  # the experts too
    allocator = PageAllocator(40)
    sched = Scheduler(allocator, 4, 8, 24, PrefixCache(allocator, 4))
    runners = {name: ModelRunner(model, 40, 4) for name, model in models.items()}
    seqs = [
        Sequence(f"p{i}", ids, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), 256, frozenset())
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
            rows = [hf_moe(torch.tensor([s.prompt_ids + s.output_ids])).logits[0, -1] for s in sampled]
        ref = torch.stack(rows) if rows else torch.empty(0, COMMON["vocab_size"])
        for name, mine in logits.items():
            torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
            assert mine.argmax(-1).tolist() == ref.argmax(-1).tolist(), name
        mixed += any(c.length == 1 for c in batch.chunks) and any(c.length > 1 for c in batch.chunks)
        decodes += all(c.length == 1 for c in batch.chunks)
        sched.complete(batch, [int(row.argmax()) for row in ref])
        steps += 1
    assert all(len(seq.output_ids) == 10 for seq in seqs)
    assert mixed >= 2 and decodes >= 2 and seqs[3].num_cached_tokens >= 28


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids) :].tolist()


async def test_engine_loads_and_serves_the_folder(moe_dir, hf_moe):
    """``--model FOLDER`` end to end: the engine's greedy tokens are transformers', and the
    HTTP server answers from the folder."""
    config = EngineConfig(model=str(moe_dir), dtype="float32", num_pages=64, page_size=16)
    parts = load_model(config)
    assert any(layer.moe is not None for layer in parts[0].layers)
    engine = Engine(config, *parts)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with engine.generate(PROMPTS[0], params) as outputs:
            tokens = [t async for o in outputs for t in o.token_ids]
        await wait_idle(engine)
        nursery.cancel_scope.cancel()
    assert tokens == _hf_greedy(hf_moe, PROMPTS[0], 16)

    tokenizer = parts[1]
    async with running_server(parts, num_pages=64) as srv:
        api = client(srv)
        model = (await in_thread(api.models.list)).data[0].id
        reply = await in_thread(
            api.completions.create,
            model=model,
            prompt=PROMPTS[2],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert reply.choices[0].text == tokenizer.decode(_hf_greedy(hf_moe, PROMPTS[2], 6))


@pytest.mark.slow  # rank processes
async def test_tp_2_gives_transformers_greedy_tokens(moe_dir, hf_moe):
    """Two ranks, each with its slice of every expert and the whole router: the partial sums of
    the mixture, all-reduced, give one rank's tokens."""
    config = EngineConfig(model=str(moe_dir), dtype="float32", num_pages=64, page_size=16, tp=2)
    engine = await trio.to_thread.run_sync(Engine.load, config)
    assert engine.ranks is not None and engine.model.shape.num_heads == 2
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        for prompt in (PROMPTS[0], PROMPTS[2]):
            async with engine.generate(prompt, params) as outputs:
                got.append([t async for o in outputs for t in o.token_ids])
        await wait_idle(engine)
        nursery.cancel_scope.cancel()
    assert got == [_hf_greedy(hf_moe, p, 12) for p in (PROMPTS[0], PROMPTS[2])]
