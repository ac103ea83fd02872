"""Detokenization, sampling and rotary embeddings: the small pure parts."""

from __future__ import annotations

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.rope import inverse_frequencies
from engine.sampler import sample
from engine.sampling_params import SamplingParams

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

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                         rope_parameters={"rope_theta": 500000.0, **scaling})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inverse_frequencies(128, 500000.0, scaling)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=0)
