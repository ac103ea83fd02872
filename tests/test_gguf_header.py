"""Our GGUF header reader against ``gguf``'s own ``GGUFReader``, and damaged files refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from trillm.engine.execution.file_checks import DamagedModelFile, check_gguf
from trillm.engine.execution.gguf_header import GGUFFormatError, read_header

SCALARS = {
    "t.u8": (7, GGUFValueType.UINT8),
    "t.i8": (-7, GGUFValueType.INT8),
    "t.u16": (65000, GGUFValueType.UINT16),
    "t.i16": (-300, GGUFValueType.INT16),
    "t.u32": (4_000_000_000, GGUFValueType.UINT32),
    "t.i32": (-2_000_000_000, GGUFValueType.INT32),
    "t.f32": (0.5, GGUFValueType.FLOAT32),
    "t.bool": (True, GGUFValueType.BOOL),
    "t.u64": (2**63, GGUFValueType.UINT64),
    "t.i64": (-(2**40), GGUFValueType.INT64),
    "t.f64": (1e-300, GGUFValueType.FLOAT64),
    "t.str": ("héllo {{ chat }}", GGUFValueType.STRING),
}
TENSORS = {  # name -> (shape [rows, cols], type)
    "emb.weight": ((64, 96), GGMLQuantizationType.Q8_0),
    "blk.0.q.weight": ((32, 64), GGMLQuantizationType.Q4_1),
    "blk.0.norm.weight": ((96,), GGMLQuantizationType.F32),
    "blk.0.k.weight": ((16, 32), GGMLQuantizationType.F16),
}


def write_small(path: Path) -> None:
    """Every metadata value type, arrays of numbers and of strings, tensors of four types."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    for key, (value, kind) in SCALARS.items():
        writer.add_key_value(key, value, kind)
    writer.add_array("t.tokens", ["<s>", "héllo", "", "▁world"] * 50)
    writer.add_array("t.ids", [3, 1, 4, 1, 5])
    writer.add_array("t.floats", [0.25, -1.5])
    for name, (shape, kind) in TENSORS.items():
        values = rng.standard_normal(shape).astype(np.float32)
        if kind == GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        elif kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    write_small(path)
    return path


def test_metadata_and_tensor_table_equal_gguf_readers(small):
    ours, theirs = read_header(small), GGUFReader(small)
    assert ours.data_offset == theirs.data_offset
    assert set(ours.metadata) == set(theirs.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.metadata[key]
        if field.types[0] == GGUFValueType.ARRAY:
            expected = field.contents()
            if field.types[-1] == GGUFValueType.STRING:
                assert value == expected, key
            else:
                assert isinstance(value, np.ndarray) and value.tolist() == pytest.approx(expected), key
        else:
            assert value == pytest.approx(field.contents()), key
    assert ours.metadata["t.str"] == "héllo {{ chat }}" and ours.metadata["t.u64"] == 2**63
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.type == int(reference.tensor_type)
        assert mine.offset == reference.data_offset and mine.nbytes == int(reference.n_bytes)
        assert mine.dims == tuple(int(d) for d in reference.shape)
        assert mine.shape == TENSORS[mine.name][0]
    assert ours.end == ours.file_size == small.stat().st_size


def test_the_default_models_header_reads_in_a_fraction_of_a_second(model_dir):
    from trillm.engine import default_gguf
    from trillm.engine.config import EngineConfig

    header = read_header(default_gguf(EngineConfig().cache_path))
    assert header.metadata["general.architecture"] == "llama"
    assert len(header.metadata["tokenizer.ggml.tokens"]) == header.metadata["llama.vocab_size"] == 49152
    assert {t.type for t in header.tensors} == {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q8_0,
    }
    assert header.end == header.file_size


def test_a_file_cut_in_its_header_or_among_its_tensors_is_refused(small, tmp_path):
    whole = small.read_bytes()
    header_end = read_header(small).data_offset
    in_header = tmp_path / "in_header.gguf"
    in_header.write_bytes(whole[: header_end // 2])
    with pytest.raises(GGUFFormatError, match="past the end"):
        read_header(in_header)
    with pytest.raises(DamagedModelFile, match="not a complete GGUF file"):
        check_gguf(in_header)
    in_tensors = tmp_path / "in_tensors.gguf"
    in_tensors.write_bytes(whole[:-100])
    assert read_header(in_tensors).end > in_tensors.stat().st_size
    with pytest.raises(DamagedModelFile, match="truncated: its tensors end at byte"):
        check_gguf(in_tensors)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + whole[4:])
    with pytest.raises(GGUFFormatError, match="no GGUF magic"):
        read_header(other)


def test_absurd_counts_are_refused_at_once(small, tmp_path):
    data = bytearray(small.read_bytes())
    data[16:24] = (2**60).to_bytes(8, "little")  # the metadata count
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="metadata entries"):
        read_header(bad)
