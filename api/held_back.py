"""How much of a streamed text's end must wait before it is sent: it may still become a tag."""

from __future__ import annotations


def held_back(text: str, *tags: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of one of ``tags`` (``</think>``,
    a tool call's trigger, harmony's markers): those characters may yet complete it."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:n]):
                longest = n
                break
    return longest
