"""The sampler on hand-made logits: what no model output pins down."""

from __future__ import annotations

import pytest
import torch

from trillm.engine.execution.sampler import greedy, sample_with_logprobs
from trillm.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_tiny_temperatures_are_greedy_never_a_nan_draw(temperature):
    """float32 logits divided by 1e-40 overflow; the draw then read NaNs and returned -1."""
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0)) * 10
    logits[:, :50] = float("-inf")  # a grammar's mask: only the upper half allowed
    rows = [
        SamplingParams(temperature=temperature, max_tokens=4),
        SamplingParams(temperature=temperature, max_tokens=4, top_p=0.9, logprobs=2),
        SamplingParams(temperature=temperature, max_tokens=4, min_p=0.1, seed=3),
    ]
    sampled = sample_with_logprobs(logits.clone(), rows)
    assert sampled.tokens == logits.argmax(dim=-1).tolist()
    assert sampled.logprobs[1] is not None and sampled.logprobs[1].logprob > -1e9


def test_greedy_is_argmax_ties_and_infinities_included():
    """``greedy`` takes ``max``'s indices for speed: the same first index of equal maxima as argmax."""
    logits = torch.randn(33, 1000)
    logits[3, [7, 500]] = 100.0  # a tie: the first
    logits[4] = float("-inf")  # all masked: index 0
    logits[4, 999] = 0.0
    logits[5, :] = 1.0  # all equal
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))
    assert greedy(logits)[3] == 7 and greedy(logits)[4] == 999 and greedy(logits)[5] == 0
