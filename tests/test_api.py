"""The OpenAI API end to end: real Hypercorn on loopback, real engine, real ``openai`` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import trio

from trillm.bench.prometheus import scrape
from trillm.engine.execution import prefault

from tests.helpers import wait_idle
from tests.server import MODEL, QUESTION, client, in_thread

pytestmark = pytest.mark.e2e


async def test_models_health_version(server):
    models = await in_thread(lambda: client(server).models.list())
    assert [m.id for m in models.data] == [MODEL]
    async with httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        assert (await http.get("/version")).status_code == 200


async def test_streaming_answer_is_sensible_and_matches_non_streaming(server):
    def run():
        c = client(server)
        chunks = list(
            c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0, stream=True)
        )
        whole = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0)
        return chunks, whole

    chunks, whole = await in_thread(run)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.model == MODEL and ch.created for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert "Paris" in streamed
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].delta.content is None
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.content == streamed
    assert whole.choices[0].finish_reason == "stop"
    tok = server.engine.tokenizer
    templated = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(tok(templated, add_special_tokens=False)["input_ids"])
    assert whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert 1 <= whole.usage.completion_tokens <= 30


async def test_raw_prompt_and_length_finish(server):
    def run():
        return client(server).chat.completions.create(
            model=MODEL,
            messages=[],
            extra_body={"prompt": "The first ten prime numbers are", "ignore_eos": True},
            temperature=0.7,
        )

    # The openai client always sends messages; a raw prompt goes through httpx instead.
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        r = await http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "prompt": "The first ten prime numbers are",
                "ignore_eos": True,
                "temperature": 0.7,
                "max_tokens": 16,
            },
        )
    body = r.json()
    assert r.status_code == 200, body
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"]
    with pytest.raises(openai.BadRequestError):
        await in_thread(run)  # messages=[] and prompt together is a 400


async def test_stream_include_usage(server):
    def run():
        return list(
            client(server).chat.completions.create(
                model=MODEL,
                messages=QUESTION,
                max_tokens=5,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )

    chunks = await in_thread(run)
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"


async def test_continuous_usage_stats_put_usage_on_every_chunk(server):
    """guidellm asks for vLLM's ``stream_options.continuous_usage_stats``: usage so far on every chunk,
    for chat and completions (each choice its own count), and the totals chunk at the end as before."""
    c = client(server)
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = dict(model=MODEL, max_tokens=5, temperature=0, stream=True, stream_options=options)

    def run():
        chat = list(c.chat.completions.create(messages=QUESTION, extra_body={"ignore_eos": True}, **common))
        prompts = ["The sky is", "Once upon a time"]
        text = list(c.completions.create(prompt=prompts, extra_body={"ignore_eos": True}, **common))
        return chat, text

    chat, text = await in_thread(run)
    for chunks, choices in ((chat, 1), (text, 2)):
        *pieces, total = chunks
        assert total.choices == [] and total.usage.completion_tokens == 5 * choices
        assert all(ch.usage is not None for ch in pieces)
        for index in range(choices):
            mine = [ch.usage for ch in pieces if ch.choices[0].index == index]
            counts = [u.completion_tokens for u in mine]
            assert counts == sorted(counts) and counts[-1] == 5 and len(set(counts)) > 1
            assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in mine)
            assert len({u.prompt_tokens for u in mine}) == 1
    per_choice = {ch.choices[0].index: ch.usage.prompt_tokens for ch in text[:-1]}
    assert sum(per_choice.values()) == text[-1].usage.prompt_tokens


BAD_REQUESTS = [
    ({"model": MODEL}, 400, "messages"),
    ({"messages": QUESTION}, 400, "model"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content",
    ),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": QUESTION, "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "messages": QUESTION, "temperature": True}, 400, "temperature"),
    ({"model": MODEL, "messages": QUESTION, "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "messages": QUESTION, "top_k": 0}, 400, "top_k"),
    ({"model": MODEL, "messages": QUESTION, "n": 0}, 400, "n"),
    ({"model": MODEL, "messages": QUESTION, "n": 33}, 400, "n"),
    ({"model": MODEL, "messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": MODEL, "messages": QUESTION, "stop": [1]}, 400, "stop"),
    ({"model": MODEL, "messages": QUESTION, "presence_penalty": -2.5}, 400, "presence_penalty"),
    ({"model": MODEL, "messages": QUESTION, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": MODEL, "messages": QUESTION, "logit_bias": {"12": 101}}, 400, "logit_bias"),
    ({"model": MODEL, "messages": QUESTION, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": MODEL, "messages": QUESTION, "seed": "x"}, 400, "seed"),
    ({"model": MODEL, "messages": QUESTION, "min_p": 1.5}, 400, "min_p"),
    ({"model": MODEL, "messages": QUESTION, "min_tokens": -1}, 400, "min_tokens"),
    ({"model": MODEL, "messages": QUESTION, "stop_token_ids": [-3]}, 400, "stop_token_ids"),
    ({"model": MODEL, "messages": QUESTION, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": QUESTION, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": QUESTION, "frequency_penalty": 3}, 400, "frequency_penalty"),
    ({"model": MODEL, "messages": QUESTION, "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "messages": QUESTION, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "gpt-4", "messages": QUESTION}, 404, "model"),
    ([1, 2, 3], 400, None),
]


async def test_bad_input_gets_openai_shaped_errors_and_does_not_disturb_a_stream(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": QUESTION,
                "max_tokens": 40,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0,
            },
        ) as stream:
            lines = stream.aiter_lines()
            first = await lines.__anext__()
            assert first.startswith("data: ")
            for body, status, param in BAD_REQUESTS:
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == status, (body, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
                assert err["param"] == param, (body, err)
            for raw in (
                b"{not json",
                b"[" * 100_000 + b"]" * 100_000,
                b'{"max_tokens": ' + b"9" * 5000 + b"}",
                b"\xff\xfe",
            ):
                r = await http.post("/v1/chat/completions", content=raw)
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", raw[:20]
            assert await _oversized_body_status(server) == 413
            r = await http.get("/v1/nothing-here")
            assert r.status_code == 404 and "error" in r.json()
            long_prompt = "hello " * 9000
            r = await http.post("/v1/chat/completions", json={"model": MODEL, "prompt": long_prompt})
            assert r.status_code == 400 and str(server.engine.max_model_len) in r.json()["error"]["message"]
            assert "9001" in r.json()["error"]["message"]
            room = server.engine.max_model_len - 10
            fits = {"model": MODEL, "prompt": "hello " * 10, "max_tokens": room, "temperature": 0}
            r = await http.post("/v1/completions", json={**fits, "max_tokens": room + 5})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
            assert str(room + 5) in err["message"] and str(server.engine.max_model_len) in err["message"]
            rest = [line async for line in lines if line]
        events = [first, *rest]
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2][len("data: ") :])
    assert final["choices"][0]["finish_reason"] == "length"
    content = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert len([c for c in content if c]) >= 30  # the stream carried on to its 40 tokens


async def _oversized_body_status(server) -> int:
    """Announce a 9 MiB body and send none of it: the 413 must come back at once."""
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with stream:
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 9437184\r\n\r\n"
        )
        reply = b""
        with trio.fail_after(10):
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                reply += await stream.receive_some()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    return int(head.split()[1])


async def test_openai_client_raises_typed_errors(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as nf:
        await in_thread(c.chat.completions.create, model="nope", messages=QUESTION)
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await in_thread(c.chat.completions.create, model=MODEL, messages=QUESTION, temperature=9)
    assert bad.value.body["param"] == "temperature"


async def _drop_after(server, n_events: int) -> None:
    """A raw client that reads ``n_events`` SSE events and then hangs up."""
    body = json.dumps({"model": MODEL, "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True})
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with stream:
        await stream.send_all(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        seen = b""
        while seen.count(b"data: ") < n_events:
            data = await stream.receive_some()
            assert data, "server closed early"
            seen += data


async def _metric(server, name: str) -> float:
    async with httpx.AsyncClient(base_url=server.url) as http:
        text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith((f"trillm:{name}{{", f"trillm:{name} ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} missing")


async def test_disconnect_storm_frees_everything_and_server_still_serves(server):
    total = server.engine.stats().total_pages
    async with trio.open_nursery() as nursery:
        for i in range(40):
            nursery.start_soon(_drop_after, server, 1 + i % 6)
    # Every dropped stream is released within a few steps.
    await wait_idle(server.engine, timeout=10)
    assert server.engine.stats().num_aborted >= 40
    assert await _metric(server, "num_requests_running") == 0
    free, evictable = await _metric(server, "kv_cache_free_pages"), await _metric(server, "kv_cache_evictable_pages")
    assert free + evictable == total
    reply = await in_thread(client(server).chat.completions.create, model=MODEL, messages=QUESTION, max_tokens=8)
    assert reply.choices[0].message.content


async def test_metrics_report_the_weight_bytes_a_decode_step_reads(server):
    """The default model serves from GGUF blocks: under a quarter of its float32 bytes."""
    model = server.engine.model
    reported = await _metric(server, "model_weight_bytes_per_step")
    float32_bytes = sum(4 * p.shape[0] * p.shape[1] for p in model.projections())
    assert reported == model.projection_bytes
    assert model.num_block_weights == len(model.projections()) and reported < float32_bytes / 4


async def test_metrics_report_the_weights_still_read_in_the_background(server):
    """The default model's file is read into memory after start; the gauge falls to 0 once it is."""
    for _ in range(120):
        if await _metric(server, "weights_pending_bytes") == 0:
            break
        await trio.sleep(0.5)
    assert await _metric(server, "weights_pending_bytes") == 0 == prefault.weights_pending_bytes()


async def test_non_streaming_client_that_gives_up_frees_its_request(server):
    async with httpx.AsyncClient(base_url=server.url) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(
                "/v1/chat/completions",
                timeout=1.0,
                json={"model": MODEL, "messages": QUESTION, "max_tokens": 2000, "ignore_eos": True},
            )
    await wait_idle(server.engine, timeout=10)
    assert server.engine.stats().num_aborted == 1


async def test_tokenize_detokenize_round_trip(server):
    text = "Hello, wörld! 東京 🎉"
    async with httpx.AsyncClient(base_url=server.url) as http:
        t = (await http.post("/tokenize", json={"model": MODEL, "prompt": text})).json()
        assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == server.engine.max_model_len
        back = (await http.post("/detokenize", json={"model": MODEL, "tokens": t["tokens"]})).json()
        assert back == {"prompt": text}
        chat = (await http.post("/tokenize", json={"model": MODEL, "messages": QUESTION})).json()
        reply = await in_thread(client(server).chat.completions.create, model=MODEL, messages=QUESTION, max_tokens=1)
        assert chat["count"] == reply.usage.prompt_tokens
        for path, body, status in [
            ("/tokenize", {"model": "nope", "prompt": "x"}, 404),
            ("/tokenize", {"prompt": 5}, 400),
            ("/detokenize", {"tokens": [-1]}, 400),
            ("/detokenize", {"tokens": "abc"}, 400),
        ]:
            r = await http.post(path, json=body)
            assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_tokenizer_info_is_vllms_shape(server):
    """lm-eval's ``tokenizer_backend=auto`` asks for vLLM's ``GET /tokenizer_info``."""
    tok = server.engine.tokenizer
    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.get("/tokenizer_info")
    info = r.json()
    assert r.status_code == 200 and info["tokenizer_class"] == type(tok).__name__
    assert info["chat_template"] == tok.chat_template
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token  # text, not objects
    assert info["model_max_length"] == tok.model_max_length
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    decoder = info["added_tokens_decoder"]
    assert decoder[str(tok.eos_token_id)] == tok.eos_token


async def test_unknown_fields_are_ignored_and_extra_paths_work_through_the_openai_client(server):
    c = client(server)
    reply = await in_thread(
        c.chat.completions.create,
        model=MODEL,
        messages=QUESTION,
        max_tokens=3,
        user="u1",
        extra_body={"best_of": 1, "some_future_field": {"x": 1}, "use_beam_search": False},
    )
    assert reply.usage.completion_tokens >= 1
    # The docs show the openai client reaching the non-/v1 endpoints by absolute URL.
    tokens = await in_thread(c.post, server.url + "/tokenize", body={"prompt": "Hello"}, cast_to=object)
    assert tokens["count"] == len(tokens["tokens"]) >= 1
    text = await in_thread(c.post, server.url + "/detokenize", body={"tokens": tokens["tokens"]}, cast_to=object)
    assert text == {"prompt": "Hello"}
    assert (await in_thread(c.get, server.url + "/health", cast_to=object)) == {"status": "ok"}
    assert "version" in await in_thread(c.get, server.url + "/version", cast_to=object)


async def test_metrics_report_request_timings_and_outcomes(server):
    c = client(server)
    await in_thread(
        c.chat.completions.create, model=MODEL, messages=QUESTION, max_tokens=5, extra_body={"ignore_eos": True}
    )
    async with httpx.AsyncClient(base_url=server.url) as http:
        text = (await http.get("/metrics")).text
    label = f'model_name="{MODEL}"'
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert f"trillm:{name}_count{{{label}}} 1.0" in text, name
    assert f"trillm:inter_token_latency_seconds_count{{{label}}} 4.0" in text
    assert f'trillm:request_success_total{{finished_reason="length",{label}}} 1.0' in text
    values = scrape(text)  # the bench's parser reads the same page
    assert values["kv_cache_total_pages"] == server.engine.stats().total_pages
    assert values["request_success_total"] == 1.0 and values["num_requests_running"] == 0
