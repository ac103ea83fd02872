"""``POST /v1/embeddings``: pooled last hidden states equal transformers' (mean, CLS, last token;
whole and chunked prefills; under preemption), through the same scheduler with every page back;
the pooling a sentence-transformers folder names (a Qwen3-Embedding-style last-token model);
the ``openai`` SDK (base64 and float) and LangChain's ``OpenAIEmbeddings``; the 400s; a
cancelled batch aborted."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
import trio
from langchain_openai import OpenAIEmbeddings
from transformers import AutoModel, Qwen3Model

from trillm.engine.config import EngineConfig
from trillm.engine.execution.loading import load_model
from trillm.engine.execution.pooling import pooling_of
from trillm.engine.sampling_params import SamplingParams

from tests.families import tiny_qwen3
from tests.helpers import make_engine, wait_idle
from tests.server import MODEL, client, in_thread, running_server

TEXTS = ["the cat sat on the mat", "a cat was sitting on a mat", "stock prices fell sharply"]
LONG = "The history of the bicycle is long and winding. " * 12  # ~120 tokens: prefilled in chunks of 32


@pytest.fixture(scope="module")
def hf_base(model_dir):
    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(hf, ids: list[int], mode: str) -> torch.Tensor:
    with torch.inference_mode():
        h = hf(torch.tensor([ids])).last_hidden_state[0]
    return {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[mode]


async def _drain(engine, ids: list[int], params: SamplingParams) -> None:
    async with engine.generate(ids, params) as outputs:
        async for _ in outputs:
            pass


async def _embed_all(engine, prompts: list[list[int]], mode: str) -> list[torch.Tensor]:
    """All at once, as one submission: they reach the scheduler together and in this order, so
    what it schedules (and whom it preempts) does not hang on the event loop's task order."""
    results: list[torch.Tensor | None] = [None] * len(prompts)
    ids, outputs = engine.submit_many([(ids, SamplingParams(max_tokens=1, pooling=mode)) for ids in prompts])
    try:
        with outputs:
            async for out in outputs:
                if out.finish_reason:
                    results[out.index] = out.embedding
    finally:
        for request_id in ids:
            engine.abort(request_id)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


@pytest.mark.parametrize("num_pages", [256, 35], ids=["roomy", "preempting"])
async def test_pooled_states_equal_transformers_and_free_every_page(model_parts, tokenizer, hf_base, num_pages):
    """Every pooling, over prompts prefilled whole and in chunks of 32 tokens, all at once; in 35
    pages of 4 tokens two ~120-token prompts preempt each other, and the pooling starts over.
    (A request that computes its prefix again rather than reuse it once stranded cached pages at
    each restart until it no longer fitted, and was preempted forever: ``Sequence.reuses_prefix``.)"""
    prompts = [tokenizer(t)["input_ids"] for t in [*TEXTS, LONG, LONG + "Bikes.", "Why? " + LONG]]
    engine = make_engine(model_parts, max_batch_tokens=32, num_pages=num_pages, page_size=4, max_num_seqs=6)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        for mode in ("mean", "cls", "last") if num_pages == 256 else ("mean",):  # preempting: the costliest one
            with trio.fail_after(60):
                embedded = await _embed_all(engine, prompts, mode)
            for got, ids in zip(embedded, prompts):
                torch.testing.assert_close(got, reference(hf_base, ids, mode), atol=2e-4, rtol=1e-4)
        again = await _embed_all(engine, prompts[:1], "mean")  # its pages are cached now: computed anyway
        torch.testing.assert_close(again[0], reference(hf_base, prompts[0], "mean"), atol=2e-4, rtol=1e-4)
        await wait_idle(engine)
        stats = engine.stats()
        assert stats.free_pages + stats.evictable_pages == stats.total_pages and stats.num_open_requests == 0
        if num_pages == 35:
            assert stats.num_preemptions > 0, stats
            with trio.fail_after(60):  # prompt logprobs compute their prefix again too
                logprobs = SamplingParams(max_tokens=1, prompt_logprobs=1)
                async with trio.open_nursery() as inner:
                    for ids in prompts[3:]:
                        inner.start_soon(_drain, engine, ids, logprobs)
            await wait_idle(engine)
        nursery.cancel_scope.cancel()


@pytest.mark.e2e
async def test_openai_sdk_langchain_and_bad_inputs(server, tokenizer, hf_base):
    def run():
        c = client(server)
        packed = c.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and unpacks it
        floats = c.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
        raw = httpx.post(
            server.base_url + "/embeddings", json={"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}
        ).json()
        ids = c.embeddings.create(
            model=MODEL, input=[tokenizer(TEXTS[0])["input_ids"], [5, 6, 7]], encoding_format="float"
        )
        lc = OpenAIEmbeddings(model=MODEL, base_url=server.base_url, api_key="unused", check_embedding_ctx_length=False)
        query, docs = lc.embed_query(TEXTS[0]), lc.embed_documents(TEXTS[1:])
        errors = {}
        for name, body in {
            "empty": {"input": ""},
            "none": {"input": []},
            "dimensions": {"input": "x", "dimensions": 10},
            "too_many_dimensions": {"input": "x", "dimensions": 10_000},
            "token": {"input": [[5, 10**9]]},
            "long": {"input": ["fine", "x " * 9000]},
            "format": {"input": "x", "encoding_format": "int8"},
            "model": {"input": "x", "model": "nope"},
        }.items():
            reply = httpx.post(server.base_url + "/embeddings", json={"model": MODEL, **body})
            errors[name] = (reply.status_code, reply.json()["error"])
        metrics = httpx.get(server.url + "/metrics").text
        return packed, floats, raw, ids, query, docs, errors, metrics

    packed, floats, raw, ids, query, docs, errors, metrics = await in_thread(run)
    vectors = np.array([d.embedding for d in packed.data])
    assert vectors.shape == (3, 576) and [d.index for d in packed.data] == [0, 1, 2]
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)  # normalized
    cat = torch.nn.functional.normalize(reference(hf_base, tokenizer(TEXTS[0])["input_ids"], "mean"), dim=0)
    np.testing.assert_allclose(vectors[0], cat.numpy(), atol=1e-4)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.1  # the mat, not the stocks
    assert packed.usage.prompt_tokens == packed.usage.total_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    np.testing.assert_allclose(floats.data[0].embedding, vectors[0], atol=1e-6)
    decoded = np.frombuffer(__import__("base64").b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, vectors[0], atol=1e-6)
    assert raw["object"] == "list" and raw["model"] == MODEL and raw["data"][0]["object"] == "embedding"
    np.testing.assert_allclose(ids.data[0].embedding, vectors[0], atol=1e-6)  # token ids: the same vector
    assert ids.usage.prompt_tokens == len(tokenizer(TEXTS[0])["input_ids"]) + 3
    np.testing.assert_allclose(query, vectors[0], atol=1e-5)
    np.testing.assert_allclose(docs, vectors[1:], atol=1e-5)
    expected = {
        "empty": (400, "input"),
        "none": (400, "input"),
        "dimensions": (400, "dimensions"),
        "too_many_dimensions": (400, "dimensions"),
        "token": (400, "input"),
        "long": (400, "input[1]"),
        "format": (400, "encoding_format"),
        "model": (404, "model"),
    }
    for name, (status, param) in expected.items():
        assert (errors[name][0], errors[name][1]["param"]) == (status, param), (name, errors[name])
    assert errors["long"][1]["code"] == "context_length_exceeded", errors["long"]
    assert f"at most {server.engine.max_model_len - 1} can be embedded" in errors["long"][1]["message"]
    assert f'trillm:embedding_inputs_total{{model_name="{MODEL}"}} 10.0' in metrics  # 3 + 1 + 1 + 2 + 1 + 2


@pytest.mark.e2e
async def test_a_client_that_leaves_aborts_its_inputs(server):
    body = {"model": MODEL, "input": [f"{i} " + "word " * 400 for i in range(96)]}  # ~40,000 tokens: seconds
    before = server.engine.stats().num_aborted
    async with httpx.AsyncClient(base_url=server.base_url, timeout=2.0) as http:
        with pytest.raises(httpx.TimeoutException):
            await http.post("/embeddings", json=body)
    await wait_idle(server.engine, timeout=30)
    assert server.engine.stats().num_aborted > before


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory, model_dir):
    """A Qwen3-Embedding-style sentence-transformers folder on random weights: last-token
    pooling, normalized, trained for 32 and 64 dimensions (Matryoshka)."""
    folder = tiny_qwen3(tmp_path_factory.mktemp("qwen3_embedding"), model_dir, 0, Qwen3Model)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [32, 64]}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False})
    )
    return folder


async def test_a_sentence_transformers_folder_names_its_pooling(embedding_dir, tokenizer):
    config = EngineConfig(model=str(embedding_dir), dtype="float32")
    pooling = pooling_of(config, embedding_dir)
    assert (pooling.mode, pooling.normalize, pooling.source) == ("last", True, "sentence-transformers")
    assert pooling_of(EngineConfig(model=str(embedding_dir), pooling="cls"), embedding_dir).mode == "cls"
    hf = AutoModel.from_pretrained(embedding_dir, dtype=torch.float32).eval()
    parts = load_model(EngineConfig(model=str(embedding_dir), dtype="float32"))
    async with running_server(parts, model=str(embedding_dir), num_pages=64) as srv:

        def run():
            c = client(srv)
            model = c.models.list().data[0].id
            return c.embeddings.create(model=model, input=TEXTS), c.embeddings.create(
                model=model, input=TEXTS[0], dimensions=32
            )

        full, short = await in_thread(run)
    for text, item in zip(TEXTS, full.data):
        expected = torch.nn.functional.normalize(reference(hf, tokenizer(text)["input_ids"], "last"), dim=0)
        np.testing.assert_allclose(item.embedding, expected.numpy(), atol=1e-5)
    cut = torch.nn.functional.normalize(reference(hf, tokenizer(TEXTS[0])["input_ids"], "last")[:32], dim=0)
    np.testing.assert_allclose(short.data[0].embedding, cut.numpy(), atol=1e-5)
