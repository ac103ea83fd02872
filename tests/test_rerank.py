"""``POST /v1/rerank`` and ``/v1/score``: relevance as P(yes) / (P(yes) + P(no)) where the model
answers, equal to transformers' on the same prompt (a Qwen3-Reranker-style folder on random
weights, and the default model through our yes/no prompt); the Cohere SDK, LangChain's
``CohereRerank`` (a retriever's compressor, as a RAG app reranks); the 400s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import cohere
import httpx
import pytest
import torch
from langchain_cohere import CohereRerank
from langchain_core.documents import Document
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from trillm.api.rerank import Scorer
from trillm.bench.server_probe import wait_healthy
from trillm.engine.config import EngineConfig
from trillm.engine.execution.loading import load_model
from trillm.engine.processes import free_port

from tests.families import TINY_QWEN3, tiny_qwen3
from tests.server import MODEL, in_thread, running_server

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are a yellow fruit.", "The Eiffel Tower is in Paris."]


def expected(hf, scorer: Scorer, tokenizer, query: str, document: str, instruction: str | None = None) -> float:
    """transformers' P(yes) / (P(yes) + P(no)) at the end of the scorer's prompt."""
    ids = scorer.prompt(tokenizer, query, document, instruction)
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
    yes = logp[list(scorer.yes_ids)].exp().sum()
    no = logp[list(scorer.no_ids)].exp().sum()
    return float(yes / (yes + no))


@pytest.fixture(scope="module")
def hf_default(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.e2e
async def test_rerank_and_score_equal_transformers_through_cohere_and_http(server, tokenizer, hf_default):
    scorer = Scorer.for_model("auto", MODEL, tokenizer)
    assert scorer.style == "yes-no" and len(scorer.yes_ids) == len(scorer.no_ids) == 2

    def run():
        co = cohere.ClientV2(base_url=server.url, api_key="unused")
        ranked = co.rerank(model=MODEL, query=QUERY, documents=DOCUMENTS, top_n=2)
        compressor = CohereRerank(model=MODEL, base_url=server.url, cohere_api_key="unused", top_n=2)
        kept = compressor.compress_documents([Document(d, metadata={"i": i}) for i, d in enumerate(DOCUMENTS)], QUERY)
        plain = httpx.post(
            server.url + "/v1/rerank",
            json={
                "model": MODEL,
                "query": QUERY,
                "documents": [{"text": d} for d in DOCUMENTS],
                "return_documents": False,
            },
            timeout=60,
        ).json()
        scored = httpx.post(
            server.url + "/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS}, timeout=60
        ).json()
        paired = httpx.post(
            server.url + "/score", json={"model": MODEL, "text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]}, timeout=60
        ).json()
        errors = {}
        for name, path, body in [
            ("no_documents", "/v1/rerank", {"query": QUERY, "documents": []}),
            ("top_n", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 0}),
            ("empty_query", "/v1/rerank", {"query": "", "documents": DOCUMENTS}),
            ("pairs", "/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS}),
            ("long", "/v1/score", {"text_1": QUERY, "text_2": "word " * 9000}),
            ("model", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "model": "nope"}),
        ]:
            reply = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)
            errors[name] = (reply.status_code, reply.json()["error"]["param"])
        return ranked, kept, plain, scored, paired, errors

    ranked, kept, plain, scored, paired, errors = await in_thread(run)
    want = [expected(hf_default, scorer, tokenizer, QUERY, d) for d in DOCUMENTS]
    assert [s["score"] for s in scored["data"]] == pytest.approx(want, abs=1e-4)
    assert [s["index"] for s in scored["data"]] == [0, 1, 2] and scored["object"] == "list"
    assert [s["score"] for s in paired["data"]] == pytest.approx(want[:2], abs=1e-4)
    order = sorted(range(3), key=lambda i: -want[i])
    assert order[0] == 0 and order[-1] == 1  # the answer first, the bananas last
    assert [r.index for r in ranked.results] == order[:2]  # top_n
    assert [r.relevance_score for r in ranked.results] == pytest.approx([want[i] for i in order[:2]], abs=1e-4)
    assert [d.metadata["i"] for d in kept] == order[:2] and [d.page_content for d in kept] == [
        DOCUMENTS[i] for i in order[:2]
    ]
    assert [d.metadata["relevance_score"] for d in kept] == pytest.approx([want[i] for i in order[:2]], abs=1e-4)
    assert [r["index"] for r in plain["results"]] == order and "document" not in plain["results"][0]
    assert plain["usage"]["total_tokens"] == sum(len(scorer.prompt(tokenizer, QUERY, d, None)) for d in DOCUMENTS)
    assert errors == {
        "no_documents": (400, "documents"),
        "top_n": (400, "top_n"),
        "empty_query": (400, "query"),
        "pairs": (400, "text_1"),
        "long": (400, "text_2"),
        "model": (404, "model"),
    }


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory, model_dir):
    """A folder named as a Qwen3-Reranker, on random weights, with a ChatML tokenizer (the default's)."""
    return tiny_qwen3(tmp_path_factory.mktemp("tiny-Qwen3-Reranker"), model_dir, 1)


async def test_a_qwen3_reranker_is_read_with_its_own_template(reranker_dir, tokenizer):
    hf = Qwen3ForCausalLM.from_pretrained(reranker_dir, dtype=torch.float32).eval()
    parts = load_model(EngineConfig(model=str(reranker_dir), dtype="float32"))
    scorer = Scorer.for_model("auto", str(reranker_dir), tokenizer)
    assert scorer.style == "qwen3-reranker" and scorer.yes_ids == (tokenizer.get_vocab()["yes"],)
    task = "Find the passage that names the city"
    async with running_server(parts, model=str(reranker_dir), num_pages=64) as srv:

        def run():
            body = {"model": str(reranker_dir), "query": QUERY, "documents": DOCUMENTS, "instruction": task}
            return httpx.post(srv.url + "/v1/rerank", json=body, timeout=60).json()

        reply = await in_thread(run)
    got = {r["index"]: r["relevance_score"] for r in reply["results"]}
    want = {i: expected(hf, scorer, tokenizer, QUERY, d, task) for i, d in enumerate(DOCUMENTS)}
    assert got == pytest.approx(want, abs=1e-4)
    assert "<Instruct>: " + task in tokenizer.decode(scorer.prompt(tokenizer, QUERY, DOCUMENTS[0], task))


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, model_dir):
    """A cross-encoder with a one-label classification head (as rerankers converted to
    ``Qwen3ForSequenceClassification`` are), on random weights."""
    from transformers import Qwen3ForSequenceClassification

    return tiny_qwen3(
        tmp_path_factory.mktemp("tiny-seq-cls"), model_dir, 2, Qwen3ForSequenceClassification, num_labels=1
    )


async def test_a_classification_head_scores_the_pairs(classifier_dir, tokenizer):
    """The sigmoid of the head over the last token's final-normed hidden state, as transformers'
    ``Qwen3ForSequenceClassification`` computes it, on the Qwen3-Reranker template (ChatML)."""
    from transformers import Qwen3ForSequenceClassification

    hf = Qwen3ForSequenceClassification.from_pretrained(classifier_dir, dtype=torch.float32).eval()
    parts = load_model(EngineConfig(model=str(classifier_dir), dtype="float32"))
    assert parts[0].classifier is not None and parts[0].classifier.shape == (1, TINY_QWEN3["hidden_size"])
    scorer = Scorer.for_model("auto", str(classifier_dir), tokenizer, parts[0].classifier)
    assert scorer.style == "classifier" and scorer.chatml
    async with running_server(parts, model=str(classifier_dir), num_pages=64) as srv:

        def run():
            body = {"model": str(classifier_dir), "text_1": QUERY, "text_2": DOCUMENTS}
            return httpx.post(srv.url + "/v1/score", json=body, timeout=60).json()

        reply = await in_thread(run)
    for item, document in zip(reply["data"], DOCUMENTS):
        ids = scorer.prompt(tokenizer, QUERY, document, None)
        with torch.inference_mode():
            want = float(torch.sigmoid(hf(torch.tensor([ids])).logits[0, 0]))
        assert item["score"] == pytest.approx(want, abs=1e-4)


def test_dp_replicas_score_with_their_classification_head(classifier_dir, tokenizer):
    """Under ``--dp`` the head lives in the replicas' processes: they send it when ready, so the
    front scores pairs with it (not with the yes/no prompt), as one engine does."""
    from transformers import Qwen3ForSequenceClassification

    hf = Qwen3ForSequenceClassification.from_pretrained(classifier_dir, dtype=torch.float32).eval()
    scorer = Scorer.for_model("auto", str(classifier_dir), tokenizer, torch.zeros(1, TINY_QWEN3["hidden_size"]))
    port = free_port()
    command = [sys.executable, "-m", "trillm.api.cli", "serve", "--model", str(classifier_dir), "--dp", "2"]
    command += ["--port", str(port), "--dtype", "float32", "--num-pages", "64", "--served-model-name", "cls"]
    proc = subprocess.Popen(command, env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=180)
        reply = httpx.post(url + "/v1/score", json={"model": "cls", "text_1": QUERY, "text_2": DOCUMENTS}, timeout=60)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    for item, document in zip(reply.json()["data"], DOCUMENTS):
        with torch.inference_mode():
            ids = torch.tensor([scorer.prompt(tokenizer, QUERY, document, None)])
            want = float(torch.sigmoid(hf(ids).logits[0, 0]))
        assert item["score"] == pytest.approx(want, abs=1e-4)
