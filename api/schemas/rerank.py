"""The bodies of ``POST /v1/rerank`` (the Cohere / Jina shape vLLM and llama.cpp serve) and
``POST /v1/score`` (vLLM's)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from trillm.api.schemas.base import RequestModel, invalid
from trillm.api.schemas.describe import parse
from trillm.engine import MAX_PRIORITY

MAX_DOCUMENTS = 1000
_Text = Annotated[str, Field(min_length=1)]


class DocumentObject(RequestModel):
    text: _Text


def _model_field() -> Any:
    return Field(
        min_length=1, description="must equal the served model id (see `/v1/models`), else 404 `model_not_found`"
    )


def _priority() -> Any:
    return Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="trillm's extension: lower is served first")


class RerankBody(RequestModel):
    """The body of ``POST /v1/rerank`` (published as ``RerankRequest``)."""

    model: str = _model_field()
    query: _Text = Field(description="what the documents are ranked against")
    documents: Annotated[list[_Text | DocumentObject], Field(min_length=1, max_length=MAX_DOCUMENTS)] = Field(
        description=f'up to {MAX_DOCUMENTS} strings or `{{"text"}}` objects'
    )
    top_n: int | None = Field(None, ge=1, description="return the best `top_n` only (all by default)")
    return_documents: bool = Field(True, description='each result carries its `document: {"text"}`')
    instruction: str | None = Field(
        None,
        max_length=2048,
        description="the task, for a Qwen3-Reranker (its default: web search); ignored by the `yes-no` prompt",
    )
    priority: int = _priority()

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


_Texts = _Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_DOCUMENTS)]


class ScoreBody(RequestModel):
    """The body of ``POST /v1/score`` (published as ``ScoreRequest``)."""

    model: str = _model_field()
    text_1: _Texts = Field(description="the query (or queries: one per `text_2`, paired in order)")
    text_2: _Texts = Field(description="the documents scored against `text_1`")
    instruction: str | None = Field(None, max_length=2048, description="as on `/v1/rerank`")
    priority: int = _priority()

    @model_validator(mode="after")
    def _check_pairs(self) -> ScoreBody:
        self.pairs()
        return self

    def pairs(self) -> list[tuple[str, str]]:
        """One query against each document, or query ``i`` against document ``i``."""
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(first) == 1:
            return [(first[0], doc) for doc in second]
        if len(first) != len(second):
            raise invalid(f"holds {len(first)} texts and text_2 {len(second)}: give one, or as many", "text_1")
        return list(zip(first, second))


def parse_rerank_request(body: Any) -> RerankBody:
    result: RerankBody = parse(RerankBody, body)
    return result


def parse_score_request(body: Any) -> ScoreBody:
    result: ScoreBody = parse(ScoreBody, body)
    return result
