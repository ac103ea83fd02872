"""Stop-string holdback: property tests over random texts, chunkings and stops."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from trillm.engine.scheduling.stop_strings import StopStringMatcher, earliest_stop

alphabet = st.sampled_from(list("ab c\n✓"))
texts = st.text(alphabet, max_size=40)
stops = st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=4)


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=400, deadline=None)
@given(texts, stops, st.lists(st.integers(0, 100), max_size=10))
def test_output_is_the_text_cut_before_the_first_stop(text, stop_list, cuts):
    matcher = StopStringMatcher(tuple(stop_list))
    sent = ""
    seen = ""
    for chunk in _chunks(text, cuts):
        seen += chunk
        sent += matcher.push(chunk)
        if matcher.stopped:
            break
        # Nothing but a possible stop-string start is ever held back.
        assert sent + matcher.held == seen
        assert matcher.held == "" or any(s.startswith(matcher.held) for s in stop_list)
    if not matcher.stopped:
        sent += matcher.flush()
    # The stop that completes first wins, however the text was chunked.
    ends = [(text.find(s) + len(s), text.find(s)) for s in stop_list if s in text]
    expected = text[: min(ends)[1]] if ends else text
    assert sent == expected
    assert not any(s in sent for s in stop_list)
    # The stop string named as the one found is the one the text goes on with after the cut.
    assert (
        matcher.matched is None
        if not ends
        else (matcher.matched in stop_list and text[len(sent) :].startswith(matcher.matched))
    )


def test_the_stop_that_completes_first_wins():
    assert earliest_stop("xa ab", ("a ab", " ")) == (2, " ")
    assert earliest_stop("say STOP now", ("OP", "STOP")) == (4, "STOP")
    assert earliest_stop("nothing", ("x",)) is None


def test_holds_back_only_a_possible_start():
    m = StopStringMatcher(("STOP",))
    assert m.push("hello S") == "hello "
    assert m.push("T") == ""
    assert m.push("x") == "STx"
    assert m.push("ST") == ""
    assert m.push("OP and more") == ""
    assert m.stopped and m.flush() == ""
