"""OpenAI fields that were once accepted and ignored: those we can honour are honoured
(``reasoning_effort`` through the chat template, ``prompt_cache_key`` as the ``--dp`` routing
key), the harmless accepted (``service_tier``, ``verbosity``), and those whose silent neglect
would mislead (``modalities`` with audio, ``audio``, ``web_search_options``) are 400s naming them."""

from __future__ import annotations

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
