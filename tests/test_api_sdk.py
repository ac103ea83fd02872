"""What clients built on the OpenAI SDK assume: default lengths, ``models.retrieve``, id forms,
the context-length error litellm and LangChain detect, and OpenAI-shaped 404s for what is not served."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from trillm.api.settings import ServerConfig

from tests.server import MODEL, QUESTION, client, in_thread, running_server

pytestmark = pytest.mark.e2e

CONTEXT = 64
OVERFLOW = re.compile(
    r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
    r"\((\d+) in the (messages|prompt), (\d+) in the completion\)\. "
    r"Please reduce the length of the (messages|prompt) or completion\."
)


def overflow(err: openai.BadRequestError) -> tuple[int, ...]:
    """What litellm-style detection reads, checked; returns (context, requested, prompt, completion)."""
    assert err.status_code == 400 and err.code == "context_length_exceeded"
    assert "maximum context length" in err.message
    assert err.body["type"] == "invalid_request_error"
    match = OVERFLOW.search(err.message)
    assert match is not None, err.message
    context, requested, prompt, completion = (int(match[i]) for i in (1, 2, 3, 5))
    assert requested == prompt + completion > context and match[4] == match[6]
    return context, requested, prompt, completion


async def test_defaults_run_to_the_context_and_context_overflow_is_worded_as_openai(model_parts):
    async with running_server(model_parts, max_model_len=CONTEXT) as server:
        c = client(server)
        chat = await in_thread(
            c.chat.completions.create, model=MODEL, messages=QUESTION, temperature=0, extra_body={"ignore_eos": True}
        )
        assert chat.id.startswith("chatcmpl-") and chat.choices[0].finish_reason == "length"
        assert chat.usage.completion_tokens > 16  # no default limit: it ran to the context
        assert chat.usage.prompt_tokens + chat.usage.completion_tokens == CONTEXT
        legacy = await in_thread(
            c.completions.create, model=MODEL, prompt="Once upon a time", extra_body={"ignore_eos": True}
        )
        assert legacy.id.startswith("cmpl-") and legacy.usage.completion_tokens == 16  # OpenAI's default here

        prompt_tokens = chat.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError) as err:  # explicit max_tokens: honoured, so refused
            await in_thread(c.chat.completions.create, model=MODEL, messages=QUESTION, max_tokens=40)
        assert overflow(err.value) == (CONTEXT, prompt_tokens + 40, prompt_tokens, 40)
        assert err.value.param == "max_tokens" and "in the messages" in err.value.message
        long_messages = [{"role": "user", "content": "hello " * 80}]
        for stream in (False, True):  # a stream is refused before it starts
            with pytest.raises(openai.BadRequestError) as err:
                await in_thread(c.chat.completions.create, model=MODEL, messages=long_messages, stream=stream)
            context, _, prompt, completion = overflow(err.value)
            assert context == CONTEXT and prompt > CONTEXT and completion == 1 and err.value.param == "messages"
        with pytest.raises(openai.BadRequestError) as err:
            await in_thread(c.completions.create, model=MODEL, prompt="hello " * 80, max_tokens=5)
        context, _, prompt, completion = overflow(err.value)
        assert (completion, err.value.param) == (5, "prompt") and "in the prompt" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            await in_thread(c.completions.create, model=MODEL, prompt="hello", max_tokens=CONTEXT)
        assert overflow(err.value)[3] == CONTEXT and err.value.param == "max_tokens"
        # a default that does not fit is clamped, not refused
        near = await in_thread(c.completions.create, model=MODEL, prompt="hello " * 55, extra_body={"ignore_eos": True})
        assert near.usage.prompt_tokens + near.usage.completion_tokens == CONTEXT


async def test_default_max_tokens_caps_defaults_and_models_retrieve(model_parts):
    served = "org/smol"  # an id with a slash, as Hugging Face names are
    config = ServerConfig(default_max_tokens=5, served_model_name=served)
    async with running_server(model_parts, server=config) as server:
        c = client(server)
        ignore_eos = {"ignore_eos": True}
        chat = await in_thread(c.chat.completions.create, model=served, messages=QUESTION, extra_body=ignore_eos)
        assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
        legacy = await in_thread(c.completions.create, model=served, prompt="Once", extra_body=ignore_eos)
        assert legacy.usage.completion_tokens == 5  # min(16, 5)
        own = await in_thread(
            c.chat.completions.create, model=served, messages=QUESTION, max_tokens=9, extra_body=ignore_eos
        )
        assert own.usage.completion_tokens == 9  # a client's own limit is honoured
        modern = await in_thread(
            c.chat.completions.create, model=served, messages=QUESTION, max_completion_tokens=7, extra_body=ignore_eos
        )
        assert modern.usage.completion_tokens == 7

        card = await in_thread(c.models.retrieve, served)
        assert (card.id, card.object, card.owned_by) == (served, "model", "trillm")
        assert card.model_dump()["max_model_len"] == server.engine.max_model_len
        listed = await in_thread(c.models.list)
        assert listed.data[0].model_dump() == card.model_dump()
        with pytest.raises(openai.NotFoundError) as err:
            await in_thread(c.models.retrieve, "gpt-4o")
        assert err.value.code == "model_not_found" and err.value.body["param"] == "model"
        assert "gpt-4o" in err.value.message


UNSERVED = [
    ("POST", "/v1/audio/transcriptions", "audio"),
    ("POST", "/v1/audio/speech", "audio"),
    ("POST", "/v1/images/generations", "images"),
    ("POST", "/v1/moderations", "moderations"),
    ("GET", "/v1/files", "files"),
    ("POST", "/v1/batches", "batch"),
    ("GET", "/v1/fine_tuning/jobs", "fine-tuning"),
    ("POST", "/v1/assistants", "Assistants"),
    ("POST", "/v1/threads/thread_1/runs", "threads"),
    ("GET", "/v1/vector_stores", "vector stores"),
    ("GET", "/v1/chat/completions/chatcmpl-1", "stored chat completions"),
]


async def test_routes_not_served_answer_openai_shaped_404s(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as err:
        await in_thread(c.moderations.create, model=MODEL, input="hello")
    assert err.value.code == "unsupported_endpoint"
    assert err.value.body["message"] == (
        "trillm does not serve the moderations API (/v1/moderations); see /openapi.json for what it serves"
    )
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        for method, path, name in UNSERVED:
            r = await http.request(method, path, json={"model": MODEL})
            assert r.status_code == 404 and r.headers["content-type"].startswith("application/json"), path
            error = r.json()["error"]
            assert (error["code"], error["type"], error["param"]) == (
                "unsupported_endpoint",
                "invalid_request_error",
                None,
            )
            assert name in error["message"] and path in error["message"], error
        for method, path in [("POST", "/v1/foo"), ("GET", "/v2/models"), ("DELETE", "/nothing/here")]:
            r = await http.request(method, path)
            assert r.status_code == 404 and r.headers["content-type"].startswith("application/json"), path
            error = r.json()["error"]
            assert error["code"] == "unknown_url" and error["type"] == "invalid_request_error"
            assert error["message"].startswith(f"Unknown request URL: {method} {path}. "), error
        r = await http.get("/v1/chat/completions")  # a served path, the wrong method: still JSON
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
