"""The model and the engine through the kernel paths, on a tiny random-weight Llama.

The same weights run through the CPU fast path (with its C kernels and with
the torch fallbacks used when no C compiler is present), the torch references and the Triton kernels
(interpreted without a GPU), and through transformers: every
step of a mixed batch (chunked prefills beside decodes, a cached prefix) must
give the same logits, and whole engines the same tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
import trio
from transformers import LlamaConfig, LlamaForCausalLM

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine
from trillm.engine.execution.backends import CpuBackend, create_backend
from trillm.engine.execution.dummy_weights import dummy_weights
from trillm.engine.execution.loading import load_model
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_runner import ModelRunner
from trillm.engine.execution.shape import ModelShape
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.prefix_cache import PrefixCache
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence

from tests.helpers import wait_idle

pytestmark = pytest.mark.gpu

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
VARIANTS = ["cpu", "reference", "triton"]
PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 119)), list(range(5, 37))]  # the last shares 32 tokens


def _device(variant: str) -> torch.device:
    """The kernel variants run on the GPU when there is one (Triton compiled, not interpreted)."""
    return torch.device("cuda" if torch.cuda.is_available() and variant != "cpu" else "cpu")


def _weights() -> dict[str, torch.Tensor]:
    """The tiny model's random weights, the same on every call."""
    return dummy_weights(ModelShape.from_config(TINY), torch.float32, seed=7)


def _models() -> dict[str, DecoderModel]:
    shape, weights = ModelShape.from_config(TINY), _weights()
    return {
        name: DecoderModel(
            shape,
            weights,
            torch.float32,
            256,
            _device(name),
            backend=create_backend(name, _device(name), torch.float32),
        )
        for name in VARIANTS
    }


def _hf_model() -> LlamaForCausalLM:
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    missing, unexpected = model.load_state_dict(_weights(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


def test_every_step_matches_across_kernels_and_transformers():
    models, hf = _models(), _hf_model()
    allocator = PageAllocator(40)  # page size 4, a 24-token budget: chunked prefills beside decodes
    sched = Scheduler(allocator, 4, 8, 24, PrefixCache(allocator, 4))
    runners = {name: ModelRunner(model, 40, 4) for name, model in models.items()}
    # The CPU path without its C kernels (no compiler): torch ops, gather + SDPA for decodes.
    no_c = CpuBackend(torch.device("cpu"), torch.float32, c_kernels=False)
    models["cpu-torch"] = DecoderModel(ModelShape.from_config(TINY), _weights(), torch.float32, 256, backend=no_c)
    runners["cpu-torch"] = ModelRunner(models["cpu-torch"], 40, 4)
    cpu, cpu_torch = models["cpu"].backend, models["cpu-torch"].backend
    assert isinstance(cpu, CpuBackend) and isinstance(cpu_torch, CpuBackend)
    assert cpu.c_decode and cpu.c_ops and not cpu_torch.c_decode and not cpu_torch.c_ops
    seqs = [
        Sequence(f"p{i}", ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), 256, frozenset())
        for i, ids in enumerate(PROMPTS)
    ]
    for seq in seqs[:3]:
        sched.add(seq)
    steps = mixed = 0
    while sched.has_work or seqs[3].num_computed == 0:
        if steps == 4:
            sched.add(seqs[3])  # arrives later: reuses the first prompt's cached pages
        batch = sched.schedule()
        logits = {}
        for name, runner in runners.items():
            inputs = runner.prepare(batch)
            with torch.inference_mode():
                logits[name] = runner.execute_logits(inputs).cpu()
        for name in ("reference", "triton", "cpu-torch"):
            torch.testing.assert_close(logits[name], logits["cpu"], atol=2e-5, rtol=1e-4)
        sampled = [chunk.seq for chunk in batch.chunks if chunk.samples]
        with torch.inference_mode():
            for row, seq in zip(logits["triton"], sampled):
                prefix = seq.prompt_ids + seq.output_ids
                torch.testing.assert_close(row, hf(torch.tensor([prefix])).logits[0, -1], atol=2e-5, rtol=1e-4)
        mixed += any(c.length == 1 for c in batch.chunks) and any(c.length > 1 for c in batch.chunks)
        sched.complete(batch, [int(row.argmax()) for row in logits["cpu"]])
        steps += 1
    assert all(len(seq.output_ids) == 8 for seq in seqs)
    assert mixed >= 2 and seqs[3].num_cached_tokens >= 28


def test_prompt_logprobs_match_transformers_on_every_backend():
    """The prompt rows a backend adds after the sampling rows (chunked prefill beside a decode)
    score each prompt token as transformers' log-softmax over the whole prompt does."""
    models, hf = _models(), _hf_model()
    prompt = PROMPTS[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
    for name, model in models.items():
        sched = Scheduler(PageAllocator(40), 4, 8, 12)  # 12 tokens a step: the prompt comes in chunks
        runner = ModelRunner(model, 40, 4)
        greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        sched.add(Sequence("d", PROMPTS[1], greedy, 256, frozenset()))  # decodes beside the scored prompt
        scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
        sched.add(Sequence("p", prompt, scored, 256, frozenset()))
        got = {}
        while sched.has_work:
            batch = sched.schedule()
            result = runner.execute(runner.prepare(batch))
            for part in result.prompt_logprobs:
                assert batch.chunks[part.chunk].seq.request_id == "p"
                got.update({part.start + j: entry for j, entry in enumerate(part.entries)})
            sched.complete(batch, result.tokens)
        assert sorted(got) == list(range(len(prompt) - 1)), name
        for q, entry in got.items():
            assert entry.token_id == prompt[q + 1]
            assert entry.logprob == pytest.approx(float(ref[q, prompt[q + 1]]), abs=1e-4), (name, q)
            assert [t for t, _ in entry.top] == torch.topk(ref[q], 2).indices.tolist(), (name, q)


async def _generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    results: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        async with engine.generate(prompts[i], params) as outputs:
            results[i] = [t async for o in outputs for t in o.token_ids]

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return [results[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),  # every step is compared elsewhere
        SamplingParams(max_tokens=3, temperature=0.9, top_k=50, top_p=0.9, seed=3, ignore_eos=True),
    ],
    ids=["greedy", "sampled"],
)
async def test_engines_give_the_same_tokens_with_every_kernel_choice(tiny_config, params):
    """Dummy weights from a config.json alone; Triton (interpreted here) as the
    engine's kernels give the same tokens as the references (greedy: also as the CPU path)."""
    outputs = {}
    names = VARIANTS if params.greedy else ["reference", "triton"]
    for name in names:
        config = EngineConfig(
            model=str(tiny_config),
            load_format="dummy",
            kernels=name,
            dtype="float32",
            device=_device(name).type,
            num_pages=64,
            page_size=4,
            max_num_seqs=8,
            max_batch_tokens=32,
        )
        engine = Engine(config, *load_model(config))
        assert engine.runner.model.backend.name == name
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            outputs[name] = await _generate(engine, PROMPTS, params)
            await wait_idle(engine)
            nursery.cancel_scope.cancel()
    assert all(len(tokens) == params.max_tokens for tokens in outputs["reference"])
    for name in names:
        assert outputs[name] == outputs["reference"], name


def test_shape_byte_counts_match_a_built_model():
    """The bench sizes the KV pool and the weight traffic from the shape alone; a built model must agree."""
    from trillm.engine.execution.model_runner import kv_bytes_per_token

    shape = ModelShape.from_config(TINY)
    cpu = torch.device("cpu")
    model = DecoderModel(
        shape, _weights(), torch.float32, 256, cpu, backend=create_backend("reference", cpu, torch.float32)
    )
    assert model.projection_bytes == shape.dense_projection_bytes(torch.float32)
    assert kv_bytes_per_token(model) == shape.kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 16 * 4
