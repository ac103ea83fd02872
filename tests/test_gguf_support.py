"""A GGUF file trillm cannot serve is refused from its header, in one line, before any work:
the issue's Gemma 3 file was first dequantized whole to a 1.07 GB float32 cache, then refused
with a traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from trillm.engine.execution.gguf_header import read_header
from trillm.engine.execution.gguf_support import LAYER_TENSORS, UnsupportedModel, check_servable, float32_bytes
from trillm.engine.execution.model_source import resolve_model
from trillm.engine.execution.native_memory import resident_file_bytes

HIDDEN, LAYERS = 64, 2


def write_model(
    path: Path,
    arch: str = "llama",
    odd_type: GGMLQuantizationType | None = None,
    skip: str | None = None,
    parts: tuple[str, ...] = LAYER_TENSORS,
) -> Path:
    """A tiny model's header and tensors (zeros): ``odd_type`` for blk.1.ffn_down, ``skip`` left out,
    ``parts`` the tensors of each layer."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    names = ["token_embd.weight", "output_norm.weight"]
    names += [f"blk.{i}.{part}.weight" for i in range(LAYERS) for part in parts]
    for name in names:
        if name == skip:
            continue
        if name == "blk.1.ffn_down.weight" and odd_type is not None:
            block, size = GGML_QUANT_SIZES[odd_type]
            raw = np.zeros((HIDDEN, HIDDEN // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=odd_type)
        else:
            writer.add_tensor(name, np.zeros((HIDDEN,) if "norm" in name else (HIDDEN, HIDDEN), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def refusal(path: Path, available: int | None = 1 << 40) -> str:
    with pytest.raises(UnsupportedModel) as refused:
        check_servable(read_header(path), available)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message
    return message


def test_a_served_architecture_with_read_types_passes(tmp_path):
    check_servable(read_header(write_model(tmp_path / "ok.gguf")), available=1 << 40)
    check_servable(read_header(write_model(tmp_path / "q6k.gguf", odd_type=GGMLQuantizationType.Q6_K)), 1 << 40)


def test_an_architecture_not_served_is_refused_by_name(tmp_path):
    assert "architecture 'falcon' is not served yet" in refusal(write_model(tmp_path / "f.gguf", arch="falcon"))


def test_regression_a_gemma3_file_is_checked_for_its_own_tensors(tmp_path):
    """Gemma 3 is served now; a file of it without the norms around each block's output is refused."""
    assert "tensor blk.0.attn_q_norm.weight and 7 more missing for a 2-layer gemma3 model" in refusal(
        write_model(tmp_path / "g.gguf", arch="gemma3")
    )


def test_a_mapped_file_already_in_memory_needs_no_more(tmp_path):
    """Its blocks mapped, a file another process holds in the page cache (llama-server on the same
    GGUF) costs nothing more: the memory check counts its resident pages as room."""
    path = write_model(tmp_path / "held.gguf")
    path.read_bytes()  # now in the page cache
    header = read_header(path)
    assert resident_file_bytes(path) >= header.file_size - 4096
    check_servable(header, available=0, native=True)
    with pytest.raises(UnsupportedModel, match="GiB of memory is available"):
        check_servable(header, available=0)  # dequantized to float32: new memory all of it


def test_an_iq_tensor_is_refused_naming_the_tensor_and_its_type(tmp_path):
    path = write_model(tmp_path / "iq.gguf", odd_type=GGMLQuantizationType.IQ4_XS)
    assert "tensor blk.1.ffn_down.weight is IQ4_XS, which trillm does not read yet" in refusal(path)


def test_phi3_files_have_gate_and_up_in_one_matrix_with_qkv_fused_or_not(tmp_path):
    """llama.cpp writes Phi-3's gate and up as one ffn_up, and Q, K, V as attn_qkv or apart: no ffn_gate is wanted."""
    apart = tuple(p for p in LAYER_TENSORS if p != "ffn_gate")
    check_servable(read_header(write_model(tmp_path / "apart.gguf", "phi3", parts=apart)), available=1 << 40)
    fused = tuple(p for p in apart if p not in ("attn_q", "attn_k", "attn_v")) + ("attn_qkv",)
    check_servable(read_header(write_model(tmp_path / "fused.gguf", "phi3", parts=fused)), available=1 << 40)
    cut = write_model(tmp_path / "cut.gguf", "phi3", skip="blk.1.attn_qkv.weight", parts=fused)
    assert "tensor blk.1.attn_qkv.weight missing for a 2-layer phi3 model" in refusal(cut)


def test_a_missing_tensor_is_named(tmp_path):
    path = write_model(tmp_path / "cut.gguf", skip="blk.1.attn_k.weight")
    assert "tensor blk.1.attn_k.weight missing for a 2-layer llama model" in refusal(path)


def test_a_model_whose_float32_conversion_does_not_fit_in_memory_is_refused(tmp_path):
    header = read_header(write_model(tmp_path / "big.gguf"))
    need = float32_bytes(header)
    assert need == 4 * (HIDDEN * HIDDEN + HIDDEN + LAYERS * (2 * HIDDEN + 7 * HIDDEN * HIDDEN))
    check_servable(header, available=need)
    assert "GiB of memory is available" in refusal(header.path, available=need - 1)


def test_resolving_an_unservable_file_converts_nothing(tmp_path):
    path = write_model(tmp_path / "g.gguf", arch="gemma3")
    cache = tmp_path / "cache"
    with pytest.raises(UnsupportedModel, match="gemma3"):
        resolve_model(str(path), cache)
    assert not any(p.suffix != ".lock" for p in cache.rglob("*") if p.is_file())  # no conversion was begun


def test_a_file_decoded_dense_that_does_not_fit_is_refused_before_decoding(tmp_path):
    from trillm.engine.execution.gguf_support import check_decoded_fits

    header = read_header(write_model(tmp_path / "dense.gguf"))
    need = float32_bytes(header)
    check_decoded_fits(header, 4, available=need)
    with pytest.raises(UnsupportedModel, match="decoded to 32-bit floats take .* GiB of memory is available"):
        check_decoded_fits(header, 4, available=need - 1)
    check_decoded_fits(header, 2, available=need // 2)  # bfloat16: half
