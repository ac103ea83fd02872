"""Prompt logprobs (``SamplingParams.prompt_logprobs``; ``/v1/completions`` with ``echo`` and
``logprobs``), as lm-eval's ``local-completions`` scores likelihoods: checked against transformers
on the same weights, through the HTTP API, and in the engine under preemption."""

from __future__ import annotations

import math

import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

from trillm.engine.sampling_params import SamplingParams

from tests.helpers import make_engine, outputs_by_prompt, wait_idle
from tests.server import MODEL, client, in_thread, running_server

PROMPTS = ["The capital of France is Paris, and the capital of Italy is", "def add(a, b):\n    return a + b"]
TOP = 3


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a full forward pass over ``ids``: row p scores the token after position p."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_prompt_entries(lp, ids: list[int], logp: torch.Tensor, tokenizer, top: int) -> None:
    """The first ``len(ids)`` legacy entries are the prompt's, equal to ``logp``."""
    p = len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:p]) == tokenizer.decode(ids)
    expected = [float(logp[j - 1, ids[j]]) for j in range(1, p)]
    assert lp.token_logprobs[1:p] == pytest.approx(expected, abs=1e-3)
    for j in range(1, p):
        alternatives = lp.top_logprobs[j]
        assert len(alternatives) == top
        best = torch.topk(logp[j - 1], top)
        assert sorted(alternatives.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=1e-3)
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets


@pytest.mark.e2e
@pytest.mark.parametrize("max_batch_tokens", [256, 8], ids=["whole", "chunked"])
async def test_prompt_logprobs_equal_transformers_and_free_their_pages(
    model_parts, tokenizer, hf_model, max_batch_tokens
):
    """Every prompt token scored as a full forward pass scores it, in one prefill or in chunks of 8,
    for each of n = 2 choices; a repeat is scored again rather than served from the prefix cache."""
    async with running_server(model_parts, max_batch_tokens=max_batch_tokens, max_num_seqs=4) as server:
        c = client(server)
        for attempt in range(2):
            reply = await in_thread(
                c.completions.create,
                model=MODEL,
                prompt=PROMPTS,
                n=2,
                max_tokens=1,
                echo=True,
                logprobs=TOP,
                temperature=0,
            )
            assert len(reply.choices) == 4
            for choice in reply.choices:
                prompt = PROMPTS[choice.index // 2]
                ids = tokenizer(prompt)["input_ids"]
                logp = reference(hf_model, ids)
                lp = choice.logprobs
                assert len(lp.tokens) == len(ids) + 1 and choice.text.startswith(prompt)
                check_prompt_entries(lp, ids, logp, tokenizer, TOP)
                # the generated (greedy) token comes last, scored by the last prompt position
                assert lp.token_logprobs[-1] == pytest.approx(float(logp[-1].max()), abs=1e-3)
                assert choice.text == prompt + lp.tokens[-1]
            assert reply.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)
            assert reply.usage.completion_tokens == 4
            if attempt:  # cached pages exist now, but scoring needs every prompt row computed
                assert reply.usage.prompt_tokens_details.cached_tokens == 0
        await wait_idle(server.engine)
        server.engine.flush_cache()
        stats = server.engine.stats()
        assert stats.free_pages == stats.total_pages


async def test_lm_eval_scoring_and_max_tokens_zero(server, tokenizer, hf_model):
    """What lm-eval sends (token-id prompts, ``max_tokens: 1``, ``logprobs: 1``, ``echo``) scores a
    continuation as transformers does; ``max_tokens: 0`` returns the prompt alone."""
    c = client(server)
    context = tokenizer("Question: What is the capital of France?\nAnswer:")["input_ids"]
    continuation = tokenizer(" Paris")["input_ids"]
    ids = context + continuation
    logp = reference(hf_model, ids)
    reply = await in_thread(
        c.completions.create,
        model=MODEL,
        prompt=[ids],
        max_tokens=1,
        logprobs=1,
        echo=True,
        temperature=0,
        seed=1234,
    )
    lp = reply.choices[0].logprobs
    ctxlen = len(context)
    # lm-eval's parse_logprobs: the continuation's entries are [ctxlen:-1] (the last one was generated)
    score = sum(lp.token_logprobs[ctxlen:-1])
    expected = sum(float(logp[j - 1, ids[j]]) for j in range(ctxlen, len(ids)))
    assert score == pytest.approx(expected, abs=2e-3)
    greedy = all(tok == max(top.values()) for tok, top in zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]))
    assert greedy == all(int(logp[j - 1].argmax()) == ids[j] for j in range(ctxlen, len(ids)))

    only = await in_thread(c.completions.create, model=MODEL, prompt=[ids], max_tokens=0, logprobs=0, echo=True)
    choice = only.choices[0]
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) and only.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=1e-5)
    assert all(top == {} for top in choice.logprobs.top_logprobs[1:])
    plain = await in_thread(c.completions.create, model=MODEL, prompt="Hello there", max_tokens=0, echo=True)
    assert plain.choices[0].text == "Hello there" and plain.choices[0].logprobs is None
    assert plain.usage.completion_tokens == 0


async def test_streamed_echo_carries_the_prompt_logprobs_first(server, tokenizer, hf_model):
    c = client(server)
    prompt = PROMPTS[0]
    ids = tokenizer(prompt)["input_ids"]

    def run():
        return list(
            c.completions.create(
                model=MODEL,
                prompt=prompt,
                n=2,
                max_tokens=3,
                echo=True,
                logprobs=TOP,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )

    chunks = await in_thread(run)
    assert all(ch.id.startswith("cmpl-") for ch in chunks)
    logp = reference(hf_model, ids)
    for index in (0, 1):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == index]
        assert mine[0].text == prompt
        check_prompt_entries(mine[0].logprobs, ids, logp, tokenizer, TOP)
        generated = [t for ch in mine[1:] if ch.logprobs for t in ch.logprobs.tokens]
        assert len(generated) == 3 and mine[-1].finish_reason == "length"
        assert "".join(ch.text for ch in mine) == prompt + "".join(generated)
        later = [o for ch in mine[1:] if ch.logprobs for o in ch.logprobs.text_offset]
        assert later[0] == len(prompt)
    assert chunks[-1].usage.completion_tokens == 6
    assert not any(
        math.isnan(v)
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for v in ch.choices[0].logprobs.token_logprobs
        if v is not None
    )


async def test_prompt_logprobs_survive_preemption_and_skip_the_prefix_cache(model_parts, tokenizer):
    """Under a pool so small that requests are preempted and recomputed, every request still gets
    its prompt's logprobs once, on its first output, equal to those of a roomy engine."""
    prompts = [f"Story {i}: the old wizard and the young dragon met" for i in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=2)

    roomy = make_engine(model_parts, num_pages=256, page_size=4)
    tight = make_engine(model_parts, num_pages=30, page_size=4)
    async with trio.open_nursery() as n:
        await n.start(roomy.run)
        await n.start(tight.run)
        expected = await outputs_by_prompt(roomy, tokenizer, prompts, params)
        got = await outputs_by_prompt(tight, tokenizer, prompts, params)
        again = await outputs_by_prompt(
            roomy, tokenizer, prompts, params
        )  # its prefix cache holds these prompts now; they are computed anyway
        await wait_idle(roomy)
        await wait_idle(tight)
        n.cancel_scope.cancel()
    assert tight.stats().num_preemptions > 0
    for p in prompts:
        n_prompt = len(tokenizer(p)["input_ids"])
        for outputs in (expected[p], got[p], again[p]):
            assert outputs[0].prompt_logprobs is not None and len(outputs[0].prompt_logprobs) == n_prompt - 1
            assert all(o.prompt_logprobs is None for o in outputs[1:])
            assert sum(len(o.token_ids) for o in outputs) == 30 and outputs[0].num_cached_tokens == 0
        for mine, theirs in zip(got[p][0].prompt_logprobs, expected[p][0].prompt_logprobs):
            assert mine.token_id == theirs.token_id and len(mine.top) == 2
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for o in got[p] for t in o.token_ids] == [t for o in expected[p] for t in o.token_ids]
        assert [e.logprob for e in again[p][0].prompt_logprobs] == pytest.approx(
            [e.logprob for e in expected[p][0].prompt_logprobs], abs=1e-4
        )
