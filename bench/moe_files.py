"""GGUF files of mixtures of experts (llama.cpp's ``qwen3moe`` and ``gpt-oss`` layouts): from a
checkpoint's weights, or random blocks of a real model's shape for benchmarks.

A mixture's experts are one 3-D tensor per projection and layer (``blk.N.ffn_gate_exps.weight``,
[experts, rows, cols]) beside the router (``ffn_gate_inp``). Random files are written block by
block from random bytes (valid scales put in place), not encoded from random floats: a
Qwen3-30B-A3B-shaped Q4_K_M file is ~17 GB, and encoding 30 billion floats would take an hour.

    python -m trillm.bench.moe_files TOKENIZER.gguf DST.gguf --shape qwen3-30b-a3b [--layers N]
    python -m trillm.bench.moe_files TOKENIZER.gguf DST.gguf --shape gpt-oss-20b
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trillm.bench.gguf_files import FALLBACK, QK_K, encode

# Qwen3-30B-A3B's and gpt-oss-20b's shapes (SmolLM2's vocabulary, so its tokenizer serves the file)
MOE_SHAPES: dict[str, dict[str, int]] = {
    "gpt-oss-20b": {
        "hidden": 2880,
        "layers": 24,
        "heads": 64,
        "kv_heads": 8,
        "head_dim": 64,
        "experts": 32,
        "used": 4,
        "expert_inter": 2880,
    },
    "qwen3-30b-a3b": {
        "hidden": 2048,
        "layers": 48,
        "heads": 32,
        "kv_heads": 4,
        "head_dim": 128,
        "experts": 128,
        "used": 8,
        "expert_inter": 768,
    },
}
# Bytes of a block, and where its float16 scales sit with their size against ``scale``: d, and
# Q4_K's dmin at 7.5 d, so that d * sc * q - dmin * m is centred on 0 for random q, sc and m.
_BLOCKS = {
    "Q4_K": (144, ((0, 1.0), (2, 7.5))),
    "Q6_K": (210, ((208, 1.0),)),
    "Q8_0": (34, ((0, 1.0),)),
    "Q5_0": (22, ((0, 1.0),)),
    "MXFP4": (17, ()),  # its one-byte power-of-two scale is set apart
}
_VALUES = {"Q4_K": 256, "Q6_K": 256, "Q8_0": 32, "Q5_0": 32, "MXFP4": 32}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """uint8 [rows, row bytes]: random quants and (for k-quants) random sub-block scales, with every
    block's float16 scale ``scale`` (and its minimum's): valid blocks of values of about zero mean."""
    size, scales = _BLOCKS[type_name]
    blocks = rows * cols // _VALUES[type_name]
    raw = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
    for at, factor in scales:
        raw[:, at : at + 2] = np.frombuffer(np.float16(scale * factor).tobytes(), dtype=np.uint8)
    if type_name == "MXFP4":  # E8M0: 2^(e - 128) times the doubled E2M1 values
        raw[:, 0] = 128 + round(math.log2(scale))
    return raw.reshape(rows, -1)


# A tensor to write: (name, its shape (in bytes per row for blocks), its type, what makes its data)
Planned = tuple[str, tuple[int, ...], str, Callable[[], np.ndarray]]


def _write(dst: Path, arch: str, meta: dict[str, Any], tokenizer: Path | None, tensors: list[Planned]) -> None:
    """The file, its tensors made one at a time as they are written (a 17 GB file never in memory)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    writer = GGUFWriter(dst, arch)
    if tokenizer is not None:
        for key, field in GGUFReader(tokenizer).fields.items():
            if key.startswith("tokenizer."):
                vtype = field.types[0]
                sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, value in meta.items():
        kind = {float: GGUFValueType.FLOAT32, str: GGUFValueType.STRING}.get(type(value), GGUFValueType.UINT32)
        writer.add_key_value(f"{arch}.{key}" if not key.startswith("general.") else key, value, kind)
    for name, shape, type_name, _ in tensors:
        if type_name == "F32":
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * math.prod(shape))
        else:
            qtype = GGMLQuantizationType[type_name]  # gguf reads ``shape`` as bytes per row for this
            writer.add_tensor_info(name, shape, np.dtype(np.uint8), math.prod(shape), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, shape, type_name, make in tensors:
        data = make()
        writer.write_tensor_data(data.astype(np.float32) if type_name == "F32" else data.reshape(shape))
    writer.close()


def _bytes_shape(type_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` of values as the file's byte shape: each row's values as its blocks' bytes."""
    if type_name == "F32":
        return shape
    size, _ = _BLOCKS[type_name]
    return (*shape[:-1], shape[-1] // _VALUES[type_name] * size)


def _metadata(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    return {
        "block_count": layers,
        "context_length": int(cfg.get("max_position_embeddings", 4096)),
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg.get("intermediate_size", cfg["moe_intermediate_size"]),
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": cfg["num_key_value_heads"],
        "attention.key_length": cfg["head_dim"],
        "attention.value_length": cfg["head_dim"],
        "attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope.freq_base": float(cfg.get("rope_theta", 1_000_000.0)),
        "expert_count": cfg["num_experts"],
        "expert_used_count": cfg["num_experts_per_tok"],
        "expert_feed_forward_length": cfg["moe_intermediate_size"],
    }


def qwen3_moe_from_weights(
    weights: dict[str, Any], cfg: dict[str, Any], dst: Path, type_name: str, arch: str = "qwen3moe"
) -> None:
    """A Qwen3-MoE checkpoint (HF names, float tensors) as a ``qwen3moe`` GGUF file with every
    matrix in ``type_name`` (a k-quant's fallback where rows are not whole super-blocks, as
    llama.cpp writes them); vectors and the router float32. ``arch="qwen2moe"``: a Qwen2-MoE
    checkpoint (Q/K/V biases, no Q/K norms, the shared expert and its gate).
    Every layer must be a mixture (llama.cpp's layout has no dense MLP layers in this family)."""

    def arr(name: str) -> np.ndarray:
        return weights[name].float().numpy()

    def kind(cols: int) -> str:  # rows not in whole k-quant super-blocks: llama.cpp's fallback type
        return FALLBACK[type_name] if cols % QK_K and type_name in FALLBACK else type_name

    def enc(w: np.ndarray) -> tuple[np.ndarray, str]:
        return encode(w, kind(w.shape[-1])), kind(w.shape[-1])

    def tensors() -> Iterator[tuple[str, np.ndarray, str]]:
        yield ("token_embd.weight", *enc(arr("model.embed_tokens.weight")))
        yield "output_norm.weight", arr("model.norm.weight"), "F32"
        if "lm_head.weight" in weights and not cfg.get("tie_word_embeddings"):
            yield ("output.weight", *enc(arr("lm_head.weight")))
        for i in range(cfg["num_hidden_layers"]):
            p, g = f"model.layers.{i}.", f"blk.{i}."
            yield g + "attn_norm.weight", arr(p + "input_layernorm.weight"), "F32"
            yield g + "ffn_norm.weight", arr(p + "post_attention_layernorm.weight"), "F32"
            for ours, theirs in (("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
                if f"{p}self_attn.{theirs}.weight" in weights:
                    yield g + ours + ".weight", arr(f"{p}self_attn.{theirs}.weight"), "F32"
            for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
                if f"{p}self_attn.{theirs}.bias" in weights:
                    yield g + ours + ".bias", arr(f"{p}self_attn.{theirs}.bias"), "F32"
            if p + "mlp.shared_expert_gate.weight" in weights:
                yield g + "ffn_gate_inp_shexp.weight", arr(p + "mlp.shared_expert_gate.weight").reshape(-1), "F32"
                for ours, theirs in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj")):
                    yield (g + ours + ".weight", *enc(arr(f"{p}mlp.shared_expert.{theirs}.weight")))
                yield (g + "ffn_down_shexp.weight", *enc(arr(p + "mlp.shared_expert.down_proj.weight")))
            for ours, theirs in (
                ("attn_q", "q_proj"),
                ("attn_k", "k_proj"),
                ("attn_v", "v_proj"),
                ("attn_output", "o_proj"),
            ):
                yield (g + ours + ".weight", *enc(arr(f"{p}self_attn.{theirs}.weight")))
            yield g + "ffn_gate_inp.weight", arr(p + "mlp.gate.weight"), "F32"
            for ours, theirs in (
                ("ffn_gate_exps", "gate_proj"),
                ("ffn_up_exps", "up_proj"),
                ("ffn_down_exps", "down_proj"),
            ):
                stacked = np.stack([arr(f"{p}mlp.experts.{e}.{theirs}.weight") for e in range(cfg["num_experts"])])
                experts, rows, cols = stacked.shape
                raw, t = enc(stacked.reshape(experts * rows, cols))
                yield g + ours + ".weight", raw.reshape(experts, rows, -1), t

    planned: list[Planned] = [(name, data.shape, t, functools.partial(np.asarray, data)) for name, data, t in tensors()]
    meta = _metadata(cfg, cfg["num_hidden_layers"])
    if cfg.get("shared_expert_intermediate_size"):
        meta["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    _write(dst, arch, meta, None, planned)


def random_qwen3_moe(tokenizer: Path, dst: Path, shape_name: str, layers: int | None = None, seed: int = 0) -> None:
    """A Qwen3-MoE-shaped file of random Q4_K_M-style blocks (Q4_K, with V, the experts' down and
    the embedding in Q6_K), ``tokenizer``'s vocabulary and tokenizer: the memory traffic of the real
    model, for benchmarks (its text is noise). ``layers``: fewer than the shape's. gpt-oss's shape
    is written as its own published files are: MXFP4 experts, Q8_0 attention (``random_gpt_oss``)."""
    if shape_name.startswith("gpt-oss"):
        random_gpt_oss(tokenizer, dst, shape_name, layers, seed)
        return
    from gguf import GGUFReader

    s = MOE_SHAPES[shape_name]
    hidden, n = s["hidden"], layers or s["layers"]
    vocab = len(GGUFReader(tokenizer).fields["tokenizer.ggml.tokens"].contents())
    cfg = {
        "hidden_size": hidden,
        "moe_intermediate_size": s["expert_inter"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "num_experts": s["experts"],
        "num_experts_per_tok": s["used"],
        "max_position_embeddings": 8192,
    }

    planned: list[Planned] = []

    def matrix(name: str, shape: tuple[int, ...], type_name: str, scale: float = 2e-4) -> None:
        t = FALLBACK[type_name] if shape[-1] % QK_K and type_name in FALLBACK else type_name
        seed_of = len(planned)  # each tensor its own stream: made when written, the same every time

        def make() -> np.ndarray:
            rng = np.random.default_rng([seed, seed_of])
            return random_blocks(t, math.prod(shape[:-1]), shape[-1], rng, scale)

        planned.append((name, _bytes_shape(t, shape), t, make))

    def vector(name: str, size: int) -> None:
        planned.append((name, (size,), "F32", lambda: np.ones(size, dtype=np.float32)))

    d, q, kv, e, inter = s["head_dim"], s["heads"], s["kv_heads"], s["experts"], s["expert_inter"]
    matrix("token_embd.weight", (vocab, hidden), "Q6_K", 2e-3)
    vector("output_norm.weight", hidden)
    for i in range(n):
        g = f"blk.{i}."
        for norm, size in (("attn_norm", hidden), ("ffn_norm", hidden), ("attn_q_norm", d), ("attn_k_norm", d)):
            vector(g + norm + ".weight", size)
        matrix(g + "attn_q.weight", (q * d, hidden), "Q4_K")
        matrix(g + "attn_k.weight", (kv * d, hidden), "Q4_K")
        matrix(g + "attn_v.weight", (kv * d, hidden), "Q6_K")
        matrix(g + "attn_output.weight", (hidden, q * d), "Q4_K")
        router = np.random.default_rng([seed, 1_000_000 + i]).standard_normal((e, hidden), dtype=np.float32) * 0.02
        planned.append((g + "ffn_gate_inp.weight", router.shape, "F32", functools.partial(np.asarray, router)))
        matrix(g + "ffn_gate_exps.weight", (e, inter, hidden), "Q4_K")
        matrix(g + "ffn_up_exps.weight", (e, inter, hidden), "Q4_K")
        matrix(g + "ffn_down_exps.weight", (e, hidden, inter), "Q6_K")

    meta = _metadata(cfg, n) | {"general.name": f"random {shape_name} ({n} layers, Q4_K_M-style)"}
    _write(dst, "qwen3moe", meta, tokenizer, planned)


def _gpt_oss_metadata(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    meta = _metadata(cfg, layers)
    meta.update(
        {
            "feed_forward_length": cfg["moe_intermediate_size"],
            "attention.sliding_window": cfg.get("sliding_window", 128),
            "rope.freq_base": float(cfg.get("rope_theta", 150000.0)),
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": float(cfg.get("rope_factor", 32.0)),
            "rope.scaling.original_context_length": int(cfg.get("original_context", 4096)),
        }
    )
    return meta


def gpt_oss_file(
    dst: Path,
    cfg: dict[str, Any],
    dense: dict[str, np.ndarray],
    experts: dict[str, np.ndarray],
    tokenizer: Path | None,
    q8_0: tuple[str, ...] = (),
) -> None:
    """A ``gpt-oss`` GGUF file: ``dense`` (llama.cpp's names -> float arrays, written float32, or
    Q8_0 where a name ends with one of ``q8_0``, as the published files hold attention) and
    ``experts`` (``blk.N.ffn_*_exps.weight`` -> MXFP4 bytes [experts, rows, row bytes])."""
    planned: list[Planned] = []
    for n, a in dense.items():
        if n.endswith(q8_0):  # (no suffix given: none ends with one)
            raw = encode(a, "Q8_0")
            planned.append((n, raw.shape, "Q8_0", functools.partial(np.asarray, raw)))
        else:
            planned.append((n, a.shape, "F32", functools.partial(np.asarray, a)))
    planned += [(n, raw.shape, "MXFP4", functools.partial(np.asarray, raw)) for n, raw in experts.items()]
    _write(dst, "gpt-oss", _gpt_oss_metadata(cfg, cfg["num_hidden_layers"]), tokenizer, planned)


def random_gpt_oss(tokenizer: Path, dst: Path, shape_name: str, layers: int | None = None, seed: int = 0) -> None:
    """A gpt-oss-shaped file as the published ones are quantized: MXFP4 experts, Q8_0 attention and
    embedding (random), float32 norms, sinks, router and biases."""
    from gguf import GGUFReader

    s = MOE_SHAPES[shape_name]
    hidden, n = s["hidden"], layers or s["layers"]
    vocab = len(GGUFReader(tokenizer).fields["tokenizer.ggml.tokens"].contents())
    d, q, kv, e, inter = s["head_dim"], s["heads"], s["kv_heads"], s["experts"], s["expert_inter"]
    cfg = {
        "hidden_size": hidden,
        "moe_intermediate_size": inter,
        "num_attention_heads": q,
        "num_key_value_heads": kv,
        "head_dim": d,
        "num_experts": e,
        "num_experts_per_tok": s["used"],
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
    }
    planned: list[Planned] = []

    def blocks(name: str, shape: tuple[int, ...], type_name: str, scale: float) -> None:
        seed_of = len(planned)

        def make() -> np.ndarray:
            rng = np.random.default_rng([seed, seed_of])
            return random_blocks(type_name, math.prod(shape[:-1]), shape[-1], rng, scale)

        planned.append((name, _bytes_shape(type_name, shape), type_name, make))

    def floats(name: str, shape: tuple[int, ...], scale: float | None = None) -> None:
        seed_of = len(planned)

        def make() -> np.ndarray:
            if scale is None:
                return np.ones(shape, dtype=np.float32)
            return np.random.default_rng([seed, seed_of]).standard_normal(shape, dtype=np.float32) * scale

        planned.append((name, shape, "F32", make))

    blocks("token_embd.weight", (vocab, hidden), "Q8_0", 2e-3)
    blocks("output.weight", (vocab, hidden), "Q8_0", 2e-4)
    floats("output_norm.weight", (hidden,))
    for i in range(n):
        g = f"blk.{i}."
        floats(g + "attn_norm.weight", (hidden,))
        floats(g + "post_attention_norm.weight", (hidden,))
        floats(g + "attn_sinks.weight", (q,), 0.5)
        for name, rows in (("attn_q", q * d), ("attn_k", kv * d), ("attn_v", kv * d)):
            blocks(g + name + ".weight", (rows, hidden), "Q8_0", 2e-4)
            floats(g + name + ".bias", (rows,), 0.02)
        blocks(g + "attn_output.weight", (hidden, q * d), "Q8_0", 2e-4)
        floats(g + "attn_output.bias", (hidden,), 0.02)
        floats(g + "ffn_gate_inp.weight", (e, hidden), 0.02)
        floats(g + "ffn_gate_inp.bias", (e,), 0.02)
        blocks(g + "ffn_gate_exps.weight", (e, inter, hidden), "MXFP4", 2e-3)
        blocks(g + "ffn_up_exps.weight", (e, inter, hidden), "MXFP4", 2e-3)
        blocks(g + "ffn_down_exps.weight", (e, hidden, inter), "MXFP4", 2e-3)
        for name, rows in (("ffn_gate_exps", inter), ("ffn_up_exps", inter), ("ffn_down_exps", hidden)):
            floats(g + name + ".bias", (e, rows), 0.02)
    meta = _gpt_oss_metadata(cfg, n) | {"general.name": f"random {shape_name} ({n} layers, MXFP4 experts)"}
    _write(dst, "gpt-oss", meta, tokenizer, planned)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer", type=Path, help="a GGUF file whose tokenizer the new file takes")
    parser.add_argument("dst", type=Path)
    parser.add_argument("--shape", choices=sorted(MOE_SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's")
    args = parser.parse_args()
    random_qwen3_moe(args.tokenizer, args.dst, args.shape, args.layers)
    print(f"wrote {args.dst} ({args.dst.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
