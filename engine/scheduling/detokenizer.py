"""Incremental detokenization that never splits a character or a word piece badly.

Decoding token by token breaks multi-byte UTF-8 characters split across tokens
and drops spaces that depend on the previous token. Instead we decode a small
window ending at the newest token and emit only the text that the window adds
once it no longer ends in an incomplete character.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens used as left context for the first pieces


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that concatenate exactly."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def push(self, token: int) -> str:
        """Add one token; return the new text it completes (possibly empty)."""
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation, emit whatever was held back (even a lone byte)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
