"""Splitting a reply into its thinking (``reasoning_content``) and its answer (``content``).

Reasoning models write their thinking between ``<think>`` and ``</think>``. With the
``--reasoning-parser`` setting, the chat endpoint hands each choice's text deltas to a
``ReasoningParser`` and sends what it returns as ``reasoning_content`` and ``content``;
the tags themselves are never sent. The two styles, named as vLLM names them:

* ``deepseek_r1``: the chat template may already have put ``<think>`` in the prompt, so
  everything before ``</think>`` is thinking, whether or not the output opens with
  ``<think>`` (then dropped). Without any ``</think>`` the whole reply is thinking and
  ``content`` stays empty (null when not streaming), as vLLM answers.
* ``qwen3``: the model writes ``<think>`` itself, so thinking starts only when the output
  opens with it (leading whitespace allowed); any other reply is all ``content``. A reply
  cut inside the thinking (``max_tokens``) is all thinking.

In both, a ``chat_template_kwargs`` of ``{"enable_thinking": false}`` turns splitting off
for the request (the template then puts an empty think block in the prompt, and the
whole reply is the answer). After ``</think>`` everything is content, tags included, but
the blank characters that open it (templates write ``</think>\n\n``) are dropped, as SGLang does.

* ``gpt_oss``: harmony channels (``api/harmony.py``): ``analysis`` is thinking, ``final`` and
  ``commentary`` the answer; the request's text then keeps the special tokens the channels are
  marked with, and the parser takes them out.

The parser is incremental: a tag split across deltas (``"</th"`` + ``"ink>"``) is held
back until it is complete or proven not to be a tag, so no piece of a tag leaks out.
Pure: no Trio, no HTTP; the chat module calls it through ``ChoiceSplitter``.
"""

from __future__ import annotations

from typing import Any

from trillm.api.harmony import HarmonyParser
from trillm.api.held_back import held_back
from trillm.engine import ThinkingMode

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3", "gpt_oss")
# Where a grammar (structured output, tool calls) starts under each style: after the thinking.
# gpt-oss's thinking is a harmony channel, not a tag the grammars know: a grammar holds the whole
# reply there (tool calls are triggered, so the analysis before them stays free).
THINKING: dict[str, ThinkingMode] = {"deepseek_r1": "required", "qwen3": "optional", "gpt_oss": "none"}


class ReasoningParser:
    """One reply's text in, ``(reasoning, content)`` deltas out; ``finish`` flushes what is held."""

    def __init__(self, style: str) -> None:
        if style not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, not {style!r}")
        self.implicit_start = style == "deepseek_r1"  # thinking from the first token, <think> or not
        self._state = "start"  # start (is <think> coming?) -> reasoning -> (after_end ->) content
        self._pending = ""  # text held back: a possible tag not yet complete

    def feed(self, text: str) -> tuple[str, str]:
        """The next delta of the reply -> the new thinking and the new answer (either may be "")."""
        buf = self._pending + text
        self._pending = ""
        if self._state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(START):
                self._state, buf = "reasoning", stripped[len(START) :]
            elif START.startswith(stripped):  # only whitespace, or a start of "<think>" so far
                self._pending = buf
                return "", ""
            else:
                self._state = "reasoning" if self.implicit_start else "content"
        if self._state == "after_end":
            return "", self._answer(buf)
        if self._state == "content":
            return "", buf
        end = buf.find(END)
        if end >= 0:
            self._state = "after_end"
            return buf[:end], self._answer(buf[end + len(END) :])
        keep = held_back(buf, END)
        self._pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], ""

    def _answer(self, text: str) -> str:
        """The answer after ``</think>``: its opening blanks dropped, however they are split."""
        answer = text.lstrip()
        if answer:
            self._state = "content"
        return answer

    def finish(self) -> tuple[str, str]:
        """The reply ended: what was held back, as thinking or answer (it never became a tag)."""
        rest, self._pending = self._pending, ""
        in_reasoning = self._state == "reasoning" or (self._state == "start" and self.implicit_start)
        return (rest, "") if in_reasoning else ("", rest)


def parser_for(style: str) -> ReasoningParser | HarmonyParser:
    """The incremental parser of ``style``: the think-tag styles, or gpt-oss's harmony channels."""
    return HarmonyParser() if style == "gpt_oss" else ReasoningParser(style)


def split_reasoning(style: str, text: str) -> tuple[str, str]:
    """A whole reply -> (reasoning, content): the non-streaming form of the same rules."""
    parser = parser_for(style)
    reasoning, content = parser.feed(text)
    tail_reasoning, tail_content = parser.finish()
    return reasoning + tail_reasoning, content + tail_content


def request_style(style: str | None, chat_template_kwargs: dict[str, Any] | None) -> str | None:
    """The parser style for one request: the server's, unless the request turned thinking off."""
    if style is not None and (chat_template_kwargs or {}).get("enable_thinking") is False:
        return None
    return style


class ChoiceSplitter:
    """The chat endpoint's hook: per-choice parsers for one request, or plain ``content`` without one."""

    def __init__(self, style: str | None) -> None:
        self.style = style
        self._parsers: dict[int, ReasoningParser | HarmonyParser] = {}

    def delta(self, index: int, text: str, final: bool) -> dict[str, str]:
        """The streamed ``delta`` fields for ``text`` of choice ``index`` (``final``: its last piece).

        Without a parser, ``{"content": text}``; with one, only the non-empty fields."""
        if self.style is None:
            return {"content": text}
        parser = self._parsers.get(index) or self._parsers.setdefault(index, parser_for(self.style))
        reasoning, content = parser.feed(text)
        if final:
            tail_reasoning, tail_content = parser.finish()
            reasoning, content = reasoning + tail_reasoning, content + tail_content
        fields = {"reasoning_content": reasoning, "content": content}
        return {key: value for key, value in fields.items() if value}

    def flush(self, index: int) -> dict[str, str]:
        """The held-back end of choice ``index`` when its stream is cut short (the deadline)."""
        return self.delta(index, "", True) if self.style is not None else {}

    def message(self, text: str) -> dict[str, Any]:
        """The non-streaming ``message`` fields: ``content`` (null when empty) and ``reasoning_content``."""
        if self.style is None:
            return {"content": text}
        reasoning, content = split_reasoning(self.style, text)
        return {"content": content or None, "reasoning_content": reasoning or None}
