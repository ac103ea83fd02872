"""A GGUF file is served as it is: config from its metadata, weights from the mapped file.

The default model (the alias, whose GGUF file is read as it is, as any ``.gguf`` path is) must
be the same model as its float32 conversion, the checkpoint ``test_model_correctness`` holds to
``transformers``: the same config numbers, the same tokenizer and chat template, every
projection the same values (Q/K rows put back in HF's order), and the same greedy answers
through a real server and the ``openai`` client.
"""

from __future__ import annotations

import attrs
import openai
import pytest
import torch

from trillm.engine.config import EngineConfig
from trillm.engine.execution.gguf_header import read_header
from trillm.engine.execution.gguf_model import gguf_config
from trillm.engine.execution.layers import embed_rows
from trillm.engine.execution.loading import load_model
from trillm.engine.execution.model_source import default_gguf, fetch_default_gguf
from trillm.engine.execution.rope import inverse_frequencies
from trillm.engine.execution.shape import ModelShape
from trillm.kernels.block_weights import Q4_1Weight, Q8_0Weight, dequantize

from tests.server import running_server

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def native_parts(model_parts):
    """The alias's model: its GGUF file read as it is (the suite's shared ``model_parts``)."""
    return model_parts


@pytest.fixture(scope="module")
def converted_parts(model_dir):
    """The same model from its float32 safetensors conversion, a checkpoint folder."""
    return load_model(EngineConfig(model=str(model_dir), dtype="float32"))


def test_the_alias_is_read_as_any_gguf_path_is(native_parts):
    gguf = fetch_default_gguf(EngineConfig().cache_path)
    by_path = load_model(EngineConfig(model=str(gguf), dtype="float32"))[0]
    for mine, theirs in zip(native_parts[0].projections(), by_path.projections()):
        assert torch.equal(dequantize(mine), dequantize(theirs))  # type: ignore[arg-type]


def test_the_config_from_the_metadata_is_the_checkpoints(model_dir):
    import json

    gguf = default_gguf(EngineConfig().cache_path)
    from_file = gguf_config(read_header(gguf))
    converted = json.loads((model_dir / "config.json").read_text())
    mine, theirs = ModelShape.from_config(from_file), ModelShape.from_config(converted)
    assert attrs.evolve(mine, rope_scaling=None) == attrs.evolve(theirs, rope_scaling=None)
    assert torch.equal(
        inverse_frequencies(64, 1e5, mine.rope_scaling), inverse_frequencies(64, 1e5, theirs.rope_scaling)
    )
    assert from_file["eos_token_id"] == converted["eos_token_id"]


def test_every_weight_equals_the_float32_conversion(native_parts, converted_parts):
    native, converted = native_parts[0], converted_parts[0]
    assert native.num_block_weights == len(native.projections()) == converted.num_block_weights
    assert isinstance(native.embed, Q8_0Weight)  # the tied embedding stays in its blocks: rows decoded on lookup
    ids = torch.arange(0, native.shape.vocab_size, 97)
    assert torch.equal(embed_rows(native.embed, ids), converted.embed[ids])
    for mine, theirs in zip(native.projections(), converted.projections()):
        assert isinstance(mine, (Q4_1Weight, Q8_0Weight))
        assert torch.equal(dequantize(mine), dequantize(theirs))  # type: ignore[arg-type]
    for mine_layer, their_layer in zip(native.layers, converted.layers):
        assert torch.equal(mine_layer.input_norm, their_layer.input_norm)
        assert torch.equal(mine_layer.post_norm, their_layer.post_norm)
    assert torch.equal(native.final_norm, converted.final_norm)
    assert torch.equal(native.cos, converted.cos)


def test_the_tokenizer_and_template_come_from_the_file(native_parts, converted_parts):
    mine, theirs = native_parts[1], converted_parts[1]
    # read by the generic class from tokenizer.json (the family's own rebuilt it in Python too: memory)
    assert type(mine).__name__ in ("TokenizersBackend", "PreTrainedTokenizerFast")
    text = "The capital of France is Paris. 1, 2, 3 — ünïcode!"
    assert mine(text)["input_ids"] == theirs(text)["input_ids"]
    ids = theirs(text + " <|im_end|>")["input_ids"]
    assert mine.decode(ids) == theirs.decode(ids)
    assert mine.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert (mine.bos_token_id, mine.eos_token_id, mine.all_special_ids) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.all_special_ids,
    )
    messages = [{"role": "user", "content": "Hi"}]
    assert mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert native_parts[2] == converted_parts[2]


async def test_greedy_answers_through_the_server_equal_the_converted_models(native_parts, converted_parts):
    answers = []
    for parts in (native_parts, converted_parts):
        async with running_server(parts) as srv:
            client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="x")
            served = (await client.models.list()).data[0].id
            chat = await client.chat.completions.create(
                model=served,
                messages=[{"role": "user", "content": "Name three colours."}],
                max_tokens=24,
                temperature=0,
            )
            text = await client.completions.create(model=served, prompt="1, 2, 3,", max_tokens=16, temperature=0)
            answers.append((chat.choices[0].message.content, text.choices[0].text))
    assert answers[0] == answers[1]
    assert all(answers[0])


def test_a_file_with_a_damaged_norm_is_refused_naming_the_tensor(tmp_path):
    import shutil

    import numpy as np

    from trillm.engine.execution.backends import create_backend
    from trillm.engine.execution.file_checks import DamagedModelFile
    from trillm.engine.execution.model import DecoderModel

    path = tmp_path / "damaged.gguf"
    shutil.copy(default_gguf(EngineConfig().cache_path), path)
    norm = next(t for t in read_header(path).tensors if t.name == "blk.3.ffn_norm.weight")
    with open(path, "r+b") as f:
        f.seek(norm.offset + 8)
        f.write(np.array([np.nan], dtype=np.float32).tobytes())
    header = read_header(path)
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    with pytest.raises(DamagedModelFile, match=r"damaged.gguf is damaged: tensor blk.3.ffn_norm.weight holds NaN"):
        DecoderModel.from_gguf(header, gguf_config(header), torch.float32, 256, backend=cpu, block_weights=True)
