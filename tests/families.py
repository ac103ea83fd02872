"""What every model family's tests do alike: random tiny weights saved as a HF folder, the model
on every backend, the step-by-step comparison with ``transformers``, and the engine's greedy
tokens at one and two ranks. A family's test module says only what is its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import trio

from trillm.engine.config import EngineConfig
from trillm.engine.engine import Engine
from trillm.engine.execution.backends import CpuBackend, create_backend
from trillm.engine.execution.loading import load_model
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_runner import ModelRunner
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.prefix_cache import PrefixCache
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.kernels import cpu_matmul

from tests.helpers import wait_idle
from tests.server import client, in_thread, running_server

PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 119)), list(range(5, 37))]  # the last shares 32 tokens


def q8_0_exact(w: torch.Tensor) -> torch.Tensor:
    """``w`` rounded to values of the form d * q per block of 32 inputs (GGUF Q8_0)."""
    blocks = w.reshape(-1, w.shape[-1] // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    return (d * (blocks / d).round().clamp(-127, 127)).view_as(w)


class GGUFFromFolder:
    """A tiny family's HF folder written as llama.cpp's converter writes its GGUF file: the
    folder's float tensors (``w``), a writer with the keys every family has set from ``cfg``, and
    ``q8`` for the projections (their values are exact Q8_0 blocks, so the file holds them exactly).
    ``close`` writes the file."""

    def __init__(self, folder: Path, path: Path, arch: str, cfg: dict[str, Any]) -> None:
        from gguf import GGUFWriter
        from safetensors.torch import load_file

        self.w = {k: v.float().numpy() for k, v in load_file(folder / "model.safetensors").items()}
        self.writer = writer = GGUFWriter(path, arch)
        writer.add_context_length(cfg["max_position_embeddings"])
        writer.add_embedding_length(cfg["hidden_size"])
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_block_count(cfg["num_hidden_layers"])
        writer.add_head_count(cfg["num_attention_heads"])
        writer.add_head_count_kv(cfg["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])

    def q8(self, name: str, array: Any) -> None:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        raw = quantize(array, GGMLQuantizationType.Q8_0)
        self.writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q8_0)

    def close(self) -> None:
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()


def save_random(model: torch.nn.Module, folder: Path, tokenizer_dir: Path, norm_offset: float = 1.0) -> Path:
    """``model`` (seeded by the caller) with random norms around ``norm_offset`` (unit norms would hide
    a missing or misplaced one) and every projection an exact Q8_0 block matrix (so the CPU path
    also runs them as blocks), saved with the default model's tokenizer (its vocabulary: 49,152)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(norm_offset + 0.3 * torch.randn_like(p))
            elif p.dim() >= 2 and "embed" not in name and "lm_head" not in name and not name.endswith("gate.weight"):
                p.copy_(q8_0_exact(torch.randn_like(p) * 0.1))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


# A two-layer Qwen3 of the default model's vocabulary: what the serving tests (embeddings, rerank,
# several models) stand up as a second model in a second or two.
TINY_QWEN3 = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    eos_token_id=2,
)


def tiny_qwen3(folder: Path, tokenizer_dir: Path, seed: int, kind: Any = None, **config: Any) -> Path:
    """A ``TINY_QWEN3`` (``kind``: its transformers class, ``Qwen3ForCausalLM`` by default) on
    seeded random weights, saved with the default model's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    (kind or Qwen3ForCausalLM)(Qwen3Config(**{**TINY_QWEN3, **config})).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def config_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def _device(backend: str) -> torch.device:
    """The kernel backends run on the GPU when there is one (Triton compiled, not interpreted)."""
    return torch.device("cuda" if torch.cuda.is_available() and backend != "cpu" else "cpu")


def every_backend(folder: Path) -> dict[str, DecoderModel]:
    """The folder's model on the CPU path (C kernels, torch only, block weights), the reference
    kernels and Triton (interpreted on a CPU)."""
    cfg = config_of(folder)
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


def c_loop_equals_python_loop(folder: Path, monkeypatch: Any) -> DecoderModel:
    """The folder's model in blocks on the CPU path: its decode steps in the C layer loop give the
    Python loop's logits and KV bit for bit (``test_cpu_forward._fused_equals_plain``)."""
    from tests.test_cpu_forward import _counting, _fused_equals_plain

    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.load(folder, config_of(folder), torch.float32, 256, backend=cpu, block_weights=True)
    assert cpu.fusable(model)
    _fused_equals_plain(model, _counting(monkeypatch))
    model.backend.fuse_decode = True
    return model


def steps_match_transformers(
    models: dict[str, DecoderModel], hf: Any, vocab: int, max_tokens: int = 10, atol: float = 1e-4
) -> None:
    """Chunked prefills beside decodes and a cached prefix, step by step: every backend's logits
    equal transformers' within float32 tolerance, and their greedy tokens agree."""
    allocator = PageAllocator(40)
    sched = Scheduler(allocator, 4, 8, 24, PrefixCache(allocator, 4))
    runners = {name: ModelRunner(model, 40, 4) for name, model in models.items()}
    seqs = [
        Sequence(f"p{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), 256, frozenset())
        for i, ids in enumerate(PROMPTS)
    ]
    for seq in seqs[:3]:
        sched.add(seq)
    steps = mixed = decodes = interpreted_steps = 0
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
            rows = [hf(torch.tensor([s.prompt_ids + s.output_ids])).logits[0, -1] for s in sampled]
        ref = torch.stack(rows) if rows else torch.empty(0, vocab)
        for name, mine in logits.items():
            torch.testing.assert_close(mine, ref, atol=atol, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
            assert mine.argmax(-1).tolist() == ref.argmax(-1).tolist(), name
        mixed += any(c.length == 1 for c in batch.chunks) and any(c.length > 1 for c in batch.chunks)
        decodes += all(c.length == 1 for c in batch.chunks)
        if "triton" in runners and mixed and decodes and seqs[3].num_computed > 0:
            # The interpreted kernels have now scored a chunked prefill, a prefix hit, a mixed step and
            # a decode step: the rest of the run adds little but minutes.
            del runners["triton"]
            interpreted_steps = steps + 1
        sched.complete(batch, [int(row.argmax()) for row in ref])
        steps += 1
    assert all(len(seq.output_ids) == max_tokens for seq in seqs)
    assert "triton" not in models or interpreted_steps >= 4
    assert mixed >= 2 and decodes >= 2 and seqs[3].num_cached_tokens >= 28


def hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids) :].tolist()


async def engine_serves_transformers_tokens(folder: Path, hf: Any, n: int = 16) -> Any:
    """``--model FOLDER`` end to end: the engine's greedy tokens are transformers', and the HTTP
    server answers a completion through the OpenAI client from the folder's tokenizer. Returns
    the loaded model, for the caller's own checks."""
    config = EngineConfig(model=str(folder), dtype="float32", num_pages=64, page_size=16)
    parts = load_model(config)
    engine = Engine(config, *parts)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with engine.generate(PROMPTS[0], params) as outputs:
            tokens = [t async for o in outputs for t in o.token_ids]
        await wait_idle(engine)
        nursery.cancel_scope.cancel()
    assert tokens == hf_greedy(hf, PROMPTS[0], n)

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
    assert reply.choices[0].text == tokenizer.decode(hf_greedy(hf, PROMPTS[2], 6))
    return parts[0]


async def two_ranks_give_transformers_tokens(folder: Path, hf: Any, n: int = 12) -> Any:
    """``--tp 2`` on the folder: rank 0's greedy tokens are transformers'. Returns rank 0's model."""
    config = EngineConfig(model=str(folder), dtype="float32", num_pages=64, page_size=16, tp=2)
    engine = await trio.to_thread.run_sync(Engine.load, config)
    assert engine.ranks is not None
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    got = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        for prompt in (PROMPTS[0], PROMPTS[2]):
            async with engine.generate(prompt, params) as outputs:
                got.append([t async for o in outputs for t in o.token_ids])
        await wait_idle(engine)
        nursery.cancel_scope.cancel()
    assert got == [hf_greedy(hf, p, n) for p in (PROMPTS[0], PROMPTS[2])]
    return engine.model
