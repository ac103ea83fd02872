"""OpenAI fields that were once accepted and ignored: those we can honour are honoured
(``reasoning_effort`` through the chat template, ``prompt_cache_key`` as the ``--dp`` routing
key), the harmless accepted (``service_tier``, ``verbosity``), and those whose silent neglect
would mislead (``modalities`` with audio, ``audio``, ``web_search_options``) are 400s naming them."""

from __future__ import annotations

import httpx
import pytest

from trillm.api.errors import ApiError
from trillm.api.schemas.chat import parse_chat_request
from trillm.api.schemas.responses import parse_responses_request
from trillm.engine.replicas.router import PrefixRouter

from tests.server import MODEL, QUESTION, client, in_thread, running_server


def _chat(**body):
    return parse_chat_request({"model": MODEL, "messages": QUESTION, **body})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"service_tier": "gold"}, "service_tier"),
    ],
)
def test_fields_that_would_mislead_are_400s(body, param):
    with pytest.raises(ApiError) as info:
        _chat(**body)
    assert info.value.status == 400 and info.value.param == param


def test_honoured_and_harmless_fields():
    assert _chat(reasoning_effort="none").chat_template_kwargs == {"reasoning_effort": "low", "enable_thinking": False}
    assert _chat(reasoning_effort="xhigh").chat_template_kwargs == {"reasoning_effort": "high"}
    mine = _chat(reasoning_effort="minimal", chat_template_kwargs={"enable_thinking": True})
    assert mine.chat_template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}  # the caller's win
    plain = _chat(modalities=["text"], verbosity="low", service_tier="flex", prompt_cache_key="user-42")
    assert plain.chat_template_kwargs is None and plain.common.params.prompt_cache_key == "user-42"
    responses = parse_responses_request(
        {"model": MODEL, "input": "hi", "reasoning": {"effort": "high", "summary": "auto"}, "prompt_cache_key": "k"}
    )
    assert responses.chat_template_kwargs == {"reasoning_effort": "high"}
    assert responses.common.params.prompt_cache_key == "k"


def test_a_cache_key_routes_to_one_replica_whatever_the_prompt():
    router = PrefixRouter(4, page_size=16)
    loads = [0, 0, 0, 0]
    alive = [True] * 4
    first = router.choose(list(range(40)), loads, alive, cache_key="conversation-1")
    again = {router.choose(list(range(100 + i, 140 + i)), loads, alive, cache_key="conversation-1") for i in range(5)}
    assert again == {first}  # unrelated prompts, one key: one replica
    others = {router.choose(list(range(100 + i, 140 + i)), loads, alive) for i in range(4)}
    assert len(others) > 1  # without the key the same prompts spread
    busy = [0, 0, 0, 0]
    busy[first] = 10  # past the slack: the key gives way to load
    assert router.choose(list(range(5)), busy, alive, cache_key="conversation-1") != first


@pytest.mark.e2e
async def test_reasoning_effort_none_turns_the_reasoning_split_off(model_parts):
    """Under ``deepseek_r1`` the default model's whole reply is thinking; with ``reasoning_effort:
    "none"`` thinking is off (``enable_thinking: false``) and the same words are the answer."""
    async with running_server(model_parts, reasoning_parser="deepseek_r1") as srv:

        def run():
            c = client(srv)
            ask = {"model": MODEL, "messages": QUESTION, "max_tokens": 30, "temperature": 0}
            return c.chat.completions.create(**ask), c.chat.completions.create(**ask, reasoning_effort="none")

        thinking, plain = await in_thread(run)
    assert thinking.choices[0].message.content is None
    assert plain.choices[0].message.content == thinking.choices[0].message.reasoning_content


@pytest.mark.e2e
async def test_truncate_prompt_tokens_keeps_the_last_tokens_of_each_prompt(model_parts, tokenizer):
    """vLLM's ``truncate_prompt_tokens``: the prompt's last N tokens, as if only they were sent;
    -1: as many as the context holds beside ``max_tokens``; on completions, chat and embeddings."""
    text = "one two three four five six seven eight nine ten " * 60  # ~600 tokens: over the 256 of context
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 256
    async with running_server(model_parts, num_pages=16) as srv:  # 16 pages of 16: 256 tokens of context

        def run():
            c = client(srv)
            ask = {"model": MODEL, "max_tokens": 4, "temperature": 0}
            cut = c.completions.create(prompt=text, **ask, extra_body={"truncate_prompt_tokens": 10})
            tail = c.completions.create(prompt=ids[-10:], **ask)
            echoed = c.completions.create(prompt=text, **ask, echo=True, extra_body={"truncate_prompt_tokens": 10})
            fit = c.completions.create(prompt=text, **ask, extra_body={"truncate_prompt_tokens": -1})
            chat = c.chat.completions.create(
                messages=[{"role": "user", "content": text}], **ask, extra_body={"truncate_prompt_tokens": 50}
            )
            embed = {"model": MODEL, "encoding_format": "float"}
            e_cut = c.embeddings.create(input=text, **embed, extra_body={"truncate_prompt_tokens": 10})
            e_tail = c.embeddings.create(input=[ids[-10:]], **embed)
            e_fit = c.embeddings.create(input=text, **embed, extra_body={"truncate_prompt_tokens": -1})
            errors = [
                httpx.post(srv.base_url + path, json={"model": MODEL, **body, "truncate_prompt_tokens": 0})
                for path, body in (("/completions", {"prompt": "hi"}), ("/embeddings", {"input": "hi"}))
            ]
            whole = httpx.post(srv.base_url + "/completions", json={"model": MODEL, "prompt": text, "max_tokens": 4})
            return cut, tail, echoed, fit, chat, e_cut, e_tail, e_fit, errors, whole

        cut, tail, echoed, fit, chat, e_cut, e_tail, e_fit, errors, whole = await in_thread(run)
    assert cut.usage.prompt_tokens == 10 and cut.choices[0].text == tail.choices[0].text
    assert echoed.choices[0].text == tokenizer.decode(ids[-10:]) + cut.choices[0].text  # the prompt the model saw
    assert fit.usage.prompt_tokens == 256 - 4 and chat.usage.prompt_tokens == 50
    assert e_cut.usage.prompt_tokens == 10 and e_fit.usage.prompt_tokens == 255
    assert e_cut.data[0].embedding == pytest.approx(e_tail.data[0].embedding, abs=1e-5)
    assert [(e.status_code, e.json()["error"]["param"]) for e in errors] == [(400, "truncate_prompt_tokens")] * 2
    assert whole.status_code == 400 and whole.json()["error"]["code"] == "context_length_exceeded"  # not asked to cut
