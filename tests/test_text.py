"""Detokenization, sampling and rotary embeddings: the small pure parts."""

from __future__ import annotations

import torch

from trillm.engine.execution.rope import inverse_frequencies
from trillm.engine.execution.sampler import sample
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! Ça va? naïve café — 東京タワー 🎉🧑‍💻 emoji",
    "   leading spaces\n\n\ttabs and  double  spaces",
    "Ελληνικά, русский, עברית, العربية, हिन्दी",
]


def test_streamed_pieces_concatenate_to_the_decoded_text(tokenizer):
    for text in TEXTS:
        prompt = tokenizer("Say:")["input_ids"]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        pieces = [detok.push(t) for t in ids]
        pieces.append(detok.flush())
        assert "".join(pieces) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)


def test_a_split_multibyte_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer("🎉", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE splits it
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.push(t) for t in ids] == [""] * (len(ids) - 1) + ["🎉"]


def test_flush_emits_a_dangling_partial_character(tokenizer):
    ids = tokenizer("🎉", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [])
    held = detok.push(ids[0])
    assert held == "" and detok.flush() != ""


def test_sampler_greedy_topk_topp_per_row():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    best = logits.argmax(dim=-1).tolist()
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, top_k=3),
    ]
    top3 = set(logits[3].topk(3).indices.tolist())
    for _ in range(50):
        out = sample(logits, params)
        assert out[:3] == best[:3]
        assert out[3] in top3


def test_sampler_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]]))
    torch.manual_seed(1)
    draws = [sample(logits, [SamplingParams(temperature=1.0)])[0] for _ in range(3000)]
    freq = [draws.count(i) / len(draws) for i in range(4)]
    assert abs(freq[0] - 0.7) < 0.04 and abs(freq[1] - 0.2) < 0.04 and freq[3] == 0


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inverse_frequencies(128, 500000.0, scaling)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=0)


def test_penalties_bias_and_bans_follow_their_formulas():
    from trillm.engine.execution.sampler import adjust
    from trillm.engine.step import SampleRow

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    params = SamplingParams(
        temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias=((4, 10.0),)
    )
    row = SampleRow(params, None, prompt_ids=(0,), output_ids=(1, 1, 2), banned_ids=(3,))
    out = adjust(logits, [row])[0].tolist()
    # token 0: prompt only -> repetition 2.0 / 2; token 1: -1 * 2 then -(0.25 * 2 + 0.5); token 2: 0.5 / 2 - 0.75
    assert out[0] == 1.0
    assert out[1] == -2.0 - 1.0
    assert out[2] == 0.25 - 0.75
    assert out[3] == float("-inf")  # banned (min_tokens not reached)
    assert out[4] == 11.0
    assert logits[0, 4] == 1.0  # the input is not modified


def test_seeded_rows_draw_the_same_whatever_the_batch():
    from trillm.engine.step import SampleRow

    torch.manual_seed(3)
    logits = torch.randn(4, 100)
    seeded = SamplingParams(temperature=1.0, seed=7)
    other = SamplingParams(temperature=1.0)

    def seeded_row() -> SampleRow:
        return SampleRow(seeded, torch.Generator().manual_seed(7))

    alone = [sample(logits[:1], [seeded_row()])[0] for _ in range(20)]
    crowded = [
        sample(logits, [seeded_row(), SampleRow(other), SampleRow(other), SampleRow(other)])[0] for _ in range(20)
    ]
    assert alone == crowded
    unseeded = {sample(logits[:1], [SampleRow(other)])[0] for _ in range(20)}
    assert len(unseeded) > 1  # without a seed the draws do vary


def test_incremental_detokenizer_property(tokenizer):
    """For any text, the streamed pieces concatenate to the decoded text and never hold U+FFFD."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=150, deadline=None, database=None)
    @given(st.text(max_size=60), st.sampled_from(["", "Hi:", "<|im_start|>assistant\n"]))
    def check(text: str, prompt: str) -> None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        detok = IncrementalDetokenizer(tokenizer, tokenizer(prompt, add_special_tokens=False)["input_ids"])
        pieces = [detok.push(t) for t in ids] + [detok.flush()]
        expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "".join(pieces) == expected
        if "\ufffd" not in expected:
            assert not any("\ufffd" in p for p in pieces)

    check()


def test_a_failing_stream_ends_with_an_error_event_and_done():
    import json as _json

    from trillm.api.responses import stream_end, stream_failure

    error, done = stream_failure(RuntimeError("boom"))
    body = _json.loads(error.decode().removeprefix("data: "))
    assert set(body["error"]) == {"message", "type", "param", "code"} and "RuntimeError" in body["error"]["message"]
    assert done == b"data: [DONE]\n\n"
    assert stream_end("text_completion", "cmpl-1", 0, "m", None) == [b"data: [DONE]\n\n"]
    usage_event = _json.loads(stream_end("text_completion", "cmpl-1", 0, "m", {"total_tokens": 3})[0][6:])
    assert usage_event["choices"] == [] and usage_event["usage"] == {"total_tokens": 3}
