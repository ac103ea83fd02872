"""A thinking budget (``engine/structured/thinking_budget.py``): after N tokens of thinking the
reply is made to close it (the closing tag and the blank line forced), and goes on as the model
would from there; thinking the model closes itself, or a reply that does not open with thinking,
is left alone. Through the API: Anthropic's ``thinking.budget_tokens`` (mapped; its >= 1024
tokens are too many to generate here) and chat's ``thinking_budget`` (end to end)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import trio

from trillm.api.chat import budgeted as budgeted_params
from trillm.api.schemas.anthropic import parse_messages_request
from trillm.engine.sampling_params import SamplingParams
from trillm.engine.structured.thinking_budget import ThinkingBudget

from tests.helpers import make_engine, wait_idle
from tests.server import MODEL, client, in_thread, running_server

END, AFTER = (7, 8), (9,)


def _budget(budget: int, start: tuple[int, ...] = (), max_tokens: int | None = None) -> ThinkingBudget:
    return ThinkingBudget(budget, start, END, AFTER, max_tokens)


def _run(budget: ThinkingBudget, sampled: list[int]) -> list[int]:
    """What a reply becomes: each row the forced token if any, else the one sampled."""
    out = []
    for token in sampled:
        forced = budget.next_forced()
        out.append(token if forced is None else forced)
        budget.took(out[-1])
    return out


def test_the_budget_forces_the_end_then_lets_the_reply_go():
    assert _run(_budget(3), [1, 2, 3, 4, 5, 6, 1]) == [1, 2, 3, 7, 8, 9, 1]
    assert _run(_budget(0), [1, 2, 3, 4]) == [7, 8, 9, 4]
    # closed by the model itself within the budget: nothing forced, ever
    assert _run(_budget(4), [1, 7, 8, 2, 3, 4, 5, 6]) == [1, 7, 8, 2, 3, 4, 5, 6]
    # an explicit start: counted from after it; a reply that does not open with it is left alone
    assert _run(_budget(2, start=(5, 6)), [5, 6, 1, 2, 3, 4, 4]) == [5, 6, 1, 2, 7, 8, 9]
    assert _run(_budget(1, start=(5, 6)), [5, 1, 2, 3, 4]) == [5, 1, 2, 3, 4]
    # max_tokens: the closing tag starts early enough to fit whole (a cut never leaves a piece of it)
    assert _run(_budget(3, max_tokens=4), [1, 2, 3, 4]) == [1, 2, 7, 8]
    assert _run(_budget(3, max_tokens=5), [1, 2, 3, 4, 5]) == [1, 2, 3, 7, 8]
    assert _run(_budget(3, max_tokens=6), [1, 2, 3, 4, 5, 6]) == [1, 2, 3, 7, 8, 9]


async def _greedy(engine, ids: list[int], **params) -> list[int]:
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **params)
    async with engine.generate(ids, p) as outputs:
        return [t async for out in outputs for t in out.token_ids]


async def test_the_engine_closes_the_thinking_and_continues_as_the_model_would(model_parts, tokenizer):
    engine = make_engine(model_parts)
    ids = tokenizer("<think>\nThe question is simple. Let me think", add_special_tokens=False)["input_ids"]
    end = tuple(tokenizer("</think>", add_special_tokens=False)["input_ids"])
    after = tuple(tokenizer("\n\n", add_special_tokens=False)["input_ids"])
    budget = {"thinking_budget": 6, "thinking_end_ids": end, "thinking_after_ids": after}
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        free = await _greedy(engine, ids)
        assert tokenizer.decode(free).find("</think>") < 0  # it would not close by itself
        kept = await _greedy(engine, ids, **budget)
        forced = 6 + len(end) + len(after)
        assert kept[:6] == free[:6] and tuple(kept[6:forced]) == end + after
        # what follows is the model's own greedy continuation of that text
        assert kept[forced:] == (await _greedy(engine, ids + kept[:forced]))[: len(kept) - forced]
        await wait_idle(engine)
        stats = engine.stats()
        assert stats.free_pages + stats.evictable_pages == stats.total_pages
        nursery.cancel_scope.cancel()


def test_anthropic_budget_tokens_becomes_the_requests_budget(tokenizer):
    body = {"model": MODEL, "max_tokens": 2000, "messages": [{"role": "user", "content": "Hi"}]}
    budgeted = parse_messages_request({**body, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    engine = SimpleNamespace(tokenizer=tokenizer)
    params = budgeted_params(engine, budgeted, "qwen3")
    assert budgeted.thinking_budget == 1024 and params.thinking_budget == 1024 and not params.speculative
    assert tokenizer.decode(params.thinking_start_ids) == "<think>" and tokenizer.decode(params.thinking_end_ids) == (
        "</think>"
    )
    assert budgeted_params(engine, budgeted, "deepseek_r1").thinking_start_ids == ()
    for thinking in ({"type": "adaptive"}, {"type": "disabled"}, None):
        assert parse_messages_request({**body, "thinking": thinking}).thinking_budget is None


@pytest.mark.e2e
async def test_chat_thinking_budget_ends_the_thinking_and_the_answer_follows(model_parts):
    """Under ``deepseek_r1`` the default model's whole reply is thinking; with a budget of 3 its
    thinking stops after 3 tokens, and the rest of the reply is the answer."""
    async with running_server(model_parts, reasoning_parser="deepseek_r1") as srv:

        def run():
            c = client(srv)
            ask = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
            free = c.chat.completions.create(**ask, max_tokens=20, temperature=0)
            kept = c.chat.completions.create(**ask, max_tokens=20, temperature=0, extra_body={"thinking_budget": 3})
            streamed = c.chat.completions.create(
                **ask, max_tokens=20, temperature=0, stream=True, extra_body={"thinking_budget": 3}
            )
            pieces = [(d.choices[0].delta.model_extra or {}, d.choices[0].delta.content) for d in streamed if d.choices]
            short = c.chat.completions.create(**ask, max_tokens=4, temperature=0, extra_body={"thinking_budget": 3})
            bad = httpx.post(srv.base_url + "/chat/completions", json={**ask, "thinking_budget": -1})
            return free, kept, pieces, short, bad

        free, kept, pieces, short, bad = await in_thread(run)
    assert free.choices[0].message.content is None  # all thinking, without a budget
    thought, answer = kept.choices[0].message.reasoning_content, kept.choices[0].message.content
    assert free.choices[0].message.reasoning_content.startswith(thought) and len(thought) < 20 and answer
    assert "".join(extra.get("reasoning_content") or "" for extra, _ in pieces) == thought
    assert "".join(content or "" for _, content in pieces) == answer
    # max_tokens 4 leaves room for one token of thinking and the whole closing tag, never a piece of it
    assert "<" not in short.choices[0].message.reasoning_content and short.choices[0].finish_reason == "length"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "thinking_budget"
