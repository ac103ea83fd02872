"""Who may use the server: API keys on every route, per-key concurrency, CORS; keys never logged."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
import trio

from trillm.api import auth
from trillm.api.errors import ApiError
from trillm.api.settings import ServerConfig, server_config_from_env
from trillm.engine.settings import from_env

from tests.helpers import wait_idle
from tests.server import MODEL, QUESTION, in_thread, running_server

KEYS = ("sk-right-one-8f3a", "sk-right-two-51c9")
WRONG = "sk-wrong-key-77d0"
CHAT = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
LONG = {"model": MODEL, "messages": QUESTION, "max_tokens": 3000, "ignore_eos": True, "stream": True}

# Every route and a body it accepts; with the right key each answers this status.
CLOSED = [
    ("POST", "/v1/chat/completions", CHAT, 200),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}, 200),
    ("POST", "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 2}, 200),
    ("GET", "/v1/models", None, 200),
    ("GET", f"/v1/models/{MODEL}", None, 200),
    ("POST", "/tokenize", {"prompt": "Hi"}, 200),
    ("POST", "/detokenize", {"tokens": [1, 2]}, 200),
    ("GET", "/tokenizer_info", None, 200),
    ("POST", "/flush_cache", None, 200),
    ("GET", "/metrics", None, 200),  # with --metrics-require-key
    ("POST", "/v1/embeddings", {"model": MODEL, "input": "Hi"}, 200),
    ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}, 200),
    ("POST", "/models/unload", {"model": MODEL}, 400),  # the admin routes: the primary is never unloaded
    ("POST", "/models/load", {"model": MODEL}, 200),
    ("POST", "/v1/audio/speech", {}, 404),  # unknown /v1 paths are closed too: a 404 only with a key
]
OPEN = ["/health", "/version", "/openapi.json"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- keys, without a server ----------------------------------------------------------------


def test_every_key_is_compared_in_constant_time_whichever_matches(monkeypatch):
    keys = auth.ApiKeys(tuple(auth._digest(k) for k in ("a", "bb", "ccc")))
    compared: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def counting(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for presented, index in (("a", 0), ("ccc", 2), ("nope", None)):
        compared.clear()
        if index is None:
            with pytest.raises(ApiError) as exc:
                keys.check(f"Bearer {presented}")
            assert exc.value.status == 401 and exc.value.code == "invalid_api_key"
        else:
            assert keys.check(f"bearer  {presented} ") == index
        assert len(compared) == 3  # no early exit on a match
        assert {len(a) for pair in compared for a in pair} == {32}  # digests: no key's length shows
    for header in (None, "", "Bearer", "Bearer   ", "Basic YTpi", "a"):
        with pytest.raises(ApiError) as exc:
            keys.check(header)
        assert exc.value.headers == {"WWW-Authenticate": "Bearer"}


def test_keys_come_from_flags_variable_and_file_and_never_show(tmp_path, capsys):
    from trillm.api.cli import _serve_parser
    from trillm.engine.settings import overrides_from

    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nsk-file-1\n\n  sk-file-2  # the batch job\n")
    parser = __import__("argparse").ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--api-key", "sk-flag-1", "--api-key", "sk-flag-2,sk-flag-3"])
    server = server_config_from_env(
        {"TRILLM_API_KEY": "sk-env", "TRILLM_API_KEYS_FILE": str(keys_file)}, **overrides_from(args, ServerConfig)
    )
    assert server.api_key == ("sk-flag-1", "sk-flag-2", "sk-flag-3")  # the flags win over the variable
    keys = auth.load_keys(server)
    for key in ("sk-flag-1", "sk-flag-3", "sk-file-1", "sk-file-2"):
        keys.check(f"Bearer {key}")
    with pytest.raises(ApiError):
        keys.check("Bearer sk-env")
    assert from_env(ServerConfig, {"TRILLM_API_KEY": "sk-a, sk-b"}).api_key == ("sk-a", "sk-b")
    assert "sk-" not in repr(server) + repr(keys)

    (tmp_path / "empty").write_text("# nothing yet\n")
    for path in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(SystemExit, match="keys file") as exc:
            auth.load_keys(ServerConfig(api_key=("sk-secret",), api_keys_file=str(path)))
        assert "sk-secret" not in str(exc.value)


def test_an_open_server_on_a_public_address_warns_at_start(caplog):
    caplog.set_level(logging.WARNING, logger="trillm.api")
    auth.warn_if_open(auth.load_keys(ServerConfig(host="0.0.0.0")), ServerConfig(host="0.0.0.0"))
    assert "no API key" in caplog.text
    caplog.clear()
    for server in (ServerConfig(host="127.0.0.1"), ServerConfig(host="::1"), ServerConfig(host="localhost")):
        auth.warn_if_open(auth.load_keys(server), server)
    keyed = ServerConfig(host="0.0.0.0", api_key=("k",))
    auth.warn_if_open(auth.load_keys(keyed), keyed)
    assert not caplog.records


# -- keys, through a real server -------------------------------------------------------------


async def test_every_route_needs_a_right_key_and_keys_are_never_logged(model_parts, caplog):
    caplog.set_level(logging.DEBUG)
    settings = ServerConfig(api_key=KEYS, metrics_require_key=True)
    async with running_server(model_parts, server=settings) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            for method, path, body, status in CLOSED:
                for headers in ({}, bearer(WRONG), {"Authorization": KEYS[0]}, {"Authorization": f"Basic {KEYS[0]}"}):
                    r = await http.request(method, path, json=body, headers=headers)
                    assert r.status_code == 401, (method, path, headers)
                    assert r.headers["www-authenticate"] == "Bearer"
                    error = r.json()["error"]
                    if path.startswith("/v1/messages"):  # Anthropic's shape there
                        assert r.json()["type"] == "error" and error["type"] == "authentication_error"
                    else:
                        assert (error["type"], error["param"], error["code"]) == (
                            "invalid_request_error",
                            None,
                            "invalid_api_key",
                        )
                    assert WRONG not in r.text and KEYS[0] not in r.text
                for key in KEYS:
                    r = await http.request(method, path, json=body, headers=bearer(key))
                    assert r.status_code == status, (method, path, r.text)
            for path in OPEN:
                assert (await http.get(path)).status_code == 200
            # regression: two Authorization headers were decided by the first, so a proxy appending its own
            # let the client's win; now refused, whichever order and whether or not either is right
            for pair in ((KEYS[0], WRONG), (WRONG, KEYS[0]), (KEYS[0], KEYS[1])):
                headers = [("Authorization", f"Bearer {key}") for key in pair]
                r = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
                assert r.status_code == 401 and "2 Authorization headers" in r.json()["error"]["message"]
                assert r.json()["error"]["code"] == "invalid_api_key"

        wrong = openai.OpenAI(base_url=server.base_url, api_key=WRONG, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as exc:
            await in_thread(wrong.chat.completions.create, **CHAT)
        assert exc.value.body["code"] == "invalid_api_key"
        right = openai.OpenAI(base_url=server.base_url, api_key=KEYS[1], max_retries=0)
        reply = await in_thread(right.chat.completions.create, **CHAT)
        assert reply.choices[0].message.content
        assert [m.id for m in (await in_thread(right.models.list)).data] == [MODEL]
    logged = "\n".join(f"{r.name} {r.getMessage()} {r.args!r}" for r in caplog.records)
    assert "engine requests req-" in logged  # the capture saw the server's own lines
    for secret in (*KEYS, WRONG):
        assert secret not in logged


async def _exchange(port: int, head: bytes, body: bytes | None = None) -> list[bytes]:
    """Send ``head``; read until a final response's headers, sending ``body`` once a 100 arrives.
    Returns every status line received, in order."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(head)
        data, statuses = b"", []
        with trio.fail_after(30):
            while True:
                data += await stream.receive_some()
                while b"\r\n\r\n" in data:
                    response, data = data.split(b"\r\n\r\n", 1)
                    statuses.append(response.split(b"\r\n", 1)[0])
                    if b" 100 " not in statuses[-1] + b" ":
                        return statuses
                    assert body is not None, statuses
                    await stream.send_all(body)


async def test_regression_expect_100_continue_is_answered_after_the_key_is_checked(model_parts):
    """``Expect: 100-continue`` got ``100 Continue`` before its 401: the client was told to upload
    a body only to have it refused."""
    async with running_server(model_parts, server=ServerConfig(api_key=KEYS)) as server:
        body = json.dumps(CHAT).encode()
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n" % len(body)
        )
        refused = await _exchange(server.port, head + b"\r\n")
        assert refused == [b"HTTP/1.1 401 "]
        admitted = await _exchange(server.port, head + f"Authorization: Bearer {KEYS[0]}\r\n\r\n".encode(), body)
        assert admitted == [b"HTTP/1.1 100 ", b"HTTP/1.1 200 "]


# -- per-key concurrency ---------------------------------------------------------------------


async def _next_event(lines) -> str:
    while not (line := await lines.__anext__()):
        pass
    return line


async def _until_admitted(http: httpx.AsyncClient, key: str) -> httpx.Response:
    """The count is given back when the exchange ends; poll briefly until a request is admitted."""
    for _ in range(100):
        r = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
        if r.status_code != 429:
            return r
        await trio.sleep(0.05)
    raise AssertionError("the key's slot never came back")


async def test_one_key_gets_429_past_its_limit_and_cancelled_streams_give_their_slot_back(model_parts):
    settings = ServerConfig(api_key=KEYS, max_concurrent_per_key=1)
    async with running_server(model_parts, server=settings) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async with http.stream("POST", "/v1/chat/completions", json=LONG, headers=bearer(KEYS[0])) as first:
                assert first.status_code == 200
                lines = first.aiter_lines()  # kept: an abandoned iterator would close the stream when collected
                await lines.__anext__()  # streaming: the slot is held while it runs
                for body in (LONG, CHAT):
                    r = await http.post("/v1/chat/completions", json=body, headers=bearer(KEYS[0]))
                    assert r.status_code == 429 and r.headers["retry-after"] == "1"
                    assert r.json()["error"] == {
                        "message": r.json()["error"]["message"],
                        "type": "requests",
                        "param": None,
                        "code": "rate_limit_exceeded",
                    }
                limited = openai.OpenAI(base_url=server.base_url, api_key=KEYS[0], max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    await in_thread(limited.chat.completions.create, **CHAT)
                other = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(KEYS[1]))
                assert other.status_code == 200  # another key is not held back
                r = await http.post("/tokenize", json={"prompt": "Hi"}, headers=bearer(KEYS[0]))
                assert r.status_code == 200  # only generation requests count
                assert (await _next_event(lines)).startswith("data: {")  # the first stream still runs, and holds:
                r = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(KEYS[0]))
                assert r.status_code == 429
            # the stream was cancelled by closing it: its slot comes back
            assert (await _until_admitted(http, KEYS[0])).status_code == 200

            for _ in range(5):  # cancelled mid-stream, again and again: no slot leaks
                async with http.stream(
                    "POST", "/v1/completions", json={**LONG, "prompt": "Hi"}, headers=bearer(KEYS[0])
                ) as s:
                    assert s.status_code == 200
                    await s.aiter_lines().__anext__()
                assert (await _until_admitted(http, KEYS[0])).status_code == 200

            with trio.move_on_after(0.5):  # a non-streaming client that gives up
                await http.post("/v1/chat/completions", json={**LONG, "stream": False}, headers=bearer(KEYS[0]))
            assert (await _until_admitted(http, KEYS[0])).status_code == 200
        await wait_idle(server.engine)


# -- CORS --------------------------------------------------------------------------------------


async def test_cors_preflight_is_answered_without_a_key_or_the_engine(model_parts):
    origin = "https://app.example"
    settings = ServerConfig(api_key=KEYS, allowed_origins=(origin,))
    async with running_server(model_parts, server=settings) as server:
        before = server.engine.stats()
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            preflight = {
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            }
            r = await http.options("/v1/chat/completions", headers=preflight)
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
            assert {"authorization", "content-type"} <= set(
                h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")
            )
            assert "POST" in r.headers["access-control-allow-methods"]
            r = await http.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
            assert "access-control-allow-origin" not in r.headers

            r = await http.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin, **bearer(KEYS[0])})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
            assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
            r = await http.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin  # readable by the page
        after = server.engine.stats()
        # only the one authorised request reached the engine
        assert after.prompt_tokens_total - before.prompt_tokens_total == prompt_tokens


async def test_no_cors_headers_unless_origins_are_set(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        r = await http.options(
            "/v1/chat/completions", headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        )
        assert "access-control-allow-origin" not in r.headers
        r = await http.get("/v1/models", headers={"Origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert json.loads(r.text)["data"][0]["id"] == MODEL
