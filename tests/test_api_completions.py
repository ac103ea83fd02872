"""``/v1/completions`` through the real server and the ``openai`` client: every prompt form, echo, streaming."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import wait_idle
from tests.server import MODEL, client, in_thread

pytestmark = pytest.mark.e2e

PROMPTS = ["The capital of France is", "One, two, three,"]


async def test_every_prompt_form_gives_one_choice_per_prompt_in_order(server):
    c = client(server)
    tok = server.engine.tokenizer
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0)
    by_text = await in_thread(c.completions.create, prompt=PROMPTS, **kwargs)
    by_ids = await in_thread(c.completions.create, prompt=ids, **kwargs)
    single_text = await in_thread(c.completions.create, prompt=PROMPTS[1], **kwargs)
    single_ids = await in_thread(c.completions.create, prompt=ids[1], **kwargs)
    assert by_text.object == "text_completion"
    assert [ch.index for ch in by_text.choices] == [0, 1]
    texts = [ch.text for ch in by_text.choices]
    assert texts == [ch.text for ch in by_ids.choices]
    assert single_text.choices[0].text == single_ids.choices[0].text == texts[1]
    assert "Paris" in texts[0]
    assert by_text.usage.prompt_tokens == sum(len(i) for i in ids)
    assert by_text.usage.completion_tokens == 12  # two choices, 6 each (no EOS this early)


async def test_echo_and_streaming_match_the_one_shot_text(server):
    c = client(server)
    kwargs = dict(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    whole = await in_thread(c.completions.create, **kwargs)
    echoed = await in_thread(c.completions.create, echo=True, **kwargs)
    for plain, echo, prompt in zip(whole.choices, echoed.choices, PROMPTS):
        assert echo.text == prompt + plain.text

    def stream():
        return list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))

    chunks = await in_thread(stream)
    pieces = ["", ""]
    finish = [None, None]
    for ch in chunks[:-1]:
        assert ch.object == "text_completion" and ch.usage is None
        (choice,) = ch.choices
        pieces[choice.index] += choice.text
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert pieces == [ch.text for ch in whole.choices]
    assert finish == [ch.finish_reason for ch in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": ["a", [1, 2]]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [99999999]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": ["x"] * 64, "n": 3}, "n"),
        ({"prompt": "x", "logprobs": 9}, "logprobs"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo (scoring the prompt)
        ({"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
    ],
)
async def test_bad_completion_requests_are_400s(server, body, param):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        await in_thread(c.completions.create, model=MODEL, **body) if "prompt" in body else await in_thread(
            c.post, "/completions", cast_to=object, body={"model": MODEL, **body}
        )
    assert err.value.body["param"] == param


async def test_leaving_a_multi_prompt_stream_frees_every_choice(server):
    c = client(server)

    def read_a_little():
        stream = c.completions.create(
            model=MODEL, prompt=PROMPTS * 3, max_tokens=500, stream=True, extra_body={"ignore_eos": True}
        )
        for i, _ in enumerate(stream):
            if i == 8:
                stream.close()
                return

    await in_thread(read_a_little)
    await wait_idle(server.engine)
    assert server.engine.stats().num_aborted == 6


async def test_n_choices_per_prompt_are_ordered_prompt_major(server):
    c = client(server)
    reply = await in_thread(c.completions.create, model=MODEL, prompt=PROMPTS, n=2, max_tokens=5, temperature=0)
    assert [ch.index for ch in reply.choices] == [0, 1, 2, 3]
    texts = [ch.text for ch in reply.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]  # greedy: same per prompt
    assert reply.usage.completion_tokens == 20
