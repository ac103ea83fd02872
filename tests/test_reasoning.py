"""The reasoning parser (``api/reasoning.py``) on synthetic deltas: every way of cutting a
reply into pieces must give the same split as the whole reply, and no piece of a tag."""

from __future__ import annotations

import itertools

import pytest

from trillm.api.reasoning import ChoiceSplitter, ReasoningParser, request_style, split_reasoning

# (reply, deepseek_r1 split, qwen3 split), each split (reasoning, content)
CASES = [
    ("<think>I add.</think>It is 4.", ("I add.", "It is 4."), ("I add.", "It is 4.")),
    ("\n <think>\nhm\n</think>\n\nYes", ("\nhm\n", "Yes"), ("\nhm\n", "Yes")),
    ("<think>a</think> \n", ("a", ""), ("a", "")),
    ("<think>a</think>\n b \n", ("a", "b \n"), ("a", "b \n")),
    ("I add.</think>It is 4.", ("I add.", "It is 4."), ("", "I add.</think>It is 4.")),
    ("It is 4.", ("It is 4.", ""), ("", "It is 4.")),
    ("<think>cut short by max_tok", ("cut short by max_tok", ""), ("cut short by max_tok", "")),
    (
        "<think>a < b, </thin k> is no tag</think>",
        ("a < b, </thin k> is no tag", ""),
        ("a < b, </thin k> is no tag", ""),
    ),
    ("<think></think>", ("", ""), ("", "")),
    ("<think>x</think>A <think>again</think>", ("x", "A <think>again</think>"), ("x", "A <think>again</think>")),
    ("<thinking>", ("<thinking>", ""), ("", "<thinking>")),
    ("<thin", ("<thin", ""), ("", "<thin")),  # ended while it still looked like a tag
    ("x</thi", ("x</thi", ""), ("", "x</thi")),
    ("  ", ("  ", ""), ("", "  ")),
    ("", ("", ""), ("", "")),
    ("<think>é😀</think>ü", ("é😀", "ü"), ("é😀", "ü")),
]


def _stream(style: str, pieces: list[str]) -> tuple[list[tuple[str, str]], tuple[str, str]]:
    parser = ReasoningParser(style)
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.finish())
    return deltas, ("".join(d[0] for d in deltas), "".join(d[1] for d in deltas))


def _cuts(text: str, parts: int) -> list[list[str]]:
    """Every way of cutting ``text`` into ``parts`` pieces (empty pieces included)."""
    return [
        [text[a:b] for a, b in zip((0, *cut), (*cut, len(text)))]
        for cut in itertools.combinations_with_replacement(range(len(text) + 1), parts - 1)
    ]


@pytest.mark.parametrize("style", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize(("text", "r1", "qwen3"), CASES)
def test_every_cut_gives_the_whole_reply_split(style, text, r1, qwen3):
    expected = r1 if style == "deepseek_r1" else qwen3
    assert split_reasoning(style, text) == expected
    cuts = _cuts(text, 3) + [list(text)]  # two cuts anywhere, and one character at a time
    for pieces in cuts:
        deltas, joined = _stream(style, pieces)
        assert joined == expected, pieces
        for delta, whole in zip(zip(*deltas), expected):  # no delta carries a tag that was one
            assert all("think>" not in piece for piece in delta) or "think>" in whole, (pieces, delta)


def test_tag_pieces_are_held_back_then_released():
    parser = ReasoningParser("qwen3")
    assert parser.feed(" <th") == ("", "")  # could still open the thinking
    assert parser.feed("ink>step one ") == ("step one ", "")
    assert parser.feed("</") == ("", "")  # could still close it
    assert parser.feed("b> is html ") == ("</b> is html ", "")
    assert parser.feed("</think") == ("", "")
    assert parser.feed(">\n") == ("", "")  # the blanks that open the answer are dropped
    assert parser.feed("\nDone") == ("", "Done")
    assert parser.feed("</think>") == ("", "</think>")  # after the thinking, tags are answer text
    assert parser.finish() == ("", "")


def test_qwen3_reply_that_does_not_open_with_think_is_all_content_at_once():
    parser = ReasoningParser("qwen3")
    assert parser.feed("Hello") == ("", "Hello")
    assert parser.feed(" <think>x</think>") == ("", " <think>x</think>")


def test_unknown_style_is_refused():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningParser("r2")


def test_enable_thinking_false_turns_splitting_off():
    assert request_style("qwen3", {"enable_thinking": False}) is None
    assert request_style("deepseek_r1", {"enable_thinking": True}) == "deepseek_r1"
    assert request_style("qwen3", None) == "qwen3"
    assert request_style(None, {"enable_thinking": True}) is None


def test_choice_splitter_fields():
    off = ChoiceSplitter(None)
    assert off.delta(0, "<think>x", False) == {"content": "<think>x"}
    assert off.message("<think>x</think>y") == {"content": "<think>x</think>y"}
    assert off.flush(0) == {}
    on = ChoiceSplitter("deepseek_r1")
    assert on.delta(0, "a</th", False) == {"reasoning_content": "a"}
    assert on.delta(1, "b", False) == {"reasoning_content": "b"}  # each choice has its own parser
    assert on.delta(0, "ink>c", True) == {"content": "c"}
    assert on.delta(1, "</thi", False) == {}
    assert on.flush(1) == {"reasoning_content": "</thi"}  # cut by the deadline: what was held back
    assert on.message("r</think>") == {"content": None, "reasoning_content": "r"}
    assert on.message("<think>r</think>c") == {"content": "c", "reasoning_content": "r"}
