"""Stop strings, seeds, penalties, bias and min_tokens through the real server and ``openai`` client."""

from __future__ import annotations

import pytest
import trio

from tests.server import MODEL, QUESTION, client, in_thread

pytestmark = pytest.mark.e2e

STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


async def test_stop_string_derived_from_a_greedy_run_streaming_and_not(server):
    c = client(server)
    base = await in_thread(
        c.chat.completions.create,
        model=MODEL,
        messages=STORY,
        max_tokens=60,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].message.content
    words = text.split()
    stop = words[len(words) // 2]  # a word from the middle of the greedy answer
    expected = text[: text.find(stop)]

    whole = await in_thread(
        c.chat.completions.create,
        model=MODEL,
        messages=STORY,
        max_tokens=60,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < base.usage.completion_tokens

    def streamed():
        return list(
            c.chat.completions.create(
                model=MODEL,
                messages=STORY,
                max_tokens=60,
                temperature=0,
                stop=stop,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )

    chunks = await in_thread(streamed)
    pieces = [ch.choices[0].delta.content or "" for ch in chunks]
    assert "".join(pieces) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    await trio.sleep(0)


async def test_same_seed_same_text_alone_and_in_a_busy_batch(server):
    c = client(server)
    kwargs = dict(model=MODEL, messages=STORY, max_tokens=24, temperature=1.0, seed=1234)
    alone = (await in_thread(c.chat.completions.create, **kwargs)).choices[0].message.content
    other_seed = (await in_thread(c.chat.completions.create, **{**kwargs, "seed": 99})).choices[0].message.content
    assert other_seed != alone  # the seed matters

    busy: list[str] = []

    async def noise(i: int) -> None:
        await in_thread(
            c.chat.completions.create,
            model=MODEL,
            messages=QUESTION,
            max_tokens=30,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )

    async def seeded() -> None:
        await trio.sleep(0.2)  # join while the noise is running
        busy.append((await in_thread(c.chat.completions.create, **kwargs)).choices[0].message.content)

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(noise, i)
        nursery.start_soon(seeded)
    assert busy == [alone]


async def test_logit_bias_min_tokens_and_penalties_change_the_output(server):
    c = client(server)
    tok = server.engine.tokenizer
    forced = tok(" banana", add_special_tokens=False)["input_ids"][0]
    biased = await in_thread(
        c.chat.completions.create,
        model=MODEL,
        messages=QUESTION,
        max_tokens=5,
        temperature=0,
        logit_bias={str(forced): 100},
    )
    assert biased.choices[0].message.content == tok.decode([forced] * 5)

    short = await in_thread(c.chat.completions.create, model=MODEL, messages=QUESTION, max_tokens=100, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 30
    longer = await in_thread(
        c.chat.completions.create,
        model=MODEL,
        messages=QUESTION,
        max_tokens=100,
        temperature=0,
        extra_body={"min_tokens": 30},
    )
    assert longer.usage.completion_tokens >= 30

    plain = await in_thread(c.chat.completions.create, model=MODEL, messages=STORY, max_tokens=40, temperature=0)
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.8}}):
        penalised = await in_thread(
            c.chat.completions.create, model=MODEL, messages=STORY, max_tokens=40, temperature=0, **extra
        )
        assert penalised.choices[0].message.content != plain.choices[0].message.content, extra


async def test_n_choices_streamed_and_not_agree_under_a_seed(server):
    c = client(server)
    kwargs = dict(model=MODEL, messages=STORY, max_tokens=12, temperature=1.0, seed=5, n=3)
    whole = await in_thread(c.chat.completions.create, **kwargs)
    assert [ch.index for ch in whole.choices] == [0, 1, 2]
    texts = [ch.message.content for ch in whole.choices]
    assert len(set(texts)) > 1  # the choices are different samples
    assert 3 <= whole.usage.completion_tokens <= 36  # summed over the three choices

    def streamed():
        return list(c.chat.completions.create(stream=True, **kwargs))

    chunks = await in_thread(streamed)
    pieces = ["", "", ""]
    finishes = [None, None, None]
    for ch in chunks:
        (choice,) = ch.choices
        pieces[choice.index] += choice.delta.content or ""
        finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert pieces == texts
    assert finishes == [ch.finish_reason for ch in whole.choices]
