"""Write GGUF files of any kept type from real weights: k-quant encoders and a requantizer.

``gguf`` decodes every type but encodes only the legacy ones (Q4_0 .. Q8_0); the k-quant
encoders here (Q4_K, Q5_K, Q6_K) are plain min/max fits, not llama.cpp's search, which is
enough to make valid files with real weights for the tests and benchmarks: what is measured
is that we serve what the file holds, checked against ``gguf``'s decoders.

    python -m trillm.bench.gguf_files SRC.gguf DST.gguf --scheme q4_k_m

requantizes SRC (any type trillm reads) into DST with SRC's metadata (tokenizer, template);
``--random llama-3.2-1b`` (or ``llama-3.1-8b``) writes random weights of that shape instead,
with SRC's tokenizer: benchmark files of a real size.
Schemes: ``q4_k_m`` (Q4_K, with V, FFN-down and the embedding in Q6_K, as llama.cpp's
Q4_K_M mostly is), ``q4_k``, ``q5_k``, ``q6_k``, ``q8_0``, ``q4_0``; a matrix whose rows are not
whole 256-value super-blocks gets llama.cpp's fallback type (``FALLBACK``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np

QK_K = 256


def _f16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float16 bytes [..., 2], the float32 value the decoder will see)."""
    half = values.astype(np.float16)
    return half.view(np.uint8).reshape(*values.shape, 2), half.astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _min_scales(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's fit of [n, 8, 32]: the super-block's d, dmin (float16 bytes and values), the
    6-bit scales and minimums [n, 8] and the quants [n, 8, 32] in 0..levels."""
    low = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - low) / levels
    d_bytes, d = _f16(scale.max(-1) / 63)
    m_bytes, dmin = _f16((-low).max(-1) / 63)
    sc = np.clip(np.rint(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-low, dmin[:, None])), 0, 63).astype(np.uint8)
    dl = (d[:, None] * sc)[..., None]
    ml = (dmin[:, None] * mn)[..., None]
    q = np.clip(np.rint(_safe_div(x + ml, np.broadcast_to(dl, x.shape))), 0, levels).astype(np.uint8)
    return d_bytes, m_bytes, sc, mn, q


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes of 8 six-bit scales and minimums (ggml's ``get_scale_min_k4`` read back)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | (sc[:, 4:8] >> 4) << 6
    out[:, 4:8] = mn[:, 0:4] | (mn[:, 4:8] >> 4) << 6
    out[:, 8:12] = (sc[:, 4:8] & 15) | (mn[:, 4:8] & 15) << 4
    return out


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] quants -> [n, 128]: sub-blocks 2g and 2g + 1 share 32 bytes (low, high nibble)."""
    low, high = q[:, 0::2] & 15, q[:, 1::2] & 15
    return (low | high << 4).reshape(q.shape[0], 128)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _min_scales(x, 15)
    return np.concatenate([d, dmin, _pack_scales(sc, mn), _nibbles(q)], axis=1)


def encode_q5_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(-1, 8, 32).astype(np.float32)
    d, dmin, sc, mn, q = _min_scales(x, 31)
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for s in range(8):
        qh |= ((q[:, s] >> 4) & 1) << s
    return np.concatenate([d, dmin, _pack_scales(sc, mn), qh, _nibbles(q)], axis=1)


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(-1, 16, 16).astype(np.float32)
    n = x.shape[0]
    sub = np.abs(x).max(-1) / 31
    d_bytes, d = _f16(sub.max(-1) / 127)
    sc = np.clip(np.rint(_safe_div(sub, d[:, None])), -128, 127).astype(np.int8)
    dl = (d[:, None] * sc)[..., None]
    q = (np.clip(np.rint(_safe_div(x, np.broadcast_to(dl, x.shape))), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    ql = np.zeros((n, 128), dtype=np.uint8)
    qh = np.zeros((n, 64), dtype=np.uint8)
    for v0 in range(0, 256, 32):  # value v = half * 128 + w; w / 64 picks the nibble, w / 32 the 2 bits
        half, w0 = divmod(v0, 128)
        part = q[:, v0 : v0 + 32]
        ql[:, half * 64 + w0 % 64 : half * 64 + w0 % 64 + 32] |= (part & 15) << (4 * (w0 // 64))
        qh[:, half * 32 : half * 32 + 32] |= (part >> 4) << (2 * (w0 // 32))
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)


ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": encode_q4_k,
    "Q5_K": encode_q5_k,
    "Q6_K": encode_q6_k,
}


def encode(w: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [N, K] -> uint8 [N, row bytes] in ``type_name``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    N = w.shape[0]
    if type_name in ENCODERS:
        return ENCODERS[type_name](w).reshape(N, -1)
    if type_name in ("F16", "BF16"):
        bits = (
            w.astype(np.float16)
            if type_name == "F16"
            else (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        )
        return bits.view(np.uint8).reshape(N, -1)
    return quantize(w.astype(np.float32), GGMLQuantizationType[type_name]).reshape(N, -1)


def _q4_k_m(name: str, index: int) -> str:
    return (
        "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight", "token_embd.weight", "output.weight")) else "Q4_K"
    )


# What llama.cpp's quantizer writes for rows of a width that is not a multiple of 256 (SmolLM2's
# 576, Gemma 3 270M's 640: why the real Gemma file holds Q5_0 and Q8_0 tensors too).
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
MIXED_CYCLE = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_1", "F16", "BF16")

# scheme -> (a matrix's name, its index in the file) -> its type
SCHEMES: dict[str, Callable[[str, int], str]] = {
    "q4_k_m": _q4_k_m,
    "q4_k": lambda name, index: "Q4_K",
    "q5_k": lambda name, index: "Q5_K",
    "q6_k": lambda name, index: "Q6_K",
    "q8_0": lambda name, index: "Q8_0",
    "q4_0": lambda name, index: "Q4_0",
    # each matrix the next type: one file holds every encodable type, and fused projections of
    # different types (a file for tests, not a useful quantization)
    "mixed": lambda name, index: MIXED_CYCLE[index % len(MIXED_CYCLE)],
}


VOCABULARY_KEYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)


def requantize(src: Path, dst: Path, scheme: str, layers: int | None = None, vocabulary: bool = True) -> None:
    """``src``'s matrices decoded and encoded again by ``scheme``; vectors and metadata copied.
    ``layers``: keep only the first ones (a smaller model of the same kind, for tests).
    ``vocabulary=False`` leaves the tokenizer's vocabulary and merges out (a file for weights
    only: readers parse its header in milliseconds instead of seconds)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    choose = SCHEMES[scheme]
    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or (not vocabulary and key in VOCABULARY_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = layers if key == f"{arch}.block_count" and layers is not None else field.contents()
        writer.add_key_value(key, value, vtype, sub_type=sub)
    kept = [t for t in reader.tensors if layers is None or not _layer_at_or_past(t.name, layers)]
    for index, tensor in enumerate(kept):
        shape = tuple(int(d) for d in reversed(tensor.shape))  # row-major
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if len(shape) != 2:
            writer.add_tensor(tensor.name, values)  # vectors (norms) stay float32
            continue
        target = choose(tensor.name, index)
        if shape[1] % QK_K and target in FALLBACK:
            target = FALLBACK[target]  # rows not in whole super-blocks: llama.cpp's fallback types
        raw = encode(values, target)
        writer.add_tensor(tensor.name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[target])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Llama shapes for benchmark files with random blocks (SmolLM2's vocabulary, so its tokenizer serves them)
SHAPES: dict[str, dict[str, int | float]] = {
    "llama-3.2-1b": {"hidden": 2048, "inter": 8192, "layers": 16, "heads": 32, "kv_heads": 8, "tied": 1},
    "llama-3.1-8b": {"hidden": 4096, "inter": 14336, "layers": 32, "heads": 32, "kv_heads": 8, "tied": 0},
}


def random_model(src: Path, dst: Path, shape_name: str, scheme: str, seed: int = 0) -> None:
    """A Llama-shaped file of random weights (normal, std 0.02; unit norms) encoded by ``scheme``,
    with ``src``'s tokenizer and template: the memory traffic of a real model of that size, for
    benchmarks (its text is noise)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    shape = SHAPES[shape_name]
    hidden, inter, layers = int(shape["hidden"]), int(shape["inter"]), int(shape["layers"])
    heads, kv_heads = int(shape["heads"]), int(shape["kv_heads"])
    head_dim = hidden // heads
    reader = GGUFReader(src)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    writer = GGUFWriter(dst, "llama")
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.", "llama.")):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_name(f"random {shape_name} ({scheme})")
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    rng = np.random.default_rng(seed)
    choose = SCHEMES[scheme]
    matrices = [("token_embd.weight", vocab, hidden)]
    if not shape["tied"]:
        matrices.append(("output.weight", vocab, hidden))
    for i in range(layers):
        p = f"blk.{i}."
        matrices += [
            (p + "attn_q.weight", heads * head_dim, hidden),
            (p + "attn_k.weight", kv_heads * head_dim, hidden),
            (p + "attn_v.weight", kv_heads * head_dim, hidden),
            (p + "attn_output.weight", hidden, heads * head_dim),
            (p + "ffn_gate.weight", inter, hidden),
            (p + "ffn_up.weight", inter, hidden),
            (p + "ffn_down.weight", hidden, inter),
        ]
        for norm in ("attn_norm.weight", "ffn_norm.weight"):
            writer.add_tensor(p + norm, np.ones(hidden, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for index, (name, rows, cols) in enumerate(matrices):
        target = choose(name, index)
        if cols % QK_K and target in FALLBACK:
            target = FALLBACK[target]
        values = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        raw = encode(values, target)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[target])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _layer_at_or_past(name: str, layers: int) -> bool:
    parts = name.split(".")
    return parts[0] == "blk" and int(parts[1]) >= layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a GGUF file: the weights to requantize, or with --random the tokenizer")
    parser.add_argument("dst", type=Path)
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default="q4_k_m")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first LAYERS layers")
    parser.add_argument("--random", choices=sorted(SHAPES), help="random weights of this Llama shape instead")
    args = parser.parse_args()
    if args.random:
        random_model(args.src, args.dst, args.random, args.scheme)
    else:
        requantize(args.src, args.dst, args.scheme, args.layers)
    print(f"wrote {args.dst} ({args.dst.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
