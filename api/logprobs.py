"""Log-probabilities in OpenAI's two shapes: chat (``content[]``) and legacy completions."""

from __future__ import annotations

import functools
import math
import re
from typing import Any

from trillm.engine import LOGPROB_FLOOR, TokenLogprobs


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode map, used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def clamp(logprob: float) -> float:
    """``logprob`` as a finite JSON number, at least OpenAI's floor (-9999.0) and at most 0: the
    sampler floors the alternatives, not the chosen token, and NaN (broken weights) passes any floor."""
    if math.isnan(logprob):
        return LOGPROB_FLOOR
    return min(max(float(logprob), LOGPROB_FLOOR), 0.0)


_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The exact bytes a token stands for (a token may hold part of a UTF-8 character)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if token_id in tokenizer.all_special_ids:
        return piece.encode()
    decoder = _byte_decoder()
    if all(c in decoder for c in piece):
        return bytes(decoder[c] for c in piece)
    if match := _BYTE_PIECE.match(piece):  # sentencepiece byte fallback
        return bytes([int(match.group(1), 16)])
    return piece.replace("▁", " ").encode()


def _entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": clamp(logprob), "bytes": list(raw)}


def chat_content(tokenizer: Any, items: tuple[TokenLogprobs, ...] | list[TokenLogprobs]) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` entries: token, logprob, bytes, top_logprobs."""
    out = []
    for lp in items:
        entry = _entry(tokenizer, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_entry(tokenizer, t, v) for t, v in lp.top]
        out.append(entry)
    return out


def legacy(tokenizer: Any, items: list[TokenLogprobs], offset: int, head: int | None = None) -> dict[str, Any]:
    """The completions shape: parallel lists, ``text_offset`` counted from ``offset``.

    ``head``: a token put first with null logprob and top_logprobs (an echoed prompt's first
    token, which nothing before it scores; as OpenAI's legacy API did)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    if head is not None:
        text = token_bytes(tokenizer, head).decode("utf-8", errors="replace")
        tokens.append(text)
        token_logprobs.append(None)
        top.append(None)
        offsets.append(offset)
        offset += len(text)
    for lp in items:
        text = token_bytes(tokenizer, lp.token_id).decode("utf-8", errors="replace")
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        token_logprobs.append(clamp(lp.logprob))
        top.append({token_bytes(tokenizer, t).decode("utf-8", errors="replace"): clamp(v) for t, v in lp.top})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
