"""gpt-oss's harmony channels: ``analysis`` to ``reasoning_content``, ``final`` (and a
``commentary`` preamble) to ``content``, a commentary message ``to=functions.NAME`` to a tool
call; incremental (every cut of a reply gives the same split), and through the server with
``--reasoning-parser gpt_oss`` (the default model, prompted with harmony text it continues)."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from trillm.api.harmony import HarmonyParser
from trillm.api.reasoning import ChoiceSplitter, split_reasoning
from trillm.api.settings import ServerConfig
from trillm.api.tools.formats import Harmony, detect

from tests.server import MODEL, client, in_thread, running_server

REPLY = (
    "<|channel|>analysis<|message|>The user asks for the capital.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris is the capital.<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


def _streamed(text: str, cut: int) -> tuple[str, str]:
    parser = HarmonyParser()
    pieces = [parser.feed(text[i : i + cut]) for i in range(0, len(text), cut)] + [parser.finish()]
    return "".join(r for r, _ in pieces), "".join(c for _, c in pieces)


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
def test_every_cut_gives_the_same_split(cut):
    assert _streamed(REPLY, cut) == ("The user asks for the capital.", "Paris is the capital.")
    assert split_reasoning("gpt_oss", REPLY) == ("The user asks for the capital.", "Paris is the capital.")


def test_text_without_markers_is_all_answer_and_a_cut_thought_all_thinking():
    assert _streamed("Just an answer <| not a marker", 4) == ("", "Just an answer <| not a marker")
    assert _streamed("<|channel|>analysis<|message|>Still think", 3) == ("Still think", "")


def test_a_function_call_reaches_the_tool_parser_whole():
    reasoning, content = _streamed(CALL, 5)
    assert reasoning == "Need the weather."
    parsed = Harmony().parse(content)
    assert parsed.content is None and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    cut = Harmony().parse(content[:-8])  # the call cut short: dropped, never text
    assert cut.calls == () and "Paris" not in (cut.content or "")
    assert detect("{% if tools %}<|start|>system<|channel|>{% endif %}").name == "harmony"


def test_the_splitter_sends_only_non_empty_fields():
    splitter = ChoiceSplitter("gpt_oss")
    deltas = [splitter.delta(0, REPLY[i : i + 9], i + 9 >= len(REPLY)) for i in range(0, len(REPLY), 9)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user asks for the capital."
    assert "".join(d.get("content", "") for d in deltas) == "Paris is the capital."
    assert (
        all(d for d in deltas if d) and ChoiceSplitter("gpt_oss").message(REPLY)["content"] == "Paris is the capital."
    )


async def test_special_tokens_are_kept_when_asked(model_parts, tokenizer):
    """``skip_special_tokens: false`` (vLLM's extension): the end-of-sequence token forced by a
    logit bias shows in the text; by default it does not."""
    eos = tokenizer.eos_token_id
    body = dict(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, logit_bias={str(eos): 100})
    async with running_server(model_parts) as srv:
        kept = await in_thread(
            client(srv).completions.create, **body, extra_body={"ignore_eos": True, "skip_special_tokens": False}
        )
        skipped = await in_thread(client(srv).completions.create, **body, extra_body={"ignore_eos": True})
    assert kept.choices[0].text == tokenizer.eos_token * 3 and skipped.choices[0].text == ""


async def test_the_server_splits_harmony_channels(model_parts):
    """The default model continues a run of harmony replies; the chat reply is split by channel."""
    prompt = (REPLY.replace("<|return|>", "<|end|>\n") * 3).replace("Paris", "Rome", 1)
    async with running_server(model_parts, reasoning_parser="gpt_oss") as srv:
        raw = await in_thread(
            client(srv).completions.create, model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop="\n"
        )
        text = raw.choices[0].text
        assert text.startswith("<|channel|>analysis<|message|>") and "<|channel|>final<|message|>" in text, text
        reasoning, content = split_reasoning("gpt_oss", text)
        request = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": "\n"}
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            r = await http.post("/v1/chat/completions", json=request)
    message = r.json()["choices"][0]["message"]
    assert reasoning and content and (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert "<|" not in reasoning + content


async def test_the_server_turns_a_harmony_call_into_tool_calls(model_parts):
    """``--reasoning-parser gpt_oss`` with the ``harmony`` tool format: the default model, prompted
    with harmony turns that call a function, calls it; the analysis is reasoning, the call a
    ``tool_calls`` entry (streamed and not), and no marker reaches the client."""
    prompt = "<|start|>assistant" + (CALL + "\n<|start|>assistant") * 3  # the model writes the next turn
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    messages = [{"role": "user", "content": prompt}]
    request = {"model": MODEL, "messages": messages, "max_tokens": 100, "temperature": 0, "tools": tools}
    request["parallel_tool_calls"] = False  # the grammar ends the reply after the call
    # A template that writes the turn's text as it is (and takes tools, so they are not described
    # in a system prompt): the model sees only the harmony turns it continues.
    model, tokenizer, eos = model_parts
    raw = copy.copy(tokenizer)
    raw.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{# tools are the server's #}"
    settings = ServerConfig(reasoning_parser="gpt_oss", tool_call_parser="harmony")
    async with running_server((model, raw, eos), server=settings) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            r = await http.post("/v1/chat/completions", json=request)
            async with http.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as stream:
                events = [line[6:] async for line in stream.aiter_lines() if line.startswith("data: ")]
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls", message
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert "city" in json.loads(message["tool_calls"][0]["function"]["arguments"])
    assert message["reasoning_content"] and "<|" not in (message["reasoning_content"] + (message["content"] or ""))
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1] if json.loads(e)["choices"]]
    streamed = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", ()))
    assert json.loads(streamed) == json.loads(message["tool_calls"][0]["function"]["arguments"])
    assert not any("<|" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)
