"""Several models behind one endpoint (``--model`` again, ``--models-dir``): each request served by
the model it names, loaded on first use; ``--max-loaded-models`` evicting the least recently used
idle one, ``--models-memory`` weighing each loaded model's weights and KV pool, ``--model-ttl``
unloading idle ones, ``--pin`` keeping one; the admin routes; ``/metrics`` labelled by model; the
command line's ``--model NAME=PATH``."""

from __future__ import annotations

from functools import partial

import httpx
import pytest
import torch
import trio
from transformers import Qwen3ForCausalLM

from trillm.api.cli import several_models
from trillm.api.model_memory import GiB, files_bytes
from trillm.api.model_set import model_specs
from trillm.api.settings import ServerConfig

from tests.families import TINY_QWEN3, hf_greedy, tiny_qwen3
from tests.server import MODEL, client, in_thread, running_server


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, model_dir):
    """Two tiny random models in one folder, as ``--models-dir`` reads it."""
    root = tmp_path_factory.mktemp("models")
    for seed, name in ((1, "tiny-a"), (2, "tiny-b")):
        tiny_qwen3(root / name, model_dir, seed)
    (root / "notes.txt").write_text("not a model")
    return root


def _cards(url: str) -> dict[str, dict]:
    return {card["id"]: card for card in httpx.get(url + "/v1/models").json()["data"]}


async def _cards_async(http: httpx.AsyncClient) -> dict[str, dict]:
    return {card["id"]: card for card in (await http.get("/v1/models")).json()["data"]}


@pytest.mark.e2e
async def test_two_models_side_by_side_each_request_by_its_model(model_parts, models_dir, tokenizer):
    hf = Qwen3ForCausalLM.from_pretrained(models_dir / "tiny-a", dtype=torch.float32).eval()
    settings = ServerConfig(extra_model=(f"tiny={models_dir / 'tiny-a'}",))
    async with running_server(model_parts, server=settings) as srv:

        def run():
            c = client(srv)
            before = _cards(srv.url)
            tiny = c.completions.create(
                model="tiny",
                prompt="The capital of France is",
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            main = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
            vectors = c.embeddings.create(model="tiny", input="hello", encoding_format="float")
            after = _cards(srv.url)
            metrics = httpx.get(srv.url + "/metrics").text
            missing = httpx.post(
                srv.base_url + "/chat/completions",
                json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            )
            return before, tiny, main, vectors, after, metrics, missing

        before, tiny, main, vectors, after, metrics, missing = await in_thread(run)
    assert set(before) == {MODEL, "tiny"} and before[MODEL]["loaded"] and not before["tiny"]["loaded"]
    ids = tokenizer("The capital of France is")["input_ids"]
    assert tiny.model == "tiny" and tiny.choices[0].text == tokenizer.decode(hf_greedy(hf, ids, 8))
    assert main.model == MODEL and main.choices[0].message.content
    assert vectors.model == "tiny" and len(vectors.data[0].embedding) == TINY_QWEN3["hidden_size"]
    assert after["tiny"]["loaded"] and after["tiny"]["max_model_len"] == TINY_QWEN3["max_position_embeddings"]
    for name in (MODEL, "tiny"):
        assert f'trillm:num_requests_running{{model_name="{name}"}}' in metrics
        assert f'trillm:request_success_total{{finished_reason="length",model_name="{name}"}}' in metrics
    assert missing.status_code == 404 and "`tiny`" in missing.json()["error"]["message"]


@pytest.mark.e2e
async def test_eviction_ttl_pin_and_the_admin_routes(model_parts, models_dir):
    settings = ServerConfig(models_dir=str(models_dir), max_loaded_models=2, pin=("tiny-b",))
    ask = {"prompt": "Hello", "max_tokens": 2}
    async with running_server(model_parts, server=settings) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            assert set(await _cards_async(http)) == {MODEL, "tiny-a", "tiny-b"}
            assert (await http.post("/v1/completions", json={"model": "tiny-a", **ask})).status_code == 200
            loaded = {k for k, v in (await _cards_async(http)).items() if v["loaded"]}
            assert loaded == {MODEL, "tiny-a"}
            # one more than --max-loaded-models: the least recently used idle one goes
            assert (await http.post("/v1/completions", json={"model": "tiny-b", **ask})).status_code == 200
            assert {k for k, v in (await _cards_async(http)).items() if v["loaded"]} == {MODEL, "tiny-b"}
            # the admin routes
            unloaded = await http.post("/models/unload", json={"model": "tiny-b"})
            assert unloaded.status_code == 200 and unloaded.json()["loaded"] is False
            loaded_now = await http.post("/models/load", json={"model": "tiny-a"})
            assert loaded_now.status_code == 200 and loaded_now.json()["loaded"] is True
            primary = await http.post("/models/unload", json={"model": MODEL})
            assert primary.status_code == 400 and primary.json()["error"]["param"] == "model"
            assert (await http.post("/models/load", json={"model": "nope"})).status_code == 404
            # a pinned model is never evicted: with it loaded there is no room for tiny-a
            await http.post("/models/unload", json={"model": "tiny-a"})
            assert (await http.post("/models/load", json={"model": "tiny-b"})).json()["loaded"]
            assert (await http.post("/models/load", json={"model": "tiny-a"})).status_code == 503  # none idle to evict
            srv_cards = await _cards_async(http)
            assert srv_cards["tiny-b"]["loaded"] and not srv_cards["tiny-a"]["loaded"]
    # --model-ttl: idle tiny-a goes within seconds; pinned tiny-b stays
    settings = ServerConfig(models_dir=str(models_dir), model_ttl=1.0, pin=("tiny-b",))
    async with running_server(model_parts, server=settings) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            for name in ("tiny-a", "tiny-b"):
                assert (await http.post("/models/load", json={"model": name})).json()["loaded"]
            with trio.fail_after(15):
                while (await _cards_async(http))["tiny-a"]["loaded"]:
                    await trio.sleep(0.25)
            assert (await _cards_async(http))["tiny-b"]["loaded"]  # pinned


@pytest.mark.e2e
async def test_the_memory_budget_evicts_the_least_recent_and_refuses_what_cannot_fit(model_parts, models_dir):
    ask = {"prompt": "Hello", "max_tokens": 2}

    async def loaded(http: httpx.AsyncClient) -> set[str]:
        return {k for k, v in (await _cards_async(http)).items() if v["loaded"]}

    # measured: each loaded model's weights and KV pool
    async with running_server(model_parts, server=ServerConfig(models_dir=str(models_dir), models_memory=0)) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            assert (await http.post("/models/load", json={"model": "tiny-a"})).json()["loaded"]
            cards = await _cards_async(http)
    primary, tiny = cards[MODEL]["memory_bytes"], cards["tiny-a"]["memory_bytes"]
    weights = files_bytes(str(models_dir / "tiny-a"))  # float32 safetensors: what its weights take loaded
    assert weights < tiny < weights + 64 * 2**20 and primary > 64 * 2**20

    # room for the primary and one tiny model: the next evicts the least recently used idle one
    budget = (primary + 1.5 * tiny) / GiB
    async with running_server(
        model_parts, server=ServerConfig(models_dir=str(models_dir), models_memory=budget)
    ) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            assert (await http.post("/v1/completions", json={"model": "tiny-a", **ask})).status_code == 200
            assert await loaded(http) == {MODEL, "tiny-a"}
            assert (await http.post("/v1/completions", json={"model": "tiny-b", **ask})).status_code == 200
            assert await loaded(http) == {MODEL, "tiny-b"}
            # tiny-b busy (a long stream open): tiny-a cannot take its place, and says why
            async with http.stream(
                "POST", "/v1/completions", json={"model": "tiny-b", **ask, "max_tokens": 400, "stream": True}
            ) as stream:
                await stream.aiter_lines().__anext__()
                busy = await http.post("/v1/completions", json={"model": "tiny-a", **ask})
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "models_busy"
            assert "--models-memory" in busy.json()["error"]["message"] and busy.headers["retry-after"] == "1"

    # room for the files' size (the guess before a first load) but not for the KV pool beside it:
    # measured once loaded, tiny-a goes again, and the request says it can never fit
    budget = (primary + (weights + tiny) / 2) / GiB
    async with running_server(
        model_parts, server=ServerConfig(models_dir=str(models_dir), models_memory=budget)
    ) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            refused = await http.post("/v1/completions", json={"model": "tiny-a", **ask})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_does_not_fit"
            assert await loaded(http) == {MODEL}
            again = await http.post("/models/load", json={"model": "tiny-a"})  # now known: refused before loading
            assert again.status_code == 503 and again.json()["error"]["code"] == "model_does_not_fit"
            assert (await http.post("/v1/completions", json={"model": MODEL, **ask})).status_code == 200


@pytest.mark.e2e
async def test_keys_priority_cancellation_and_drain_span_the_models(model_parts, models_dir):
    """A key's limit counts its requests to every model; a second model's scheduler honours
    priority; a cut stream frees that model's pages; a drain refuses every model's requests."""
    settings = ServerConfig(
        extra_model=(f"tiny={models_dir / 'tiny-a'}",), api_key=("k1", "k2", "k3"), max_concurrent_per_key=1
    )
    long = {"prompt": "Once", "max_tokens": 48, "ignore_eos": True}
    async with running_server(model_parts, server=settings, scheduling_policy="priority", max_num_seqs=1) as srv:
        state = srv.app.extensions["trillm"]
        k1, k2, k3 = ({"Authorization": f"Bearer {k}"} for k in ("k1", "k2", "k3"))
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            assert (await http.post("/models/load", json={"model": "tiny"}, headers=k1)).json()["loaded"]
            tiny = state.models.entries["tiny"].served.engine
            assert tiny.config.scheduling_policy == "priority" and tiny.config.max_num_seqs == 1
            # k1 streams from tiny: its one slot is taken for the primary too; k2's is its own
            async with http.stream(
                "POST", "/v1/completions", json={"model": "tiny", **long, "stream": True}, headers=k1
            ) as stream:
                await stream.aiter_lines().__anext__()
                limited = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"}, headers=k1)
                other = await http.post(
                    "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers=k2
                )
            assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
            assert other.status_code == 200
            with trio.fail_after(30):  # the cut stream's request ends and its pages come back
                while (stats := tiny.stats()).num_open_requests or stats.free_pages + stats.evictable_pages < (
                    stats.total_pages
                ):
                    await trio.sleep(0.05)
            assert tiny.stats().num_aborted >= 1

            # one sequence at a time on tiny: of two waiting, the more urgent (lower) priority goes first
            finished: list[str] = []

            async def complete(name: str, priority: int, key: dict[str, str]) -> None:
                body = {"model": "tiny", **long, "priority": priority}
                reply = await http.post("/v1/completions", json=body, headers=key)
                assert reply.status_code == 200, reply.text
                finished.append(name)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(complete, "first", 5, k1)
                while tiny.stats().num_running == 0:
                    await trio.sleep(0.01)
                nursery.start_soon(complete, "later", 5, k2)
                while tiny.stats().num_waiting == 0:
                    await trio.sleep(0.01)
                nursery.start_soon(complete, "urgent", 0, k3)
            assert finished.index("urgent") < finished.index("later"), finished
            assert tiny.stats().num_preemptions >= 1  # it displaced the running one it outranks

            # drain: every model's requests are refused (once the slots of those answered are given back)
            with trio.fail_after(10):
                while srv.app.extensions["trillm_limiter"].total():
                    await trio.sleep(0.01)
            state.drain.begin()
            for name in ("tiny", MODEL):
                refused = await http.post("/v1/completions", json={"model": name, "prompt": "Hi"}, headers=k2)
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_draining", refused.text


@pytest.mark.e2e
async def test_parked_models_wake_with_their_weights_and_the_parked_are_bounded(model_parts, models_dir):
    """``--park-models``: an evicted model keeps its weights (the same tensors, not read again) and
    frees its KV pool; woken, it answers as before; the least recently parked goes beyond the bound."""
    settings = ServerConfig(
        models_dir=str(models_dir),
        extra_model=(f"tiny-c={models_dir / 'tiny-a'}",),
        max_loaded_models=2,
        park_models=1,
        models_memory=0,
    )
    ask = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def state_of(http: httpx.AsyncClient) -> dict[str, tuple[bool, bool]]:
        return {k: (v["loaded"], v["parked"]) for k, v in (await _cards_async(http)).items()}

    async with running_server(model_parts, server=settings) as srv:
        models = srv.app.extensions["trillm"].models
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            first = (await http.post("/v1/completions", json={"model": "tiny-a", **ask})).json()
            weights = models.entries["tiny-a"].served.engine.model
            assert (await http.post("/v1/completions", json={"model": "tiny-b", **ask})).status_code == 200
            assert (await state_of(http))["tiny-a"] == (False, True)  # evicted, parked
            again = (await http.post("/v1/completions", json={"model": "tiny-a", **ask})).json()
            woken = models.entries["tiny-a"].served.engine
            assert woken.model is weights and again["choices"][0]["text"] == first["choices"][0]["text"]
            stats = woken.stats()
            assert stats.free_pages + stats.evictable_pages == stats.total_pages
            assert await state_of(http) == {
                MODEL: (True, False),
                "tiny-a": (True, False),
                "tiny-b": (False, True),
                "tiny-c": (False, False),
            }
            # tiny-c evicts tiny-a, parked in its turn: one parked at most, so tiny-b's weights go
            assert (await http.post("/v1/completions", json={"model": "tiny-c", **ask})).status_code == 200
            assert (await state_of(http))["tiny-a"] == (False, True) and (await state_of(http))["tiny-b"] == (
                False,
                False,
            )
            # an unload while the model loads waits for the load, then undoes it
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(http.post, "/models/load", json={"model": "tiny-b"}))
                while models.entries["tiny-b"].loading is None:
                    await trio.sleep(0.001)
                undone = await http.post("/models/unload", json={"model": "tiny-b", "park": False})
            assert undone.json()["loaded"] is False and (await state_of(http))["tiny-b"] == (False, False)
            # the admin route can let the weights go too; a bad `park` is a 400
            gone = await http.post("/models/unload", json={"model": "tiny-c", "park": False})
            assert gone.json()["loaded"] is False and gone.json()["parked"] is False
            bad = await http.post("/models/unload", json={"model": "tiny-c", "park": "yes"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "park"


@pytest.mark.e2e
async def test_parked_weights_on_a_cpu_count_toward_the_budget_and_go_first(model_parts, models_dir):
    ask = {"prompt": "Hello", "max_tokens": 2}
    async with running_server(model_parts, server=ServerConfig(models_dir=str(models_dir), models_memory=0)) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            assert (await http.post("/models/load", json={"model": "tiny-a"})).json()["loaded"]
            cards = await _cards_async(http)
    primary, tiny = cards[MODEL]["memory_bytes"], cards["tiny-a"]["memory_bytes"]
    # tiny-b evicts tiny-a (one loaded at most), which is parked; whether its weights may stay parked
    # beside tiny-b depends on the budget: the parked go before any running model
    for room, stays_parked in ((1.5, False), (2.5, True)):
        settings = ServerConfig(
            models_dir=str(models_dir),
            max_loaded_models=2,
            park_models=2,
            models_memory=(primary + room * tiny) / GiB,
        )
        async with running_server(model_parts, server=settings) as srv:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                for name in ("tiny-a", "tiny-b"):
                    assert (await http.post("/v1/completions", json={"model": name, **ask})).status_code == 200
                cards = await _cards_async(http)
        assert cards["tiny-b"]["loaded"] and not cards["tiny-a"]["loaded"]
        assert cards["tiny-a"]["parked"] is stays_parked, room


def test_the_command_line_names_several_models(models_dir):
    argv = ["serve", "--model", "chat=/models/a", "--model=b=/models/b", "--model", "/models/c", "--port", "1"]
    assert several_models(argv) == [
        "serve",
        "--model",
        "/models/a",
        "--served-model-name",
        "chat",
        "--extra-model",
        "b=/models/b",
        "--extra-model",
        "/models/c",
        "--port",
        "1",
    ]
    specs = model_specs(ServerConfig(extra_model=("x=/p/x", "/p/y"), models_dir=str(models_dir)))
    assert specs == {
        "x": "/p/x",
        "/p/y": "/p/y",
        "tiny-a": str(models_dir / "tiny-a"),
        "tiny-b": str(models_dir / "tiny-b"),
    }
