"""gpt-oss (a mixture with biases everywhere, a router whose softmax is over the top-k logits,
gate and up interleaved in one tensor per layer, a clamped SwiGLU with (up + 1), attention sinks,
sliding-window layers alternating with global ones, YaRN) through every backend and at two ranks,
against ``transformers`` on the same random bf16-free float32 weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

from trillm.bench.moe_files import gpt_oss_file
from trillm.engine.execution.backends import create_backend
from trillm.engine.execution.gguf_header import read_header
from trillm.engine.execution.gguf_model import gguf_config
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.shape import ModelShape
from trillm.kernels import cpu_decode, reference
from trillm.kernels.gguf_blocks import BLOCK_TYPES, GGUFWeight, reference_dequantize

from tests.families import (
    config_of,
    engine_serves_transformers_tokens,
    every_backend,
    q8_0_exact,
    save_random,
    steps_match_transformers,
    two_ranks_give_transformers_tokens,
)
from tests.test_cpu_forward import _counting, _fused_equals_plain
from tests.test_gguf_quality import _all_logits

ATTENTION = tuple(f"attn_{x}.weight" for x in ("q", "k", "v", "output"))  # written Q8_0
GPT_OSS = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=10,
    layer_types=["sliding_attention", "full_attention"],
    max_position_embeddings=1024,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
        "rope_theta": 150000.0,
    },
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, model_dir):
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**GPT_OSS)).eval()
    folder = save_random(model, tmp_path_factory.mktemp("gpt_oss"), model_dir)
    return folder


@pytest.fixture(scope="module")
def hf_gpt_oss(gpt_oss_dir):
    return GptOssForCausalLM.from_pretrained(gpt_oss_dir, dtype=torch.float32, attn_implementation="eager").eval()


def test_shape_reads_sinks_biases_yarn_and_windows(gpt_oss_dir):
    shape = ModelShape.from_config(config_of(gpt_oss_dir))
    assert shape.attention_sinks and shape.output_bias and shape.attention_bias and shape.expert_bias
    assert shape.activation == "swiglu_oai" and shape.layer_windows == (10, 0)
    assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size) == (4, 2, 32)
    assert shape.rope_scaling is not None and shape.rope_scaling["rope_type"] == "yarn"


def test_sinks_in_the_c_decode_kernel_are_the_reference(gpt_oss_dir):
    """A sink per head joins each softmax's denominator, windows or not."""
    torch.manual_seed(1)
    heads, kv_heads, d, pages, page = 8, 2, 32, 6, 4
    q = torch.randn(3, heads, d)
    k_cache, v_cache = torch.randn(pages, page, kv_heads, d), torch.randn(pages, page, kv_heads, d)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0], [3, 2, 1, 0]], dtype=torch.int32)
    lens = torch.tensor([15, 6, 9], dtype=torch.int32)
    sinks = torch.randn(heads) * 2
    for window in (0, 5):
        want = reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.2, window, sinks)
        got = cpu_decode.decode_attention(q, k_cache, v_cache, tables, lens, 0.2, window, sinks)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        plain = reference.decode_attention(q, k_cache, v_cache, tables, lens, 0.2, window)
        assert not torch.allclose(plain, want, atol=1e-3)  # the sinks change the result


@pytest.mark.gpu
def test_every_step_matches_transformers_on_every_backend(gpt_oss_dir, hf_gpt_oss):
    steps_match_transformers(every_backend(gpt_oss_dir), hf_gpt_oss, GPT_OSS["vocab_size"])


async def test_engine_loads_and_serves_the_folder(gpt_oss_dir, hf_gpt_oss):
    model = await engine_serves_transformers_tokens(gpt_oss_dir, hf_gpt_oss)
    assert all(layer.sinks is not None and layer.moe is not None for layer in model.layers)


@pytest.mark.slow  # rank processes
async def test_tp_2_gives_transformers_greedy_tokens(gpt_oss_dir, hf_gpt_oss):
    """Two ranks: each its heads' sinks and its slice of every expert; O's and the experts' down
    biases added once, after the all-reduce."""
    model = await two_ranks_give_transformers_tokens(gpt_oss_dir, hf_gpt_oss)
    assert model.shape.num_heads == 2 and model.layers[0].sinks.shape == (2,)


def _mxfp4(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random MXFP4 blocks [rows, cols / 32 * 17]: random E2M1 nibbles, scales 2^-6 .. 2^-5."""
    raw = rng.integers(0, 256, size=(rows, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(122, 124, size=raw.shape[:2], dtype=np.uint8)
    return raw.reshape(rows, -1)


def _decoded(raw: np.ndarray, cols: int) -> torch.Tensor:
    return reference_dequantize(GGUFWeight(BLOCK_TYPES["MXFP4"], torch.from_numpy(raw), cols))


@pytest.fixture(scope="module")
def gpt_oss_gguf(tmp_path_factory):
    """A gpt-oss GGUF file with MXFP4 experts and Q8_0 attention (as published files hold them),
    and transformers' model of the same values."""
    torch.manual_seed(2)
    cfg = {**GPT_OSS, "vocab_size": 512}
    hf = GptOssForCausalLM(GptOssConfig(**cfg)).eval()
    rng = np.random.default_rng(2)
    e, h, inter = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    raw = {
        "gate": _mxfp4(rng, e * inter, h),
        "up": _mxfp4(rng, e * inter, h),
        "down": _mxfp4(rng, e * h, inter),
    }
    gate, up = _decoded(raw["gate"], h).view(e, inter, h), _decoded(raw["up"], h).view(e, inter, h)
    down = _decoded(raw["down"], inter).view(e, h, inter)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("experts.gate_up_proj"):
                p[:, :, 0::2], p[:, :, 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
            elif name.endswith("experts.down_proj"):
                p.copy_(down.transpose(1, 2))
            elif name.endswith("_proj.weight") and ".self_attn." in name:  # Q8_0 in the file, exactly
                p.copy_(q8_0_exact(torch.randn_like(p) * 0.1))
            else:
                p.copy_(torch.randn_like(p) * 0.1)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    dense = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    dense["output.weight"] = sd["lm_head.weight"]
    experts = {}
    for i in range(cfg["num_hidden_layers"]):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        names = {
            "attn_norm.weight": "input_layernorm.weight",
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "attn_sinks.weight": "self_attn.sinks",
            "ffn_gate_inp.weight": "mlp.router.weight",
            "ffn_gate_inp.bias": "mlp.router.bias",
        }
        for x in ("q", "k", "v"):
            names |= {f"attn_{x}.weight": f"self_attn.{x}_proj.weight", f"attn_{x}.bias": f"self_attn.{x}_proj.bias"}
        names |= {"attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias"}
        dense |= {g + ours: sd[p + theirs] for ours, theirs in names.items()}
        bias = sd[p + "mlp.experts.gate_up_proj_bias"]
        dense[g + "ffn_gate_exps.bias"], dense[g + "ffn_up_exps.bias"] = bias[:, 0::2], bias[:, 1::2]
        dense[g + "ffn_down_exps.bias"] = sd[p + "mlp.experts.down_proj_bias"]
        # Every layer the same experts' bytes: what the file holds is what transformers multiplies.
        experts[g + "ffn_gate_exps.weight"] = raw["gate"].reshape(e, inter, -1)
        experts[g + "ffn_up_exps.weight"] = raw["up"].reshape(e, inter, -1)
        experts[g + "ffn_down_exps.weight"] = raw["down"].reshape(e, h, -1)
    with torch.no_grad():
        for i in range(1, cfg["num_hidden_layers"]):  # transformers' layers carry the same experts
            layer0, layer = hf.model.layers[0].mlp.experts, hf.model.layers[i].mlp.experts
            layer.gate_up_proj.copy_(layer0.gate_up_proj)
            layer.down_proj.copy_(layer0.down_proj)
    meta_cfg = {
        "hidden_size": h,
        "moe_intermediate_size": inter,
        "intermediate_size": inter,
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"],
        "num_experts": e,
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "max_position_embeddings": 1024,
        "rms_norm_eps": cfg["rms_norm_eps"],
        "sliding_window": cfg["sliding_window"],
        "rope_theta": 150000.0,
        "rope_factor": 8.0,
        "original_context": 128,
    }
    path = tmp_path_factory.mktemp("gpt_oss_gguf") / "gpt-oss-mxfp4.gguf"
    gpt_oss_file(path, meta_cfg, dense, experts, None, q8_0=ATTENTION)
    return hf, path


def test_a_gguf_file_with_mxfp4_experts_is_transformers(gpt_oss_gguf):
    """llama.cpp's gpt-oss layout (post_attention_norm, attn_sinks, expert biases, YaRN) with its
    experts in MXFP4 blocks, each expert a view of the file: prefilled (float32 activations) the
    logits are transformers'; a token a step (int16 activations), within that path's rounding."""
    hf, path = gpt_oss_gguf
    header = read_header(path)
    config = gguf_config(header)
    assert config["architectures"] == ["GptOssForCausalLM"] and config["layer_types"] == [
        "sliding_attention",
        "full_attention",
    ]
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.from_gguf(header, config, torch.float32, 256, backend=cpu, block_weights=True)
    assert all(isinstance(p, GGUFWeight) and p.kind.name == "MXFP4" for p in model.layers[0].moe.down)
    ids = list(range(3, 75, 2))
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_all_logits(model, ids, 64), theirs, atol=3e-4, rtol=1e-4)
    decoded = _all_logits(model, ids, 1)
    assert (decoded.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.95
    assert (decoded - theirs).abs().max() < 0.02 * theirs.abs().max()


def _hf_mxfp4(raw: np.ndarray, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 rows as an HF checkpoint holds them: (blocks [E, rows, cols/32, 16], scales
    [E, rows, cols/32]), each byte two neighbouring values (low nibble first)."""
    blocks = torch.from_numpy(raw).view(experts, rows, cols // 32, 17)
    values = torch.cat([blocks[..., 1:] & 15, blocks[..., 1:] >> 4], dim=-1)  # GGUF: halves
    pairs = values[..., 0::2] | (values[..., 1::2] << 4)
    return pairs.contiguous(), blocks[..., 0].contiguous()


def test_an_mxfp4_checkpoint_keeps_its_experts_in_blocks(gpt_oss_gguf, tmp_path, model_dir):
    """gpt-oss's published checkpoints: the experts as ``*_blocks`` / ``*_scales`` (MXFP4, gate and
    up rows interleaved). Kept in MXFP4 blocks on the CPU path (decoded elsewhere), the same logits
    as transformers on the values they hold."""
    from safetensors.torch import save_file

    hf, path = gpt_oss_gguf
    header = read_header(path)
    cfg = {**GPT_OSS, "vocab_size": 512}
    e, h, inter = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    file = np.memmap(path, dtype=np.uint8, mode="r")
    raw = {
        t.name.split(".")[2]: np.array(file[t.offset : t.offset + t.nbytes]).reshape(-1, t.dims[0] // 32 * 17)
        for t in header.tensors
        if t.name.startswith("blk.0.ffn_") and t.name.endswith("_exps.weight")
    }
    gate_blocks, gate_scales = _hf_mxfp4(raw["ffn_gate_exps"], e, inter, h)
    up_blocks, up_scales = _hf_mxfp4(raw["ffn_up_exps"], e, inter, h)
    down_blocks, down_scales = _hf_mxfp4(raw["ffn_down_exps"], e, h, inter)
    interleave = lambda a, b: torch.stack([a, b], dim=2).flatten(1, 2).contiguous()  # noqa: E731
    tensors = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    for i in range(cfg["num_hidden_layers"]):
        x = f"model.layers.{i}.mlp.experts."
        tensors.pop(x + "gate_up_proj"), tensors.pop(x + "down_proj")
        tensors[x + "gate_up_proj_blocks"] = interleave(gate_blocks, up_blocks)  # a tensor each: none shared
        tensors[x + "gate_up_proj_scales"] = interleave(gate_scales, up_scales)
        tensors[x + "down_proj_blocks"], tensors[x + "down_proj_scales"] = down_blocks.clone(), down_scales.clone()
    folder = tmp_path / "gpt-oss-mxfp4"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    hf.config.save_pretrained(folder)
    config = {**json.loads((folder / "config.json").read_text()), "architectures": ["GptOssForCausalLM"]}
    ids = list(range(3, 75, 2))
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    kept = DecoderModel.load(folder, config, torch.float32, 256, backend=cpu, block_weights=True)
    assert all(isinstance(w, GGUFWeight) and w.kind.name == "MXFP4" for w in kept.layers[1].moe.down)
    torch.testing.assert_close(_all_logits(kept, ids, 64), theirs, atol=3e-4, rtol=1e-4)
    reference = create_backend("reference", torch.device("cpu"), torch.float32)
    decoded = DecoderModel.load(folder, config, torch.float32, 256, backend=reference)
    assert isinstance(decoded.layers[0].moe.gate_up[0], torch.Tensor)
    torch.testing.assert_close(_all_logits(decoded, ids, 64), theirs, atol=2e-4, rtol=1e-4)


def test_the_c_layer_loop_runs_gpt_oss_as_the_python_loop(gpt_oss_gguf, monkeypatch):
    """Sinks, Q/K/V and O biases, the router's bias, the experts' biases and the clamped SwiGLU in
    ``cpu_forward.c``, the MXFP4 experts as grouped calls: decode batches of 7 down to 1 rows give
    the Python loop's logits and KV within float rounding, and its greedy tokens."""
    _, path = gpt_oss_gguf
    header = read_header(path)
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    model = DecoderModel.from_gguf(header, gguf_config(header), torch.float32, 1024, backend=cpu, block_weights=True)
    assert cpu.fusable(model)
    assert all(la.sinks is not None and la.o_bias is not None and la.qkv_bias is not None for la in model.layers)
    _fused_equals_plain(model, _counting(monkeypatch), exact=False)
    model.backend.fuse_decode = True
