"""The sampler on hand-made logits: what no model output pins down."""

from __future__ import annotations

import pytest
import torch

from trillm.engine.execution.sampler import draw, greedy, sample_with_logprobs
from trillm.engine.sampling_params import SamplingParams
from trillm.kernels import cpu_ops


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


def test_the_c_draw_is_the_torch_draw_and_follows_the_softmax():
    """``cpu_ops.sample_rows`` (rows without top-k/top-p/min-p) inverts the same CDF as ``draw``: the
    same index for the same uniform, masked values never drawn, frequencies those of the softmax."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(300, 3000, generator=gen) * 3
    logits[:, 1000:1500] = float("-inf")  # a grammar's mask
    temperatures = [0.3 + 0.01 * i for i in range(300)]
    uniforms = torch.rand(300, dtype=torch.float64, generator=gen)
    scaled = logits / torch.tensor(temperatures).unsqueeze(1)
    weights = scaled.sub(scaled.amax(dim=-1, keepdim=True)).exp()
    got = cpu_ops.sample_rows(logits, temperatures, uniforms)
    assert torch.equal(got, draw(weights, uniforms))
    assert not ((got >= 1000) & (got < 1500)).any()
    few = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 0.5]])
    counts = torch.zeros(5)
    for u in torch.rand(20000, dtype=torch.float64, generator=gen):
        counts[int(cpu_ops.sample_rows(few, [0.7], u.reshape(1))[0])] += 1
    expected = torch.softmax(few[0] / 0.7, dim=-1)
    assert (counts / 20000 - expected).abs().max() < 0.015 and counts[3] == 0


def test_the_c_draw_takes_edge_rows_without_nans():
    logits = torch.tensor(
        [
            [1.0, 5.0, 4.99, 2.0],  # a tiny temperature: the largest, whatever the uniform
            [float("-inf")] * 4,  # everything masked: index 0, never an error
            [0.0, float("inf"), 1.0, 2.0],  # an infinite logit: it
        ]
    )
    u = torch.tensor([0.99, 0.5, 0.1], dtype=torch.float64)
    assert cpu_ops.sample_rows(logits, [1e-40, 1.0, 1.0], u).tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match="temperatures"):
        cpu_ops.sample_rows(logits, [0.0, 1.0, 1.0], u)
    with pytest.raises(ValueError, match="one temperature"):
        cpu_ops.sample_rows(logits, [1.0], u)
