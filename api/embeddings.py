"""``POST /v1/embeddings``: each input's pooled last hidden states, through the same scheduler.

Every input is one engine request that prefills its prompt and pools the final-normed
hidden states as it goes (``SamplingParams.pooling``: prefill only; the one token it
samples is dropped, and its pages are freed or cached as any request's). The pooling
and normalization are the model's own (``engine/execution/pooling.py``). Cancelled
with its client, as every route: the requests are aborted and their pages freed.
"""

from __future__ import annotations

import base64
from typing import Any

import attrs
import numpy as np
import torch

from trillm.api.errors import ApiError
from trillm.api.gateway import EngineHandle
from trillm.api.input_limits import check_text
from trillm.api.schemas.embeddings import EmbeddingsBody
from trillm.api.schemas.generation import left_truncated
from trillm.api.submission import check_prefill_prompt, collect, submit_choices
from trillm.engine import EngineConfig, Pooling, SamplingParams, pooling_for


@attrs.define
class Embedder:
    """What the route needs of the served model: its pooling and its hidden size. The pooling is
    read from the model's files on the first embeddings request (in its worker thread: a GGUF
    header costs up to seconds), not at every start."""

    config: EngineConfig
    hidden_size: int
    _pooling: Pooling | None = attrs.field(default=None, eq=False, repr=False)  # once read

    @property
    def pooling(self) -> Pooling:
        if self._pooling is None:
            self._pooling = pooling_for(self.config)
        return self._pooling

    def check_dimensions(self, dimensions: int | None) -> None:
        """A 400 for a ``dimensions`` this model cannot give (called in the request's worker thread,
        which so reads the pooling the first time)."""
        pooling = self.pooling
        if dimensions is None or dimensions == self.hidden_size:
            return
        if dimensions > self.hidden_size:
            raise ApiError(f"the model's embeddings have {self.hidden_size} dimensions", param="dimensions")
        if not pooling.matryoshka:
            raise ApiError(
                f"this model's embeddings cannot be shortened (its config names no Matryoshka training); "
                f"leave 'dimensions' out or send {self.hidden_size}",
                param="dimensions",
            )
        sizes = pooling.matryoshka_dimensions
        if sizes and dimensions not in sizes:
            raise ApiError(f"must be one of {', '.join(map(str, sizes))}", param="dimensions")

    def finish(self, vector: torch.Tensor, dimensions: int | None) -> np.ndarray:
        """The pooled vector as the client gets it: shortened, then normalized (where the model normalizes)."""
        if dimensions is not None:
            vector = vector[:dimensions]
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector.float(), dim=0)
        return vector.float().numpy()


def prompt_ids(engine: EngineHandle, body: EmbeddingsBody) -> list[list[int]]:
    """Each input's token ids (in a worker thread: many long inputs cost seconds to tokenize),
    less what ``truncate_prompt_tokens`` cuts from the left."""
    items = body.texts_or_ids()
    if isinstance(items[0], str):
        texts = [str(text) for text in items]
        check_text(engine, texts, "input")
        prompts = [list(engine.tokenizer(text)["input_ids"]) for text in texts]
    else:
        prompts = [list(map(int, ids)) for ids in items]
    # room for the one token its request samples
    return [left_truncated(ids, body.truncate_prompt_tokens, engine.max_model_len) for ids in prompts]


def params(body: EmbeddingsBody, pooling: Pooling) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0, pooling=pooling.mode, priority=body.priority, speculative=False)


def check_prompts(engine: EngineHandle, prompts: list[list[int]]) -> None:
    """Each input must fit the context beside the one token its request samples, in the
    vocabulary; a 400 naming it otherwise (``context_length_exceeded`` in OpenAI's words)."""
    limit = engine.max_model_len
    for index, ids in enumerate(prompts):
        param = "input" if len(prompts) == 1 else f"input[{index}]"
        too_long = f"you requested {{tokens}} tokens in the input (at most {limit - 1} can be embedded). Please "
        check_prefill_prompt(engine, ids, param, too_long + "reduce the length of the input.")


async def embed(
    engine: EngineHandle,
    embedder: Embedder,
    model: str,
    body: EmbeddingsBody,
    prompts: list[list[int]],
    deadline: float,
) -> dict[str, Any]:
    """Every input through the engine at once; the reply in OpenAI's shape."""
    request_ids, outputs = submit_choices(engine, prompts, params(body, embedder.pooling), 1)
    done = await collect(engine, request_ids, outputs, [""] * len(prompts), deadline)
    data = []
    for index, out in enumerate(done.last):
        if out.embedding is None:  # aborted or failed in the engine
            raise ApiError(f"input {index} could not be embedded ({out.finish_reason})", 500)
        vector = embedder.finish(out.embedding, body.dimensions)
        value: Any = (
            base64.b64encode(vector.astype("<f4").tobytes()).decode()
            if body.encoding_format == "base64"
            else vector.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": value})
    tokens = sum(map(len, prompts))
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
