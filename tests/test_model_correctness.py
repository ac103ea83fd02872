"""Our Llama forward pass against transformers on the same SmolLM2 weights."""

from __future__ import annotations

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

from trillm.engine.execution.backends.base import slots
from trillm.engine.execution.backends.cpu import decode_groups
from trillm.engine.execution.model_runner import ModelRunner
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.scheduling.kv_pages import PageAllocator
from trillm.engine.scheduling.scheduler import Scheduler
from trillm.engine.scheduling.sequence import Sequence

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _greedy(tokenizer, prompt: str, max_tokens: int) -> Sequence:
    ids = tokenizer(prompt)["input_ids"]
    return Sequence(
        prompt, ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), 4096, frozenset()
    )


@pytest.mark.parametrize("chunk", [512, 5])
def test_logits_match_transformers(model_parts, tokenizer, hf_model, chunk):
    """Last-position logits after a (possibly chunked) prefill equal transformers'."""
    model = model_parts[0]
    for prompt in PROMPTS:
        sched = Scheduler(PageAllocator(64), 4, 4, chunk)
        runner = ModelRunner(model, 64, 4)
        seq = _greedy(tokenizer, prompt, 1)
        sched.add(seq)
        logits = None
        while seq.num_computed < len(seq.prompt_ids):
            batch = sched.schedule()
            inputs = runner.prepare(batch)
            with torch.inference_mode():
                logits = model.forward(
                    inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta, inputs.logits_rows
                )
            sched.complete(batch, [int(row.argmax()) for row in logits])
        with torch.inference_mode():
            ref = hf_model(torch.tensor([seq.prompt_ids])).logits[0, -1]
        assert logits is not None and logits.shape == (1, ref.shape[0])
        torch.testing.assert_close(logits[0], ref, atol=2e-4, rtol=1e-4)


async def test_greedy_tokens_match_generate_alone_and_in_a_busy_batch(engine, tokenizer, hf_model):
    """Token ids from our engine equal transformers' greedy generate, with and without company."""
    new_tokens = 24
    expected = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        tokens = out[0, len(ids) :].tolist()
        eos = [i for i, t in enumerate(tokens) if t in engine.eos_ids]
        expected[prompt] = tokens[: eos[0] + 1] if eos else tokens
    assert any(len(v) < new_tokens for v in expected.values()), "one prompt should end on EOS"

    greedy = SamplingParams(max_tokens=new_tokens, temperature=0)

    async def collect(prompt: str, results: dict) -> None:
        async with engine.generate(tokenizer(prompt)["input_ids"], greedy) as outputs:
            results[prompt] = [t async for o in outputs for t in o.token_ids]

    alone: dict[str, list[int]] = {}
    for prompt in PROMPTS:
        await collect(prompt, alone)
    assert alone == expected

    async def noise(seed_text: str) -> None:
        params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, ignore_eos=True)
        async with engine.generate(tokenizer(seed_text)["input_ids"], params) as outputs:
            async for _ in outputs:
                pass

    together: dict[str, list[int]] = {}
    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(noise, f"Noise request number {i} says")
        for prompt in PROMPTS:
            nursery.start_soon(collect, prompt, together)
    assert together == expected


def test_decode_rows_are_grouped_by_context_length():
    """One long context must not pad every decode row to its length."""
    lens = [10, 4000, 12, 3000]
    tables = [list(range(-(-n // 4))) for n in lens]
    groups = decode_groups([0, 1, 2, 3], tables, lens, 4)
    assert [g.rows.tolist() for g in groups] == [[0, 2], [3, 1]]
    short = groups[0]
    assert short.pages.shape == (2, 3) and short.mask.shape == (2, 1, 1, 12)
    assert short.mask[0, 0, 0].sum() == 10 and short.mask[1, 0, 0].sum() == 12


def test_slots_are_each_positions_page_and_offset():
    """``slots`` walks a page's run at a time: every start and end within and across pages gives
    ``table[p // page] * page + p % page`` for each position p."""
    page = 4
    table = [7, 2, 9, 0, 5]
    for start in range(0, 20):
        for end in range(start, 21):
            expected = [table[p // page] * page + p % page for p in range(start, end)]
            assert list(slots(table, start, end, page)) == expected, (start, end)
