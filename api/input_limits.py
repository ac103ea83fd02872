"""Size limits checked before the expensive work on a request's input (validation, the chat
template, the tokenizer), and the worker threads that work runs in.

A prompt longer than the context is refused anyway, once tokenized; these checks
refuse what obviously cannot fit before paying for it: every message takes at
least one token in any chat format, and no token covers more characters than the
longest one in the vocabulary. What passes is templated and tokenized in a worker
thread, a few at a time (``PREPARE_THREADS``), so ``/health`` and running streams
never wait behind one request's input and a flood of large inputs queues.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import trio

from trillm.api.errors import ApiError
from trillm.api.gateway import EngineHandle

PREPARE_THREADS = 1  # decoding, validating and templating hold the GIL: a second thread adds contention, not speed

T = TypeVar("T")


def limit_error(max_model_len: int, what: str, param: str) -> ApiError:
    """A 400 ``context_length_exceeded`` (clients recognize OpenAI's "maximum context length")."""
    return ApiError(
        f"This model's maximum context length is {max_model_len} tokens. However, the {what}, "
        "so the prompt cannot fit. Please reduce the length of the messages or prompt.",
        param=param,
        code="context_length_exceeded",
        type="invalid_request_error",
    )


def check_counts(body: Any, max_model_len: int) -> None:
    """Before validation: a list of messages (``messages``, Responses' ``input``) or of token ids
    (``prompt``) longer than the context cannot fit. Costs one ``len``; validating 100,000
    messages would cost seconds."""
    if not isinstance(body, dict):
        return
    for param in ("messages", "input"):
        items = body.get(param)
        if isinstance(items, list) and len(items) > max_model_len:
            raise limit_error(max_model_len, f"{param} hold {len(items)} items (each takes at least one token)", param)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > max_model_len and all(isinstance(t, int) for t in prompt[:16]):
        raise limit_error(max_model_len, f"prompt holds {len(prompt)} token ids", "prompt")


_LONGEST: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry as written
    (byte-level entries hold one character per byte, ``<0x0A>`` stands for one, ``##ab`` for two)."""
    try:
        return _LONGEST[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    try:
        _LONGEST[tokenizer] = longest
    except TypeError:  # not weakly referenceable: computed again next time
        pass
    return longest


def check_text(engine: EngineHandle, texts: Iterable[str], param: str) -> None:
    """Before templating or tokenizing: text with more characters than ``max_model_len`` of the longest
    tokens could cover cannot fit."""
    limit = engine.max_model_len * longest_token_chars(engine.tokenizer)
    total = 0
    for text in texts:
        total += len(text)
        if total > limit:
            raise limit_error(
                engine.max_model_len,
                f"{param} hold over {limit} characters (no token covers more than {limit // engine.max_model_len})",
                param,
            )


def message_texts(messages: Iterable[dict[str, Any]]) -> Iterable[str]:
    """The text of template-ready messages: contents and tool-call arguments."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            yield content
        for call in message.get("tool_calls") or ():
            arguments = call.get("function", {}).get("arguments")
            yield arguments if isinstance(arguments, str) else str(arguments)


class Preparer:
    """Runs a request's synchronous preparation (parsing, templating, tokenizing) in a worker thread,
    at most ``threads`` at once; a flood waits its turn here, not on the event loop."""

    def __init__(self, threads: int = PREPARE_THREADS) -> None:
        self.limiter = trio.CapacityLimiter(threads)

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` in a worker thread. If cancelled while waiting for a thread, it never runs; once
        it runs, cancellation waits for it to return (it holds no engine resources).

        A refusal (``ApiError``) comes back without the worker's frames: they hold the request's
        body, and Trio's relay forms a reference cycle with them, so a refused 50 MB body lived
        on until the next full garbage collection."""
        try:
            return await trio.to_thread.run_sync(fn, limiter=self.limiter)
        except ApiError as exc:
            exc.__traceback__ = None
            raise exc from exc.__cause__
