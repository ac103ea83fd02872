"""Log-probabilities through the real server: shape, consistency with the text, and the model's own score."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from trillm.api.json_text import dumps
from trillm.api.logprobs import chat_content, legacy, token_bytes
from trillm.api.responses import sse, typed_sse
from trillm.engine.execution.sampler import LOGPROB_FLOOR
from trillm.engine.outputs import TokenLogprobs

from tests.server import MODEL, QUESTION, client, in_thread

pytestmark = pytest.mark.e2e

STORY = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _ids_from_bytes(tokenizer, entries) -> list[int]:
    by_bytes = {token_bytes(tokenizer, i): i for i in range(len(tokenizer))}
    return [by_bytes[bytes(e.bytes)] for e in entries]


async def test_greedy_top1_is_the_chosen_token_and_bytes_spell_the_text(server):
    reply = await in_thread(
        client(server).chat.completions.create,
        model=MODEL,
        messages=QUESTION,
        max_tokens=20,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    pieces = [bytes(e.bytes) for e in content]
    assert choice.finish_reason == "stop"  # this short answer ends on EOS, which has an entry but no text
    assert content[-1].token in server.engine.tokenizer.all_special_tokens
    assert b"".join(pieces[:-1]).decode() == choice.message.content


async def test_sum_of_logprobs_equals_the_models_score(server, hf_model):
    tok = server.engine.tokenizer
    reply = await in_thread(
        client(server).chat.completions.create,
        model=MODEL,
        messages=STORY,
        max_tokens=24,
        temperature=1.0,
        seed=11,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    content = reply.choices[0].logprobs.content
    output_ids = _ids_from_bytes(tok, content)
    prompt_text = tok.apply_chat_template(STORY, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    score = logp[torch.arange(len(output_ids)), torch.tensor(output_ids)]
    returned = torch.tensor([e.logprob for e in content])
    torch.testing.assert_close(returned, score, atol=2e-3, rtol=0)
    assert abs(float(returned.sum() - score.sum())) < 1e-2


async def test_streamed_logprobs_equal_the_one_shot_ones(server):
    c = client(server)
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    whole = await in_thread(c.chat.completions.create, **kwargs)

    def streamed():
        return list(c.chat.completions.create(stream=True, **kwargs))

    chunks = await in_thread(streamed)
    entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in whole.choices[0].logprobs.content]
    # The second run reuses cached prompt KV computed in another batch shape: equal up to float noise.
    assert [e.logprob for e in entries] == pytest.approx(
        [e.logprob for e in whole.choices[0].logprobs.content], abs=1e-4
    )


async def test_legacy_completion_logprobs_shape(server):
    reply = await in_thread(
        client(server).completions.create,
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        logprobs=3,
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(value) and top[token] == pytest.approx(value)


def _strict(text: str):
    """Parse as a strict client does (``JSON.parse``, Go): bare NaN/Infinity are an error."""

    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_regression_nan_logprobs_are_never_written_as_bare_nan(tokenizer):
    """Corrupt weights gave ``"logprob": NaN`` in a reply, which strict clients reject whole."""
    nan, inf = float("nan"), float("inf")
    items = [TokenLogprobs(5, nan, ((5, nan), (6, -inf))), TokenLogprobs(7, -inf, ((7, -inf),))]
    chat = chat_content(tokenizer, items)
    legacy_shape = legacy(tokenizer, items, 0)
    for payload in (chat, legacy_shape):
        assert _strict(dumps(payload)) == payload  # nothing was left to the net: all finite already
    assert [e["logprob"] for e in chat] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
    assert [t["logprob"] for t in chat[0]["top_logprobs"]] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
    assert legacy_shape["token_logprobs"] == [LOGPROB_FLOOR, LOGPROB_FLOOR]


def test_regression_every_json_writer_refuses_non_finite_numbers():
    """The net under the clamps: a non-finite number reaching a writer is written as null."""
    payload = {"a": float("nan"), "b": [1.5, float("-inf")], "c": {"d": float("inf")}, "e": "NaN"}
    for text in (dumps(payload), dumps(payload, compact=True)):
        assert _strict(text) == {"a": None, "b": [1.5, None], "c": {"d": None}, "e": "NaN"}
    event = sse(payload).decode()
    assert event.startswith("data: ") and _strict(event[len("data: ") :]) == _strict(dumps(payload))
    typed = typed_sse({"type": "x", "v": float("nan")}).decode()
    assert _strict(typed.split("data: ", 1)[1]) == {"type": "x", "v": None}
