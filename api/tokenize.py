"""``POST /tokenize`` and ``POST /detokenize`` with vLLM-compatible bodies (declared in ``schemas.tokenize``)."""

from __future__ import annotations

from typing import Any

from trillm.api.errors import ApiError
from trillm.api.input_limits import check_counts, check_text, message_texts
from trillm.api.schemas.describe import parse
from trillm.api.schemas.tokenize import DetokenizeBody, TokenizeBody
from trillm.engine.engine import Engine
from trillm.engine.replicas.front import ReplicaSet


def tokenize(engine: Engine | ReplicaSet, body: Any) -> dict[str, Any]:
    """``{"prompt"}`` or ``{"messages"}`` (chat template applied) -> ``{tokens, count, max_model_len}``.

    Text that obviously cannot fit the context is refused before templating (``input_limits``);
    synchronous and slow for a big input: the app calls it in a worker thread."""
    check_counts(body, engine.max_model_len)
    req: TokenizeBody = parse(TokenizeBody, body)
    tok = engine.tokenizer
    if req.messages is not None:
        messages = [m.for_template() for m in req.messages]
        check_text(engine, message_texts(messages), "messages")
        text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, tokenize=False)
        tokens = tok(text, add_special_tokens=False)["input_ids"]
    else:
        check_text(engine, [req.prompt or ""], "prompt")
        tokens = tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
    return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}


def detokenize(engine: Engine | ReplicaSet, body: Any) -> dict[str, Any]:
    """``{"tokens": [ids]}`` -> ``{"prompt": text}``; ids past the vocabulary are a 400."""
    req: DetokenizeBody = parse(DetokenizeBody, body)
    vocab = engine.model.shape.vocab_size
    if any(t >= vocab for t in req.tokens):
        raise ApiError(f"'tokens': token ids must be in [0, {vocab - 1}]", param="tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens)}
