"""The C layer loop of decode-only steps (``kernels/cpu_forward.c``) against the Python loop
it replaces: the same kernels in the same order, so logits and KV must be bit for bit equal."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trillm.bench.gguf_files import requantize
from trillm.engine.config import EngineConfig
from trillm.engine.execution.backends import create_backend
from trillm.engine.execution.backends.cpu import RopeRows
from trillm.engine.execution.gguf_header import read_header
from trillm.engine.execution.gguf_model import gguf_config
from trillm.engine.execution.layers import Stacked
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_runner import ModelRunner
from trillm.engine.execution.model_source import fetch_default_gguf
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence
from trillm.kernels import cpu_forward, cpu_gguf, cpu_matmul

from .test_qwen3 import PROJECTIONS, QWEN3, _q8_0_exact


@pytest.fixture
def fusing_model(model_parts, monkeypatch):
    """The default model (block weights), counting the steps that took the C loop."""
    model = model_parts[0]
    assert model.backend.fuse_decode and model.backend.fusable(model), (
        "the default model on this CPU should run decode steps in C"
    )
    calls = []
    real = cpu_forward.DecodeLayers.run
    monkeypatch.setattr(
        cpu_forward.DecodeLayers, "run", lambda self, h, *a: (calls.append(h.shape[0]), real(self, h, *a))[1]
    )
    yield model, calls
    model.backend.fuse_decode = True


def _fused_equals_plain(model, calls: list[int], max_rows: int = 7, exact: bool = True) -> None:
    """Decode batches of 7 down to 1 rows (or ``max_rows``), fused and not: the same logits and KV
    (``exact=False``: within float rounding, the same greedy tokens)."""
    fused, plain = ModelRunner(model, 40, 16), ModelRunner(model, 40, 16)
    assert fused._bound is not None
    sched = Scheduler(PageAllocator(40), 16, 8, 256)
    # Seven sequences of ragged lengths (some crossing page boundaries while decoding),
    # finishing one after another: decode batches of 7 down to 1 rows.
    seqs = [
        Sequence(
            f"s{i}",
            list(range(100 + 13 * i, 100 + 13 * i + 5 + 6 * i)),
            SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True),
            10_000,
            frozenset(),
        )
        for i in range(7)
    ]
    for seq in seqs:
        sched.add(seq)
    decode_rows = []
    while sched.has_work:
        batch = sched.schedule()
        logits = {}
        for name, runner, fuse in (("fused", fused, True), ("plain", plain, False)):
            model.backend.fuse_decode = fuse
            with torch.inference_mode():
                logits[name] = runner.execute_logits(runner.prepare(batch))
        if exact:
            assert torch.equal(logits["fused"], logits["plain"])
        else:
            torch.testing.assert_close(logits["fused"], logits["plain"], atol=5e-3, rtol=1e-3)
            assert logits["fused"].argmax(-1).tolist() == logits["plain"].argmax(-1).tolist()
        if all(c.length == 1 for c in batch.chunks) and len(batch.chunks) <= max_rows:
            decode_rows.append(len(batch.chunks))
        sched.complete(batch, logits["plain"].argmax(-1).tolist())
    assert calls == decode_rows and 7 in calls and 1 in calls  # every decode-only step, and only those, in C
    for (k1, v1), (k2, v2) in zip(fused.kv_cache, plain.kv_cache):
        if exact:
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
        else:
            torch.testing.assert_close(k1, k2, atol=5e-3, rtol=1e-3)
            torch.testing.assert_close(v1, v2, atol=5e-3, rtol=1e-3)


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = cpu_forward.DecodeLayers.run
    monkeypatch.setattr(
        cpu_forward.DecodeLayers, "run", lambda self, h, *a: (calls.append(h.shape[0]), real(self, h, *a))[1]
    )
    return calls


def test_decode_steps_in_c_equal_the_python_loop(fusing_model):
    model, calls = fusing_model
    _fused_equals_plain(model, calls)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_is_stored_and_read_alike_by_both_loops(fusing_model, kv_dtype):
    """--kv-cache-dtype: the C loop's stores round as the Python path's, and both attend through the
    same kernel: still bit for bit."""
    model, calls = fusing_model
    model.kv_dtype = kv_dtype
    try:
        _fused_equals_plain(model, calls)
    finally:
        model.kv_dtype = torch.float32


@pytest.mark.skipif(not cpu_gguf.available(), reason="needs a C compiler")
def test_a_gguf_files_own_blocks_decode_in_c_as_in_python(tmp_path, monkeypatch):
    """A Q4_K_M-style file: Q and K in Q4_K beside V in Q6_K (parts side by side), gate/up and down
    in k-quants; the C loop runs cpu_gguf's int16 kernels, bit for bit the Python loop's."""
    path = tmp_path / "smollm2-q4_k_m.gguf"
    requantize(fetch_default_gguf(EngineConfig().cache_path), path, "q4_k_m", layers=3, vocabulary=False)
    header = read_header(path)
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.from_gguf(header, gguf_config(header), torch.float32, 1024, backend=cpu, block_weights=True)
    assert any(isinstance(layer.qkv, Stacked) for layer in model.layers)
    assert cpu.fusable(model)
    _fused_equals_plain(model, _counting(monkeypatch))
    model.backend.fuse_decode = True


def _folder_in_the_c_loop(hf: torch.nn.Module, folder, monkeypatch) -> DecoderModel:
    """``hf`` (seeded by the caller) with random norms and biases and exact Q8_0 projections, saved
    and loaded in blocks: decode steps in the C loop equal the Python loop's bit for bit."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.split(".")[-2] in PROJECTIONS:
                p.copy_(_q8_0_exact(p))
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.load(folder, config, torch.float32, 256, backend=cpu, block_weights=True)
    assert cpu.fusable(model)
    _fused_equals_plain(model, _counting(monkeypatch))
    model.backend.fuse_decode = True
    return model


def test_qwen3_head_norms_decode_in_c_as_in_python(tmp_path, monkeypatch):
    """Qwen3's per-head Q/K RMSNorm runs inside the C loop, bit for bit the Python loop's."""
    torch.manual_seed(0)
    model = _folder_in_the_c_loop(Qwen3ForCausalLM(Qwen3Config(**QWEN3)).eval(), tmp_path, monkeypatch)
    assert all(layer.q_norm is not None for layer in model.layers)


def test_bad_slots_and_layouts_are_refused(fusing_model):
    model, _ = fusing_model
    runner = ModelRunner(model, 8, 16)
    layers = [
        cpu_forward.LayerSpec(la.input_norm, la.qkv, la.o_proj, la.post_norm, la.gate_up, la.down)
        for la in model.layers
    ]
    with pytest.raises(ValueError, match="layers but"):
        cpu_forward.DecodeLayers(layers, runner.kv_cache[:-1], model.shape.num_heads, 1e-5, 0.125)
    with pytest.raises(ValueError, match="layer shapes"):
        cpu_forward.DecodeLayers(
            [attrs.evolve(layers[0], qkv=layers[0].down)], runner.kv_cache[:1], model.shape.num_heads, 1e-5, 0.125
        )
    loop = cpu_forward.DecodeLayers(layers, runner.kv_cache, model.shape.num_heads, 1e-5, 0.125)
    h = torch.randn(1, model.shape.hidden_size)
    cos, sin = model.cos[:1].contiguous(), model.sin[:1].contiguous()
    rope = RopeRows((cos, sin), (cos, sin))
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    before = [k.clone() for k, _ in runner.kv_cache]
    with pytest.raises(ValueError, match="out of range"):  # slot 8 * 16 is past the cache
        loop.run(h.clone(), rope, torch.tensor([8 * 16]), tables, lens, 2)
    with pytest.raises(ValueError, match="out of range"):  # page 9 of 8
        loop.run(h.clone(), rope, torch.tensor([0]), torch.full((1, 1), 9, dtype=torch.int32), lens, 2)
    with pytest.raises(ValueError, match="int32"):
        loop.run(h.clone(), rope, torch.tensor([0]), tables.long(), lens, 2)
    assert all(torch.equal(k, b) for (k, _), b in zip(runner.kv_cache, before))  # nothing written by a refusal


def test_a_qkv_bias_decodes_in_c_as_in_python(tmp_path, monkeypatch):
    """Qwen2's Q/K/V bias, added after the projection inside the C loop as the Python loop adds it:
    bit for bit."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in QWEN3.items() if k != "head_dim"})).eval()
    model = _folder_in_the_c_loop(hf, tmp_path, monkeypatch)
    assert all(layer.qkv_bias is not None for layer in model.layers)


def test_proposed_rows_run_on_the_kernels_of_their_sequences_plain_step(model_parts):
    """A verification step's rows (``kernel_rows``: its sequences) are computed as a plain step of
    those sequences computes each of them, bit for bit: 2 sequences' 18 rows as 2-row steps, though
    18 rows alone would pick other kernels (AMX tiles, or the many-row float32 path)."""
    model = model_parts[0]
    runner = ModelRunner(model, 40, 16)
    bound = runner._bound
    assert bound is not None
    rows, hidden = 18, model.shape.hidden_size
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=gen)
    positions = torch.arange(rows) * 3 + 5
    slots = torch.arange(rows, dtype=torch.long) * 16 + 3  # each row its own page, attending only itself
    tables = torch.arange(rows, dtype=torch.int32).unsqueeze(1)
    lens = torch.ones(rows, dtype=torch.int32) * 4

    def run(lo: int, hi: int, kernel_rows: int | None) -> torch.Tensor:
        rope = RopeRows.at(model, positions[lo:hi])
        out = bound.run(h[lo:hi].clone(), rope, slots[lo:hi], tables[lo:hi], lens[lo:hi], 2, kernel_rows)
        return model.backend.head(out, model.lm_head, kernel_rows)

    with torch.inference_mode():
        pairs = torch.cat([run(i, i + 2, None) for i in range(0, rows, 2)])
        assert torch.equal(run(0, rows, 2), pairs)
        if cpu_matmul.simd() != "plain":  # the plain-C path computes every row alike anyway
            assert not torch.equal(run(0, rows, None), pairs)
