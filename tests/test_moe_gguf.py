"""A mixture of experts from a GGUF file (``qwen3moe``: the experts of a layer as one 3-D tensor
per projection, a float32 router): each expert's rows kept in the file's blocks, held to
``transformers`` on the same weights (a Qwen3-MoE checkpoint whose matrices are exact Q8_0 blocks,
written as the file), and the header checks that refuse a mixture with a tensor missing."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from trillm.bench.moe_files import qwen3_moe_from_weights, random_blocks
from trillm.engine.execution.backends import create_backend
from trillm.engine.execution.gguf_header import read_header
from trillm.engine.execution.gguf_model import gguf_config
from trillm.engine.execution.gguf_support import UnsupportedModel, check_servable
from trillm.engine.execution.model import DecoderModel
from trillm.kernels import cpu_gguf
from trillm.kernels.gguf_blocks import BLOCK_TYPES, GGUFWeight, reference_dequantize

from tests.test_cpu_forward import _counting, _fused_equals_plain
from tests.test_gguf_quality import _all_logits
from tests.test_qwen3 import _q8_0_exact

pytestmark = pytest.mark.skipif(not cpu_gguf.available(), reason="needs a C compiler")

CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,  # llama.cpp's qwen3moe always renormalises
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _exact_q8_0_weights(hf: torch.nn.Module) -> torch.nn.Module:
    """Random norms around 1, biases, and every matrix exact Q8_0 blocks but the routers (and
    Qwen2-MoE's shared expert gate), which stay float32 in the file."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif p.dim() >= 2 and not name.endswith("gate.weight"):
                p.copy_(_q8_0_exact((torch.randn_like(p) * 0.1).reshape(-1, p.shape[-1])).view_as(p))
    return hf


@pytest.fixture(scope="module")
def hf_and_file(tmp_path_factory):
    torch.manual_seed(0)
    hf = _exact_q8_0_weights(Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).eval())
    folder = tmp_path_factory.mktemp("qwen3moe")
    hf.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")  # the checkpoint's own names: one matrix per expert
    path = folder / "qwen3moe-q8_0.gguf"
    qwen3_moe_from_weights(weights, CONFIG, path, "Q8_0")
    return hf, path


def test_the_config_and_experts_come_from_the_file(hf_and_file):
    _, path = hf_and_file
    header = read_header(path)
    config = gguf_config(header)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (8, 2, 32)
    assert config["norm_topk_prob"]
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.from_gguf(header, config, torch.float32, 256, backend=cpu, block_weights=True)
    moe = model.layers[0].moe
    assert moe is not None and len(moe.gate_up) == 8 and moe.router.shape == (64, 8)
    assert model.num_block_weights == len(model.projections())  # every expert in blocks
    dense = DecoderModel.from_gguf(header, config, torch.float32, 256, backend=cpu, block_weights=False)
    assert dense.layers[1].moe is not None and isinstance(dense.layers[1].moe.down[7], torch.Tensor)


def test_teacher_forced_logits_are_transformers(hf_and_file):
    """Prefilled whole (float32 activations) and a token a step (int16 activations) against
    transformers on the checkpoint: the experts' blocks are its values exactly."""
    hf, path = hf_and_file
    header = read_header(path)
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.from_gguf(header, gguf_config(header), torch.float32, 256, backend=cpu, block_weights=True)
    ids = list(range(3, 80, 2))
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids, 64), theirs, atol=1e-4, rtol=1e-4)
    decoded = _all_logits(model, ids, 1)
    assert (decoded.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.95
    assert (decoded - theirs).abs().max() < 0.05


def test_a_mixture_missing_an_experts_tensor_is_one_line(hf_and_file, tmp_path):
    _, path = hf_and_file
    header = read_header(path)
    cut = attrs.evolve(header, tensors=tuple(t for t in header.tensors if t.name != "blk.1.ffn_up_exps.weight"))
    with pytest.raises(UnsupportedModel, match="blk.1.ffn_up_exps.weight missing"):
        check_servable(cut, available=1 << 40, native=True)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
def test_random_blocks_are_valid_and_centred(type_name):
    """The benchmark files' blocks: finite values of about zero mean, as ``gguf`` decodes them."""
    raw = random_blocks(type_name, 64, 512, np.random.default_rng(0), 2e-4)
    values = reference_dequantize(GGUFWeight(BLOCK_TYPES[type_name], torch.from_numpy(raw), 512))
    assert torch.isfinite(values).all() and values.abs().max() > 0
    assert abs(values.mean().item()) < 0.1 * values.std().item()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0"])
@pytest.mark.parametrize("rows", [1, 3])
def test_grouped_matmul_is_each_matmul_bit_for_bit(type_name, rows):
    """Five experts of one type in one call, one x for all or one x each: the per-matrix results exactly."""
    rng = np.random.default_rng(1)
    weights = [
        GGUFWeight(BLOCK_TYPES[type_name], torch.from_numpy(random_blocks(type_name, 96, 512, rng, 1e-2)), 512)
        for _ in range(5)
    ]
    x, xs = torch.randn(rows, 512), torch.randn(rows, 5 * 512)
    assert torch.equal(
        cpu_gguf.matmul_grouped(x, weights, False), torch.cat([cpu_gguf.matmul(x, w) for w in weights], 1)
    )
    each = [cpu_gguf.matmul(xs[:, g * 512 : (g + 1) * 512], w) for g, w in enumerate(weights)]
    assert torch.equal(cpu_gguf.matmul_grouped(xs, weights, True), torch.cat(each, 1))
    assert not cpu_gguf.groupable(weights[:2] + [GGUFWeight(BLOCK_TYPES["Q8_0"], weights[0].data, 512)], 1)


def _q4_k_mixture(folder, shared: bool = False):
    """A Qwen3-MoE file of Q4_K experts (the real files' kind), from random weights: its header.
    ``shared``: a Qwen2-MoE file instead (Q/K/V biases, a shared expert of 256)."""
    torch.manual_seed(1)
    config = {**CONFIG, "hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256}
    if shared:
        config = {**config, "shared_expert_intermediate_size": 256, "norm_topk_prob": False}
        hf = _exact_q8_0_weights(Qwen2MoeForCausalLM(Qwen2MoeConfig(**config)).eval())
    else:
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).eval()
    hf.save_pretrained(folder)  # the checkpoint's names: one matrix per expert
    path = folder / "mixture-q4_k.gguf"
    arch = "qwen2moe" if shared else "qwen3moe"
    qwen3_moe_from_weights(load_file(folder / "model.safetensors"), config, path, "Q4_K", arch=arch)
    return read_header(path)


@pytest.mark.parametrize("bits", [16, 8])
def test_the_c_layer_loop_runs_a_mixture_as_the_python_loop(tmp_path, monkeypatch, bits):
    """Router, top k and the two grouped expert calls a token in ``cpu_forward.c``: decode batches
    of 7 down to 1 rows give the Python loop's logits and KV within float rounding (the router's
    sums run in another order than torch's) and its greedy tokens, at either activation width."""
    header = _q4_k_mixture(tmp_path)
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.from_gguf(
        header, gguf_config(header), torch.float32, 1024, backend=cpu, block_weights=True, activation_bits=bits
    )
    assert cpu.fusable(model) and all(layer.moe is not None for layer in model.layers)
    _fused_equals_plain(model, _counting(monkeypatch), exact=False)
    model.backend.fuse_decode = True


def test_k_quant_experts_run_grouped_at_one_token_as_the_dense_file(tmp_path, monkeypatch):
    """Q4_K experts (the real files' kind): a token a step goes through the grouped calls, and its
    logits are those of the same file decoded to float32 within the int16 path's rounding."""
    header = _q4_k_mixture(tmp_path)
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    blocks = DecoderModel.from_gguf(header, gguf_config(header), torch.float32, 256, backend=cpu, block_weights=True)
    dense = DecoderModel.from_gguf(header, gguf_config(header), torch.float32, 256, backend=cpu, block_weights=False)
    calls = []
    real = cpu_gguf.matmul_grouped
    monkeypatch.setattr(cpu_gguf, "matmul_grouped", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    ids = list(range(3, 60, 2))
    mine, theirs = _all_logits(blocks, ids, 1), _all_logits(dense, ids, 64)
    assert len(calls) == 2 * 2 * len(ids)  # two calls per mixture layer per step
    assert (mine.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.95
    assert (mine - theirs).abs().max() < 0.05 * theirs.abs().max()


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """Q or K rows as llama.cpp's converter stores them for the llama architecture (pairs per head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_a_mixtral_gguf_file_is_transformers(tmp_path):
    """Mixtral as llama.cpp writes it: architecture ``llama`` with ``expert_count``, Q and K rows
    permuted, the experts one 3-D tensor per projection; every matrix Q8_0 (exact here)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    hf = MixtralForCausalLM(MixtralConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.copy_(_q8_0_exact((torch.randn_like(p) * 0.1).reshape(-1, p.shape[-1])).view_as(p))
    hf.save_pretrained(tmp_path)
    w = {k: v.float().numpy() for k, v in load_file(tmp_path / "model.safetensors").items()}
    path = tmp_path / "mixtral-q8_0.gguf"
    writer = GGUFWriter(path, "llama")
    for key, value in (
        ("context_length", 256),
        ("embedding_length", 64),
        ("feed_forward_length", 64),
        ("block_count", 2),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 2),
        ("expert_count", 4),
        ("expert_used_count", 2),
    ):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 1_000_000.0)

    def q8(name: str, array: np.ndarray) -> None:
        raw = quantize(array.reshape(-1, array.shape[-1]), GGMLQuantizationType.Q8_0)
        raw = raw.reshape(*array.shape[:-1], -1)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q8_0)

    writer.add_tensor("token_embd.weight", w["model.embed_tokens.weight"])
    writer.add_tensor("output.weight", w["lm_head.weight"])
    writer.add_tensor("output_norm.weight", w["model.norm.weight"])
    for i in range(2):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        writer.add_tensor(g + "attn_norm.weight", w[p + "input_layernorm.weight"])
        writer.add_tensor(g + "ffn_norm.weight", w[p + "post_attention_layernorm.weight"])
        q8(g + "attn_q.weight", _permuted(w[p + "self_attn.q_proj.weight"], 4))
        q8(g + "attn_k.weight", _permuted(w[p + "self_attn.k_proj.weight"], 2))
        q8(g + "attn_v.weight", w[p + "self_attn.v_proj.weight"])
        q8(g + "attn_output.weight", w[p + "self_attn.o_proj.weight"])
        writer.add_tensor(g + "ffn_gate_inp.weight", w[p + "block_sparse_moe.gate.weight"])
        for ours, theirs in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
            stacked = np.stack([w[f"{p}block_sparse_moe.experts.{e}.{theirs}.weight"] for e in range(4)])
            q8(g + ours + ".weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_header(path)
    check_servable(header, available=1 << 40, native=True)
    config = gguf_config(header)
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.from_gguf(header, config, torch.float32, 256, backend=cpu, block_weights=True)
    assert model.layers[0].moe is not None and model.num_block_weights == len(model.projections())
    ids = list(range(3, 70, 2))
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids, 64), theirs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_all_logits(model, ids, 1), theirs, atol=1e-4, rtol=1e-4)  # Q8_0: float32 x


QWEN2_MOE = dict(
    {k: v for k, v in CONFIG.items() if k != "norm_topk_prob"},
    shared_expert_intermediate_size=64,
    norm_topk_prob=False,  # llama.cpp's qwen2moe never renormalises
)


@pytest.fixture(scope="module")
def qwen2_moe_file(tmp_path_factory):
    """A Qwen2-MoE checkpoint (Q/K/V biases, the shared expert and its gate) of exact Q8_0 blocks,
    written as llama.cpp's ``qwen2moe`` file."""
    torch.manual_seed(2)
    hf = _exact_q8_0_weights(Qwen2MoeForCausalLM(Qwen2MoeConfig(**QWEN2_MOE)).eval())
    folder = tmp_path_factory.mktemp("qwen2moe")
    hf.save_pretrained(folder)
    path = folder / "qwen2moe-q8_0.gguf"
    qwen3_moe_from_weights(load_file(folder / "model.safetensors"), QWEN2_MOE, path, "Q8_0", arch="qwen2moe")
    return hf, path


def test_a_qwen2_moe_file_runs_its_shared_expert_as_transformers(qwen2_moe_file):
    hf, path = qwen2_moe_file
    header = read_header(path)
    config = gguf_config(header)
    assert config["architectures"] == ["Qwen2MoeForCausalLM"] and not config["norm_topk_prob"]
    assert config["shared_expert_intermediate_size"] == 64 and config["attention_bias"]
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.from_gguf(header, config, torch.float32, 256, backend=cpu, block_weights=True)
    moe = model.layers[1].moe
    assert moe is not None and moe.shared_gate is not None and moe.shared_gate.shape == (64, 1)
    assert model.num_block_weights == len(model.projections())  # the shared expert in blocks too
    ids = list(range(5, 90, 3))
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids, 64), theirs, atol=1e-4, rtol=1e-4)
    assert (_all_logits(model, ids, 1).argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.95
    cut = attrs.evolve(header, tensors=tuple(t for t in header.tensors if t.name != "blk.0.ffn_down_shexp.weight"))
    with pytest.raises(UnsupportedModel, match="blk.0.ffn_down_shexp.weight missing"):
        check_servable(cut, available=1 << 40, native=True)


def test_the_c_layer_loop_runs_the_shared_expert(tmp_path, monkeypatch):
    """Qwen2-MoE's shared expert (its gated MLP in blocks, its sigmoid gate) inside ``cpu_forward.c``'s
    mixture: the Python loop's logits and KV within float rounding, and its greedy tokens."""
    header = _q4_k_mixture(tmp_path, shared=True)
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.from_gguf(header, gguf_config(header), torch.float32, 1024, backend=cpu, block_weights=True)
    assert cpu.fusable(model) and all(la.moe is not None and la.moe.shared_gate is not None for la in model.layers)
    _fused_equals_plain(model, _counting(monkeypatch), exact=False)
    model.backend.fuse_decode = True
