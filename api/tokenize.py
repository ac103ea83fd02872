"""``POST /tokenize`` and ``POST /detokenize`` with vLLM-compatible bodies (declared in ``schemas.tokenize``)."""

from __future__ import annotations

from typing import Any

from trillm.api.errors import ApiError
from trillm.api.input_limits import check_counts, check_text, message_texts
from trillm.api.schemas.describe import parse
from trillm.api.schemas.tokenize import DetokenizeBody, TokenizeBody
from trillm.engine import Engine, ReplicaSet


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


# Paths on the server's disk, not configuration (vLLM leaves out the same).
_FILE_FIELDS = frozenset({"vocab_file", "merges_file", "tokenizer_file"})


def tokenizer_info(engine: Engine | ReplicaSet) -> dict[str, Any]:
    """``GET /tokenizer_info`` as vLLM answers it (lm-eval's ``tokenizer_backend=auto`` asks): the
    tokenizer's configuration (its ``init_kwargs`` without file paths, special tokens as their
    text), ``tokenizer_class`` and the chat template."""
    tok = engine.tokenizer
    config = {k: _plain(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items() if k not in _FILE_FIELDS}
    config["tokenizer_class"] = type(tok).__name__
    if getattr(tok, "chat_template", None):
        config["chat_template"] = tok.chat_template
    return config


def _plain(value: Any) -> Any:
    """``value`` as JSON: an ``AddedToken`` as its text, keys as strings, anything else unknown as text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def detokenize(engine: Engine | ReplicaSet, body: Any) -> dict[str, Any]:
    """``{"tokens": [ids]}`` -> ``{"prompt": text}``; ids past the vocabulary are a 400."""
    req: DetokenizeBody = parse(DetokenizeBody, body)
    vocab = engine.model.shape.vocab_size
    if any(t >= vocab for t in req.tokens):
        raise ApiError(f"'tokens': token ids must be in [0, {vocab - 1}]", param="tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens)}
