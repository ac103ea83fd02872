"""Slow readers and idle streams: merged outputs, the stall timeout, SSE pings, disconnects.

A client that stops reading parks its handler in a socket send; the engine keeps one
pending output per choice for it (later ones merged in), aborts it after
``stall_timeout`` and frees its pages, and other streams do not slow down.
"""

from __future__ import annotations

import json
import socket
import statistics

import httpx
import pytest
import trio

from trillm.engine.mailbox import OutputMailbox
from trillm.engine.outputs import RequestOutput
from trillm.engine.sampling_params import SamplingParams

from tests.helpers import make_engine, wait_idle
from tests.server import MODEL, QUESTION, client, in_thread, running_server

# These tests time things; on 2 cores shared with other work, one torch thread keeps a step
# near its quiet-machine time where two threads contending with others can be 10-20x slower.
ONE_THREAD = {"num_threads": 1}


def _out(index: int, text: str, token: int, finish: str | None = None, n: int = 1) -> RequestOutput:
    return RequestOutput("r", index, text, (token,), finish, 3, n, (), 0, ((-1.0, 1, ()),) if n == 1 else None)


# -- the mailbox alone ---------------------------------------------------------------------


async def test_the_mailbox_merges_what_its_consumer_has_not_taken():
    box = OutputMailbox()
    box.add_sender()
    box.add_sender()
    for i, word in enumerate(["Hel", "lo", " there"]):
        assert box.put(_out(0, word, 10 + i, n=i + 1))
    assert box.put(_out(1, "A", 7))
    assert box.put(_out(0, "!", 13, "stop", n=4))
    assert box.num_pending == 2 and box.pending_tokens == 5 and box.num_merged == 3
    first = await box.receive()
    assert (first.index, first.text, first.token_ids) == (0, "Hello there!", (10, 11, 12, 13))
    assert (first.finish_reason, first.num_output_tokens) == ("stop", 4)
    assert first.prompt_logprobs == ((-1.0, 1, ()),)  # the first output's, kept
    assert (await box.receive()).text == "A"
    box.end()
    box.end()
    with pytest.raises(trio.EndOfChannel):
        await box.receive()


async def test_a_cancelled_receive_loses_nothing_and_a_closed_mailbox_refuses_puts():
    box = OutputMailbox()
    box.add_sender()
    with trio.move_on_after(0.05) as scope:
        await box.receive()
    assert scope.cancelled_caught
    async with trio.open_nursery() as nursery:
        got: list[RequestOutput] = []

        async def take() -> None:
            got.append(await box.receive())

        nursery.start_soon(take)
        await trio.sleep(0.01)
        box.put(_out(0, "x", 1))  # wakes the waiting consumer
    assert [o.text for o in got] == ["x"]
    box.put(_out(0, "y", 2), now=0.0)
    assert box.waiting_for(5.0) == 5.0
    box.close()
    assert not box.put(_out(0, "z", 3)) and box.num_pending == 0
    with pytest.raises(trio.ClosedResourceError):
        box.receive_nowait()


# -- the engine: one pending output, whatever the consumer does -------------------------------


async def test_a_consumer_that_lags_gets_the_same_tokens_and_text_in_fewer_outputs(model_parts, tokenizer, nursery):
    # one token a step (no speculation), so that every output merged is one step's
    engine = make_engine(model_parts, speculative="off", **ONE_THREAD)
    await nursery.start(engine.run)
    ids = tokenizer("Write a long story about a lighthouse keeper.")["input_ids"]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    fast: list[RequestOutput] = []
    async with engine.generate(ids, params) as outputs:
        async for out in outputs:
            fast.append(out)
    assert len(fast) == 60

    _, outputs = engine.submit(ids, params)
    slow: list[RequestOutput] = []
    most_pending = 0
    with outputs:
        while engine.stats().generation_tokens_total < 2 * 60 - 10:  # it generates; nobody reads
            most_pending = max(most_pending, outputs.num_pending)
            await trio.sleep(0.01)
        async for out in outputs:
            slow.append(out)
    assert most_pending == 1 and len(slow) < 15
    assert [t for o in slow for t in o.token_ids] == [t for o in fast for t in o.token_ids]
    assert "".join(o.text for o in slow) == "".join(o.text for o in fast)
    assert slow[-1].finish_reason == "length" and slow[-1].num_output_tokens == 60
    assert engine.stats().num_merged_outputs == sum(len(o.token_ids) - 1 for o in slow)
    await wait_idle(engine)


async def test_a_consumer_that_takes_nothing_is_aborted_after_the_stall_timeout(model_parts, tokenizer, nursery):
    eng = make_engine(model_parts, stall_timeout=0.5, **ONE_THREAD)
    await nursery.start(eng.run)
    ids = tokenizer("Tell me everything about the sea.")["input_ids"]
    _, outputs = eng.submit(ids, SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
    with outputs:
        with trio.fail_after(10):
            while eng.stats().num_stalled == 0:
                assert outputs.num_pending <= 1
                await trio.sleep(0.02)
        await wait_idle(eng)  # its pages are free
        last = [o async for o in outputs]
    stats = eng.stats()
    assert stats.num_aborted == 1 and stats.generation_tokens_total < 2000
    assert len(last) == 1 and last[0].finish_reason == "abort"  # all it missed, and the end, in one output
    assert len(last[0].token_ids) == last[0].num_output_tokens


# -- over HTTP ----------------------------------------------------------------------------

LONG = {"model": MODEL, "messages": QUESTION, "ignore_eos": True, "temperature": 0}


def _raw_request(port: int, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """A POST sent over a plain socket that the test then reads, or never reads, or closes."""
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting, so the window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


# Each event carries 20 alternatives per token (~2.5 kB), so a socket fills within a few tokens.
NEIGHBOUR = {**LONG, "max_tokens": 2000, "stream": True, "logprobs": True, "top_logprobs": 20}


async def _token_gaps(http: httpx.AsyncClient, max_tokens: int) -> list[float]:
    """Seconds between consecutive content chunks of one stream read as fast as it comes."""
    times = []
    body = {**LONG, "max_tokens": max_tokens, "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                times.append(trio.current_time())
    return [b - a for a, b in zip(times, times[1:])]


async def _gaps_of_two_streams(http: httpx.AsyncClient, max_tokens: int) -> list[float]:
    gaps: list[float] = []

    async def one() -> None:
        gaps.extend(await _token_gaps(http, max_tokens))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
    return gaps


async def test_a_client_that_reads_nothing_is_held_in_one_output_slows_no_one_and_is_aborted(model_parts):
    async with running_server(model_parts, send_buffer=4096, stall_timeout=5.0, **ONE_THREAD) as server:
        engine = server.engine
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            # Baseline: the same load beside a neighbour that reads everything as it comes.
            async with trio.open_nursery() as nursery:

                async def read_all() -> None:
                    async with http.stream("POST", "/v1/chat/completions", json=NEIGHBOUR) as response:
                        async for _ in response.aiter_bytes():
                            pass

                nursery.start_soon(read_all)
                while engine.stats().generation_tokens_total == 0:
                    await trio.sleep(0.01)
                baseline = await _gaps_of_two_streams(http, 20)
                nursery.cancel_scope.cancel()  # the neighbour leaves: aborted
            await wait_idle(engine)
            assert engine.stats().num_merged_outputs == 0  # nobody lagged

            # A neighbour that reads nothing: a small receive window and never a recv.
            sock = _raw_request(server.port, NEIGHBOUR, rcvbuf=4096)
            try:
                with trio.fail_after(60):  # its socket fills within a few tokens; then its outputs merge
                    while engine.stats().num_merged_outputs == 0:
                        await trio.sleep(0.01)
                (slow,) = engine.router.live.values()
                pending: list[tuple[int, int]] = []  # (outputs, tokens) waiting for it

                async def watch() -> None:
                    while slow.seq.request_id in engine.router.live:
                        pending.append((slow.mailbox.num_pending, slow.mailbox.pending_tokens))
                        await trio.sleep(0.01)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch)
                    beside_slow = await _gaps_of_two_streams(http, 20)
                    with trio.fail_after(60):  # then the stall timeout aborts it
                        while engine.stats().num_stalled == 0:
                            await trio.sleep(0.05)
                await wait_idle(engine)  # its pages are free
            finally:
                sock.close()
    stats = engine.stats()
    assert stats.num_stalled == 1 and stats.num_aborted == 2  # and the first neighbour, cut by the test
    assert max(outputs for outputs, _ in pending) == 1  # one pending output, however long it lags
    assert max(tokens for _, tokens in pending) >= 10 and stats.num_merged_outputs >= 9
    # Its neighbours' inter-token latency is what it was beside a fast reader (2 shared cores: loose).
    base, beside = statistics.median(baseline), statistics.median(beside_slow)
    assert beside < 1.5 * base + 0.02, (base, beside)


async def test_queued_streams_get_pings_that_the_openai_client_ignores(model_parts):
    from trillm.api.settings import ServerConfig

    settings = ServerConfig(sse_ping_interval=0.1)
    async with running_server(model_parts, server=settings, max_num_seqs=1, **ONE_THREAD) as server:
        oai = client(server)
        lines: list[str] = []
        chunks: list = []

        async def raw() -> None:
            async with http.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 3}) as queued:
                lines.extend([line async for line in queued.aiter_lines() if line])

        async def sdk() -> None:
            stream = await in_thread(
                oai.chat.completions.create,
                model=MODEL,
                messages=QUESTION,
                max_tokens=3,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks.extend(await in_thread(list, stream))

        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            body = {**LONG, "max_tokens": 40, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as ahead:
                rest = ahead.aiter_lines()
                await rest.__anext__()  # submitted: with one running sequence, the next ones wait
                started = trio.current_time()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(raw)
                    nursery.start_soon(sdk)
                    assert sum(['"finish_reason":"length"' in line async for line in rest]) == 1
                waited = trio.current_time() - started
        await wait_idle(server.engine)
    first_data = next(i for i, line in enumerate(lines) if i > 0 and line.startswith("data: "))
    assert lines[0].startswith("data: {")  # the opening chunk goes out at once
    assert lines[1:first_data] == [": ping"] * (first_data - 1) and first_data >= 3, lines
    assert lines[-1] == "data: [DONE]"
    assert waited > 0.3  # the SDK's request sat in the queue through pings too
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def test_a_non_streaming_request_stops_within_a_step_when_its_client_leaves(model_parts):
    async with running_server(model_parts, **ONE_THREAD) as server:
        engine = server.engine
        sock = _raw_request(server.port, {**LONG, "max_tokens": 2000})
        with trio.fail_after(30):
            while engine.stats().generation_tokens_total < 20:
                await trio.sleep(0.01)
        sock.close()
        closed_at, generated = trio.current_time(), engine.stats().generation_tokens_total
        await wait_idle(engine, timeout=5)
        took = trio.current_time() - closed_at
        stats = engine.stats()
        async with httpx.AsyncClient(base_url=server.url) as http:
            metrics = (await http.get("/metrics")).text
    assert stats.num_aborted == 1 and stats.generation_tokens_total - generated <= 3, stats
    assert took < 1.0
    assert 'trillm:num_requests_aborted_total{model_name="smollm2-135m-instruct"} 1.0' in metrics
