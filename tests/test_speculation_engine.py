"""Speculative decoding on the real default model: what an engine emits with proposals verified
is what it emits without them (greedy, float32: token for token, logprobs too), through stops,
length cuts, penalties and biases, ``n`` > 1 through the server (streaming and not); seeded
sampling repeats; a request can opt out; Predicted Outputs fill OpenAI's usage fields; and every
page comes back, requests cut off mid-verification included."""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import pytest
import torch
import trio

from trillm.engine import Engine, SamplingParams

from tests.helpers import make_engine, wait_idle
from tests.server import MODEL, client, in_thread, running_server

LIST = [{"role": "user", "content": "Repeat this list exactly three times: apple, banana, cherry, date, fig."}]
CODE = [{"role": "user", "content": "Write a Python function add(a, b), then the same function again named add2."}]
RAW = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on"


def _prompts(tokenizer: Any) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in (LIST, CODE)]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in chats] + [tokenizer(RAW)["input_ids"]]


async def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[Any]]:
    """Every request at once; each one's outputs."""
    results: list[list[Any]] = [[] for _ in requests]

    async def one(i: int, ids: list[int], params: SamplingParams) -> None:
        async with engine.generate(ids, params) as outputs:
            results[i] = [o async for o in outputs]

    async with trio.open_nursery() as nursery:
        for i, (ids, params) in enumerate(requests):
            nursery.start_soon(one, i, ids, params)
    return results


async def _served(model_parts: Any, mode: str, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list, Any]:
    """The requests through a fresh engine speculating ``mode``; its outputs and final stats (idle)."""
    engine = make_engine(model_parts, speculative=mode)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        results = []
        for request in requests:  # one at a time: a lone stream is where speculation runs
            results += await _run(engine, [request])
        await wait_idle(engine)
        stats = engine.stats()
        nursery.cancel_scope.cancel()
    return results, stats


def _tokens(outputs: list[Any]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def _logprobs(outputs: list[Any]) -> list[Any]:
    return [lp for o in outputs for lp in o.logprobs]


GREEDY = SamplingParams(max_tokens=60, temperature=0.0, logprobs=2)


async def test_greedy_output_and_logprobs_are_the_plain_ones(model_parts, tokenizer) -> None:
    requests = [(ids, GREEDY) for ids in _prompts(tokenizer)]
    plain, _ = await _served(model_parts, "off", requests)
    spec, stats = await _served(model_parts, "ngram", requests)
    for a, b in zip(plain, spec):
        assert _tokens(a) == _tokens(b)
        assert "".join(o.text for o in a) == "".join(o.text for o in b)
        assert a[-1].finish_reason == b[-1].finish_reason
        for x, y in zip(_logprobs(a), _logprobs(b)):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    (counts,) = stats.speculation
    assert counts.method == "ngram" and counts.drafts > 0 and counts.accepted_tokens > 0
    assert counts.emitted_tokens == counts.accepted_tokens + counts.drafts


async def test_stops_cuts_penalties_and_biases_inside_accepted_runs(model_parts, tokenizer) -> None:
    ids = _prompts(tokenizer)[0]
    (reference,), _ = await _served(model_parts, "off", [(ids, GREEDY)])
    tokens = _tokens(reference)
    text = "".join(o.text for o in reference)
    variants = (
        [
            SamplingParams(max_tokens=n, temperature=0.0)
            for n in (5, 13, 22)  # cut wherever a run ends
        ]
        + [
            SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=(tokens[len(tokens) * 2 // 3],)),
            SamplingParams(max_tokens=60, temperature=0.0, stop=(text[len(text) // 2 : len(text) // 2 + 6],)),
            SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=0.3, presence_penalty=0.2),
            SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.2, logit_bias=((tokens[3], 3.0),)),
            SamplingParams(max_tokens=40, temperature=0.0, min_tokens=10, ignore_eos=True),
        ]
    )
    plain, _ = await _served(model_parts, "off", [(ids, p) for p in variants])
    spec, stats = await _served(model_parts, "ngram", [(ids, p) for p in variants])
    for params, a, b in zip(variants, plain, spec):
        assert _tokens(a) == _tokens(b), params
        assert "".join(o.text for o in a) == "".join(o.text for o in b), params
        assert a[-1].finish_reason == b[-1].finish_reason
        assert [o.num_output_tokens for o in a][-1] == [o.num_output_tokens for o in b][-1]
    assert stats.speculation[0].accepted_tokens > 0


async def test_seeded_sampling_repeats_and_a_request_may_opt_out(model_parts, tokenizer) -> None:
    ids = _prompts(tokenizer)[2]
    seeded = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.95, seed=11, ignore_eos=True)
    (first, second), stats = await _served(model_parts, "ngram", [(ids, seeded), (ids, seeded)])
    assert _tokens(first) == _tokens(second) and len(_tokens(first)) == 40
    assert stats.speculation[0].drafts > 0
    (plain,), _ = await _served(model_parts, "off", [(ids, GREEDY)])
    (opted,), opted_stats = await _served(model_parts, "ngram", [(ids, attrs.evolve(GREEDY, speculative=False))])
    assert opted_stats.speculation == ()  # it proposed nothing
    assert _tokens(opted) == _tokens(plain)


async def test_preemption_and_many_streams_with_speculation(model_parts, tokenizer) -> None:
    """A pool too small for every stream at once: verifications are preempted and recomputed,
    and the outputs are still the plain ones; every page comes back."""
    prompts = _prompts(tokenizer)
    requests = [(prompts[i % 3], attrs.evolve(GREEDY, max_tokens=48, logprobs=None)) for i in range(6)]

    async def all_at_once(mode: str) -> tuple[list[list[Any]], Any]:
        engine = make_engine(model_parts, speculative=mode, num_pages=24, page_size=8)
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            results = await _run(engine, requests)
            await wait_idle(engine)
            stats = engine.stats()
            nursery.cancel_scope.cancel()
        return results, stats

    plain, _ = await all_at_once("off")
    spec, stats = await all_at_once("ngram")
    assert [_tokens(r) for r in plain] == [_tokens(r) for r in spec]
    assert stats.num_preemptions > 0 and stats.speculation[0].drafts > 0
    assert stats.free_pages + stats.evictable_pages == stats.total_pages


@pytest.mark.parametrize("stream", [False, True])
async def test_predicted_outputs_count_accepted_and_rejected_tokens(model_parts, stream: bool) -> None:
    async with running_server(model_parts, speculative="ngram") as srv:
        c = client(srv)
        plain = await in_thread(c.chat.completions.create, model=MODEL, messages=CODE, max_tokens=60, temperature=0)
        answer = plain.choices[0].message.content
        edited = answer.replace("add2", "plus")  # the prediction is close to, not equal to, the reply
        kwargs = dict(
            model=MODEL, messages=CODE, max_tokens=60, temperature=0, prediction={"type": "content", "content": edited}
        )
        if stream:
            chunks = await in_thread(
                lambda: list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
            )
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            usage = chunks[-1].usage
        else:
            reply = await in_thread(c.chat.completions.create, **kwargs)
            text, usage = reply.choices[0].message.content, reply.usage
        assert text == answer  # the prediction changes the speed, never the reply
        details = usage.completion_tokens_details
        predicted = len(srv.engine.tokenizer(edited, add_special_tokens=False)["input_ids"])
        assert 0 < details.accepted_prediction_tokens <= predicted
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == predicted
        assert plain.usage.completion_tokens_details is None  # no prediction, no details
        metrics = (await in_thread(httpx.get, srv.url + "/metrics")).text
        accepted = [line for line in metrics.splitlines() if line.startswith("trillm:spec_decode_num_accepted_tokens")]
        assert any('method="prediction"' in line and float(line.split()[-1]) > 0 for line in accepted), accepted


@pytest.mark.parametrize("stream", [False, True])
async def test_several_choices_through_the_server_are_the_plain_reply(model_parts, stream: bool) -> None:
    """``n`` = 3 greedy choices, with and without a stop string, from a speculating server that is
    handed the reply as a predicted output (so every choice verifies proposals): each choice is
    the reply a server without speculation gives, streaming and not."""
    kwargs: dict[str, Any] = dict(model=MODEL, messages=CODE, max_tokens=60, temperature=0)

    async def replies(mode: str, n: int, **more: Any) -> tuple[list[tuple[str, str]], str]:
        async with running_server(model_parts, speculative=mode) as srv:
            c = client(srv)
            if stream:
                chunks = await in_thread(lambda: list(c.chat.completions.create(**kwargs, **more, n=n, stream=True)))
                texts, ends = [""] * n, [""] * n
                for chunk in chunks:
                    for choice in chunk.choices:
                        texts[choice.index] += choice.delta.content or ""
                        ends[choice.index] = choice.finish_reason or ends[choice.index]
                got = list(zip(texts, ends))
            else:
                reply = await in_thread(c.chat.completions.create, **kwargs, **more, n=n)
                got = [(ch.message.content, ch.finish_reason) for ch in sorted(reply.choices, key=lambda ch: ch.index)]
            metrics = (await in_thread(httpx.get, srv.url + "/metrics")).text
        return got, metrics

    (plain,), _ = await replies("off", 1)
    stop = plain[0][len(plain[0]) // 2 :][:6]  # a stop string inside the reply: each choice ends there
    (cut,), _ = await replies("off", 1, stop=[stop])
    assert cut[1] == "stop" and len(cut[0]) < len(plain[0])
    predicted = {"prediction": {"type": "content", "content": plain[0]}}
    for more, want in ((predicted, plain), ({**predicted, "stop": [stop]}, cut)):
        got, metrics = await replies("ngram", 3, **more)
        assert got == [want] * 3
        accepted = [line for line in metrics.splitlines() if line.startswith("trillm:spec_decode_num_accepted_tokens")]
        assert any(float(line.split()[-1]) > 0 for line in accepted), accepted  # proposals were kept


async def test_requests_cut_off_during_verifications_give_every_page_back(model_parts, tokenizer) -> None:
    """Consumers that stop after 1..6 outputs while their request verifies a predicted output (and
    others that are cancelled from outside mid-step): every page is free or cached afterwards."""
    ids = _prompts(tokenizer)[1]
    (reference,), _ = await _served(model_parts, "off", [(ids, GREEDY)])
    predicted = attrs.evolve(GREEDY, prediction=tuple(_tokens(reference)), logprobs=None)
    engine = make_engine(model_parts, speculative="ngram", num_pages=48)

    async def stop_after(n: int) -> None:
        async with engine.generate(ids, predicted) as outputs:
            count = 0
            async for _ in outputs:
                count += 1
                if count >= n:
                    return

    async def cut_at(seconds: float) -> None:
        with trio.move_on_after(seconds):
            async with engine.generate(ids, predicted) as outputs:
                async for _ in outputs:
                    pass

    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        for n in range(1, 7):
            await stop_after(n)
        async with trio.open_nursery() as clients:
            for i in range(6):
                clients.start_soon(cut_at, 0.01 + 0.015 * i)
                clients.start_soon(stop_after, 1 + i)
        await wait_idle(engine)
        stats = engine.stats()
        assert stats.free_pages + stats.evictable_pages == stats.total_pages
        assert stats.num_aborted >= 6
        drafts = sum(c.drafts for c in stats.speculation)
        assert drafts > 0 and sum(c.accepted_tokens for c in stats.speculation) > 0  # cuts among verifications
        nursery.cancel_scope.cancel()
    assert engine.stats().free_pages == engine.stats().total_pages


SCHEMA = {
    "type": "array",
    "minItems": 4,
    "maxItems": 4,
    "items": {
        "type": "object",
        "properties": {"fruit": {"type": "string"}, "colour": {"type": "string"}},
        "required": ["fruit", "colour"],
    },
}


async def test_a_grammar_masks_each_proposal_and_the_output_is_the_plain_one(model_parts, tokenizer) -> None:
    """JSON with repeated keys: proposals come true, each verification row is masked after the
    proposals before it, and the output is what plain constrained decoding gives."""
    from trillm.engine.structured import GrammarSpec

    chat = [{"role": "user", "content": "List four fruits and their colours as JSON."}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    results = {}
    for mode in ("off", "ngram"):
        engine = make_engine(model_parts, speculative=mode)
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            grammar = await engine.compile_grammar(GrammarSpec.json_schema(SCHEMA))
            params = SamplingParams(max_tokens=120, temperature=0.0, grammar=grammar)
            (outputs,) = await _run(engine, [(ids, params)])
            await wait_idle(engine)
            results[mode] = (outputs, engine.stats())
            nursery.cancel_scope.cancel()
    (plain, _), (spec, stats) = results["off"], results["ngram"]
    assert _tokens(plain) == _tokens(spec)
    assert plain[-1].finish_reason == spec[-1].finish_reason == "stop"
    assert len(json.loads("".join(o.text for o in spec))) == 4
    assert stats.speculation[0].accepted_tokens > 0


async def test_suffix_proposes_what_earlier_requests_wrote_until_the_cache_is_flushed(model_parts, tokenizer) -> None:
    chat = [{"role": "user", "content": "Describe the water cycle for a ten-year-old."}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    engine = make_engine(model_parts, speculative="suffix")
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        (first,) = await _run(engine, [(ids, params)])
        before = {c.method: c for c in engine.stats().speculation}
        (second,) = await _run(engine, [(ids, params)])
        after = {c.method: c for c in engine.stats().speculation}
        await wait_idle(engine)
        control = engine.scheduler.speculation
        assert control is not None and control.suffix is not None and control.suffix.size > 0
        engine.flush_cache()
        assert control.suffix.size == 0 and not control.suffix.counts
        nursery.cancel_scope.cancel()
    assert _tokens(first) == _tokens(second)
    gained = after["suffix"].accepted_tokens - (before["suffix"].accepted_tokens if "suffix" in before else 0)
    assert gained >= len(_tokens(second)) // 2  # most of the repeat came from the first one's output


async def test_a_draft_model_proposes_and_the_output_is_the_plain_one(model_parts, tokenizer) -> None:
    """The default model drafting for itself: every greedy guess is right (the draft computes what
    the target does), so nearly every proposal is kept, and the output is the plain one; its K/V
    over the same pages survives preemption and the prefix cache."""
    prompts = _prompts(tokenizer)
    requests = [(prompts[i % 3], attrs.evolve(GREEDY, max_tokens=40)) for i in range(4)]
    plain, _ = await _served(model_parts, "off", requests)
    engine = make_engine(model_parts, draft=model_parts[0], speculative="draft", draft_model=MODEL)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        drafted = []
        for request in requests:
            drafted += await _run(engine, [request])
        together = await _run(engine, requests)  # at once, in a pool where they share prompt pages
        await wait_idle(engine)
        stats = engine.stats()
        nursery.cancel_scope.cancel()
    for a, b, c in zip(plain, drafted, together):
        assert _tokens(a) == _tokens(b) == _tokens(c)
        for x, y in zip(_logprobs(a), _logprobs(b)):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
    (counts,) = stats.speculation
    assert counts.method == "draft" and counts.accepted_tokens >= 0.9 * counts.draft_tokens > 0


def test_a_draft_model_is_refused_in_one_line_before_its_weights_load() -> None:
    from trillm.engine.config import EngineConfig
    from trillm.engine.execution.draft import load_draft_model

    with pytest.raises(ValueError, match="--speculative draft needs --draft-model"):
        EngineConfig(speculative="draft")
    with pytest.raises(FileNotFoundError, match="--draft-model no-such-model: model 'no-such-model' is neither"):
        load_draft_model(EngineConfig(draft_model="no-such-model"))
    # Gemma 3's 262,144 tokens are not SmolLM2's 49,152: refused from the tokenizers alone
    with pytest.raises(ValueError, match="vocabulary differs from the model's \\(262144 against 49152"):
        load_draft_model(EngineConfig(draft_model="gemma-3-270m-q4_k_m"))


def test_a_draft_model_loads_under_each_mode_that_uses_it() -> None:
    """`--speculative draft --draft-model X` (and `auto`) load the draft as `serve` does: the draft's
    own settings once carried `draft` without a draft model, and the start was refused."""
    from trillm.engine.config import EngineConfig
    from trillm.engine.execution.draft import load_draft_model

    for mode in ("draft", "auto"):
        draft = load_draft_model(EngineConfig(model=MODEL, speculative=mode, draft_model=MODEL))
        assert draft.shape.vocab_size == 49152, mode


async def test_draft_masks_stop_at_a_refused_token_and_after_a_stop_and_leave_the_matcher_as_it_was(
    model_parts, tokenizer
) -> None:
    from trillm.engine.structured import GrammarSpec
    from trillm.engine.structured.matcher import Matcher

    engine = make_engine(model_parts)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        grammar = await engine.compile_grammar(GrammarSpec.choice(["yes", "no"]))
        nursery.cancel_scope.cancel()
    vocab = model_parts[0].shape.vocab_size
    yes = tokenizer("yes", add_special_tokens=False)["input_ids"]
    stop = sorted(grammar.stop_ids)[0]
    matcher = Matcher(grammar)
    fresh, _ = matcher.draft_masks((), vocab)
    masks, taken = matcher.draft_masks((*yes, stop, yes[0]), vocab)
    assert taken == len(yes) + 1  # "yes", then the stop token; nothing after it is verified
    assert masks.rows == list(range(taken + 1)) and torch.equal(masks.bitmask[0], fresh.bitmask[0])
    no_token = tokenizer("maybe", add_special_tokens=False)["input_ids"][0]
    masks, taken = matcher.draft_masks((no_token, *yes), vocab)
    assert taken == 0 and masks.rows == [0]  # refused at once: only the first row is scored
    assert matcher.num_accepted == 0 and matcher.active  # every probe rolled back
    again, _ = matcher.draft_masks((), vocab)
    assert torch.equal(again.bitmask, fresh.bitmask)


async def test_the_kernel_backend_verifies_to_the_plain_output(tokenizer) -> None:
    """The Triton backend's layout (here its torch references): a verification's positions as
    one-token queries, each with its own context."""
    from trillm.engine.config import EngineConfig
    from trillm.engine.execution.loading import load_model

    parts = load_model(EngineConfig(kernels="reference", dtype="float32"))
    chat = [{"role": "user", "content": "Copy this sentence five times: The quick brown fox jumps over the lazy dog."}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    request = (tokenizer(text, add_special_tokens=False)["input_ids"], SamplingParams(max_tokens=60, temperature=0.0))
    results = {}
    for mode in ("off", "ngram"):
        engine = make_engine(parts, kernels="reference", speculative=mode)
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            (results[mode],) = await _run(engine, [request])
            await wait_idle(engine)
            stats = engine.stats()
            nursery.cancel_scope.cancel()
    assert _tokens(results["off"]) == _tokens(results["ngram"])
    assert stats.speculation[0].accepted_tokens > 0
