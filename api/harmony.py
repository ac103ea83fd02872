"""gpt-oss's harmony format: a reply is messages on channels, each ``<|channel|>NAME<|message|>
TEXT`` ended by ``<|end|>``, ``<|return|>`` or ``<|call|>``, the next opened by ``<|start|>assistant``.

``analysis`` is the model's thinking (``reasoning_content``), ``final`` the answer (``content``),
``commentary`` a preamble the user may read (``content``) or, addressed ``to=functions.NAME``, a
tool call whose arguments are the message (``tools.formats.Harmony``, the ``harmony`` tool-call format).
The markers are special tokens: under this parser the server decodes them (the request's
``skip_special_tokens`` off), and the parser takes them out. A reply with no marker at all is
all answer. Incremental like ``reasoning.ReasoningParser``: a marker split across deltas is held
back until it is complete or proven not to be one.
"""

from __future__ import annotations

import re

from trillm.api.held_back import held_back

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
MARKERS = (CHANNEL, MESSAGE, START, "<|constrain|>", *ENDS)
CALL = re.compile(r"to=functions\.([\w.-]+)")


class HarmonyParser:
    """One reply's text in, ``(reasoning, content)`` deltas out; ``finish`` flushes what is held.

    A commentary message addressed to a function is passed on as content in its raw form
    (``<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>``) for the tool parser."""

    def __init__(self) -> None:
        self._state = "outside"  # outside (no marker yet) -> header -> body -> between -> header ...
        self._channel = ""  # the header of the message being read
        self._pending = ""
        self._seen_marker = False

    def feed(self, text: str) -> tuple[str, str]:
        buf, self._pending = self._pending + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self._state in ("outside", "between"):
                at = buf.find(CHANNEL)
                if at < 0:
                    keep = held_back(buf, *MARKERS)
                    if self._state == "outside" and not self._seen_marker:  # plain text: the answer
                        content.append(buf[: len(buf) - keep])
                    self._pending = buf[len(buf) - keep :] if keep else ""
                    break
                if self._state == "outside" and not self._seen_marker:
                    content.append(buf[:at])
                self._seen_marker = True
                self._state, self._channel, buf = "header", "", buf[at + len(CHANNEL) :]
            elif self._state == "header":
                at = buf.find(MESSAGE)
                if at < 0:
                    self._pending = buf
                    break
                self._channel = (self._channel + buf[:at]).strip()
                self._state, buf = "body", buf[at + len(MESSAGE) :]
                if self._is_call():
                    content.append(f"{CHANNEL}{self._channel}{MESSAGE}")
            else:  # body
                ends = [(buf.find(e), e) for e in ENDS if e in buf]
                if not ends:
                    keep = held_back(buf, *MARKERS)
                    self._route(buf[: len(buf) - keep], reasoning, content)
                    self._pending = buf[len(buf) - keep :] if keep else ""
                    break
                at, end = min(ends)
                self._route(buf[:at], reasoning, content)
                if self._is_call():
                    content.append("<|call|>")
                self._state, buf = "between", buf[at + len(end) :]
        return "".join(reasoning), "".join(content)

    def _is_call(self) -> bool:
        return self._channel.startswith("commentary") and CALL.search(self._channel) is not None

    def _route(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if not text:
            return
        (reasoning if self._channel.startswith("analysis") else content).append(text)

    def finish(self) -> tuple[str, str]:
        rest, self._pending = self._pending, ""
        if self._state == "body":
            reasoning: list[str] = []
            content: list[str] = []
            self._route(rest, reasoning, content)
            return "".join(reasoning), "".join(content)
        return ("", rest) if self._state == "outside" and not self._seen_marker else ("", "")
