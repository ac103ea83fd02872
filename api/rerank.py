"""``POST /v1/rerank`` and ``POST /v1/score``: how relevant a document is to a query, from any model.

Each (query, document) pair becomes a prompt that asks the model whether the document
answers the query; one engine request per pair prefills it and reports the model's own
log-probabilities of its "yes" and "no" tokens where it would answer
(``SamplingParams.score_ids``). The relevance is P(yes) / (P(yes) + P(no)), which is
exactly how a Qwen3-Reranker is read (``qwen3-reranker``, its own template). Any other
model is asked our question (``yes-no``) in its chat template:

    system: Judge whether the Document is relevant to the Query. Answer only "yes" or "no".
    user:   Query: <query>
            Document: <document>
            Is the Document relevant to the Query? Answer "yes" or "no".

with "yes"/"Yes" against "no"/"No" (each word's first token). A model with a
classification head (``*ForSequenceClassification``) is read through it instead: its
last prompt token's final-normed hidden state (``pooling="last"``) times the head.
Pairs run as one batch through the scheduler, cancelled with their client.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import attrs
import torch

from trillm.api.errors import ApiError
from trillm.api.gateway import EngineHandle
from trillm.api.input_limits import check_text
from trillm.api.submission import check_prefill_prompt, collect, submit_choices
from trillm.engine import SamplingParams

QWEN3_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
YES_NO_SYSTEM = 'Judge whether the Document is relevant to the Query. Answer only "yes" or "no".'
YES_NO_QUESTION = 'Query: {query}\nDocument: {document}\nIs the Document relevant to the Query? Answer "yes" or "no".'


def _first_tokens(tokenizer: Any, words: tuple[str, ...]) -> tuple[int, ...]:
    ids = [tokenizer(word, add_special_tokens=False)["input_ids"][:1] for word in words]
    return tuple(dict.fromkeys(i[0] for i in ids if i))


@attrs.frozen
class Scorer:
    """The prompt a pair becomes, and the tokens whose probabilities say yes and no."""

    style: str  # "qwen3-reranker", "yes-no" or "classifier"
    yes_ids: tuple[int, ...] = ()
    no_ids: tuple[int, ...] = ()
    head: Any = attrs.field(default=None, eq=False, repr=False)  # a classifier's [labels, hidden]
    chatml: bool = False  # a classifier's prompt: Qwen3-Reranker's template (its tokenizer has ChatML)

    @classmethod
    def for_model(cls, setting: str, model_name: str, tokenizer: Any, classifier: Any = None) -> Scorer:
        """``classifier``: the model's sequence-classification head, if it has one (then used, unless
        the setting asks for a yes/no prompt)."""
        vocab = tokenizer.get_vocab()
        style = setting
        if style == "auto" and classifier is not None:
            return cls("classifier", head=classifier, chatml="<|im_start|>" in vocab)
        if style == "auto":
            style = "qwen3-reranker" if "rerank" in model_name.lower() and "<|im_start|>" in vocab else "yes-no"
        if style == "qwen3-reranker":
            return cls(style, (vocab["yes"],), (vocab["no"],))
        return cls(style, _first_tokens(tokenizer, ("yes", "Yes")), _first_tokens(tokenizer, ("no", "No")))

    def prompt(self, tokenizer: Any, query: str, document: str, instruction: str | None) -> list[int]:
        if self.style == "classifier" and not self.chatml:  # a cross-encoder's pair, one per line
            return list(tokenizer(f"{query}\n{document}")["input_ids"])
        if self.style in ("qwen3-reranker", "classifier"):
            text = (
                f"<|im_start|>system\n{QWEN3_SYSTEM}<|im_end|>\n<|im_start|>user\n"
                f"<Instruct>: {instruction or QWEN3_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
                "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            )
        elif getattr(tokenizer, "chat_template", None):
            messages = [
                {"role": "system", "content": YES_NO_SYSTEM},
                {"role": "user", "content": YES_NO_QUESTION.format(query=query, document=document)},
            ]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = f"{YES_NO_SYSTEM}\n\n{YES_NO_QUESTION.format(query=query, document=document)}\nAnswer:"
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def params(self, priority: int) -> SamplingParams:
        """One pair's request: its last hidden state (a classifier), or its yes/no log-probabilities."""
        if self.style == "classifier":
            return SamplingParams(max_tokens=1, temperature=0, pooling="last", priority=priority, speculative=False)
        ids = self.yes_ids + self.no_ids
        return SamplingParams(max_tokens=1, temperature=0, score_ids=ids, priority=priority, speculative=False)

    def classify(self, hidden: Any) -> float:
        """A classifier's relevance: the sigmoid of its one label, or the second of two labels' softmax."""
        logits = self.head @ hidden.float()
        if logits.numel() == 1:
            return float(torch.sigmoid(logits[0]))
        return float(torch.softmax(logits, -1)[1])

    def relevance(self, logprobs: tuple[float, ...]) -> float:
        """P(yes) / (P(yes) + P(no)) from the log-probabilities of ``yes_ids + no_ids``."""
        yes = logprobs[: len(self.yes_ids)]
        no = logprobs[len(self.yes_ids) :]
        top = max(logprobs)
        p_yes = sum(math.exp(v - top) for v in yes)
        p_no = sum(math.exp(v - top) for v in no)
        return p_yes / (p_yes + p_no)


def prompts(
    engine: EngineHandle, scorer: Scorer, pairs: list[tuple[str, str]], instruction: str | None, param: str
) -> list[list[int]]:
    """Each pair's prompt (in a worker thread: a thousand documents cost seconds to tokenize),
    checked against the context and the vocabulary."""
    check_text(engine, [text for pair in pairs for text in pair], param)
    out = [scorer.prompt(engine.tokenizer, query, document, instruction) for query, document in pairs]
    for index, ids in enumerate(out):
        too_long = f"pair {index} takes {{tokens}} tokens with the relevance prompt. Please shorten the query or "
        check_prefill_prompt(engine, ids, param, too_long + "the document.")
    return out


async def scores(
    engine: EngineHandle, scorer: Scorer, prompt_ids: list[list[int]], priority: int, deadline: float
) -> tuple[list[float], int]:
    """Every pair's relevance, and the prompt tokens they took."""
    request_ids, outputs = submit_choices(engine, prompt_ids, scorer.params(priority), 1)
    done = await collect(engine, request_ids, outputs, [""] * len(prompt_ids), deadline)
    values = []
    for index, out in enumerate(done.last):
        if scorer.style == "classifier" and out.embedding is not None:
            values.append(scorer.classify(out.embedding))
        elif scorer.style != "classifier" and out.token_scores is not None:
            values.append(scorer.relevance(out.token_scores))
        else:
            raise ApiError(f"pair {index} could not be scored ({out.finish_reason})", 500)
    return values, sum(map(len, prompt_ids))


def rerank_reply(
    model: str, documents: list[str], values: list[float], tokens: int, top_n: int | None, return_documents: bool
) -> dict[str, Any]:
    order = sorted(range(len(values)), key=lambda i: -values[i])[: top_n or len(values)]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": values[i]}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def score_reply(model: str, values: list[float], tokens: int, created: int) -> dict[str, Any]:
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": created,
        "model": model,
        "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
