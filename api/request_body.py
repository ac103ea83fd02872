"""Reading a request body: ``Content-Encoding`` gzip or deflate decoded as it arrives.

The size limit applies twice: to the bytes on the wire (Quart's
``MAX_CONTENT_LENGTH``, answered before the body is read when ``Content-Length``
says so) and to the decoded body. Decoding is incremental with a bounded output
per call (``zlib``'s ``max_length``), so a zip bomb is a 413 once the limit is
passed, after at most the limit plus one chunk is held, never its full size.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import AsyncIterable

import trio
from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout

from trillm.api.errors import ApiError, shown

# wbits for zlib: gzip's header and trailer; deflate as HTTP defines it (zlib-wrapped, RFC 9110).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def codings(header: str | None) -> list[str]:
    """The content codings a ``Content-Encoding`` header lists, without ``identity``; a 415
    ``unsupported_media_type`` for one we do not decode (or for more than one)."""
    names = [c.strip().lower() for c in (header or "").split(",") if c.strip()]
    names = [c for c in names if c != "identity"]
    unsupported = [c for c in names if c not in _WBITS]
    if unsupported or len(names) > 1:
        raise ApiError(
            f"Content-Encoding {shown(repr(header))} is not supported: send the body as identity, gzip or deflate",
            415,
            code="unsupported_media_type",
            type="invalid_request_error",
        )
    return names


class Decoder:
    """One compressed body decoded chunk by chunk; ``feed`` raises 413 past ``limit`` decoded bytes."""

    def __init__(self, coding: str, limit: int) -> None:
        self.coding = coding
        self.limit = limit
        self.size = 0
        self.parts: list[bytes] = []
        self._zlib = zlib.decompressobj(_WBITS[coding])
        # "deflate" is zlib-wrapped, but some clients send it raw: its first two bytes tell (RFC 1950's check)
        self._head: bytes | None = b"" if coding == "deflate" else None

    def feed(self, data: bytes) -> None:
        if self._head is not None:
            self._head += data
            if len(self._head) < 2:
                return
            data, self._head = self._head, None
            if data[0] & 0x0F != 8 or (data[0] << 8 | data[1]) % 31:
                self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            while data and not self._zlib.eof:
                out = self._zlib.decompress(data, self.limit - self.size + 1)
                self._take(out)
                data = self._zlib.unconsumed_tail
        except zlib.error:
            raise self._corrupt() from None
        if data or self._zlib.unused_data:
            raise self._corrupt()  # bytes after the end of the compressed stream

    def finish(self) -> bytes:
        """The decoded body; 400 if the compressed stream was cut short."""
        if self._head is not None:
            raise self._corrupt()
        self._take(self._zlib.flush())
        if not self._zlib.eof:
            raise self._corrupt()
        return b"".join(self.parts)

    def _take(self, out: bytes) -> None:
        self.size += len(out)
        if self.size > self.limit:
            raise RequestEntityTooLarge()
        if out:
            self.parts.append(out)

    def _corrupt(self) -> ApiError:
        return ApiError(
            f"the request body is not valid {self.coding} data (Content-Encoding: {self.coding})",
            code="invalid_content_encoding",
        )


async def decode_body(chunks: AsyncIterable[bytes], coding: str, limit: int, timeout: float | None) -> bytes:
    """A compressed body read from ``chunks`` and decoded, within ``limit`` bytes on the wire and
    decoded; a 408 when it has not all arrived within ``timeout`` seconds (Quart's ``BODY_TIMEOUT``)."""
    decoder = Decoder(coding, limit)
    received = 0
    with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
        async for chunk in chunks:
            received += len(chunk)
            if received > limit:  # Quart counts only what is buffered, not the total, while iterating
                raise RequestEntityTooLarge()
            decoder.feed(chunk)
    if scope.cancelled_caught:
        raise RequestTimeout()
    return decoder.finish()
