"""Streaming stop strings: what is emitted, whatever the deltas, is vLLM's final text."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtool import VtoolError
from vtool.runtime.sampling.stop_strings import StopStringMatcher

# A small alphabet so stop strings actually occur, overlap and prefix each other; with
# multi-code-point and astral characters for unicode.
ALPHABET = st.sampled_from(list("aab") + ["é", "😀", "\n", " ", "e\u0301"])
TEXT = st.lists(ALPHABET, max_size=30).map("".join)
STOP = st.lists(st.lists(ALPHABET, min_size=1, max_size=4).map("".join), min_size=1, max_size=4)


def reference(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """Final text: cut at the stop string that completes first (ties: the longest)."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stop if s in text]
    if not hits:
        return text, None
    end, start, s = min(hits)
    return text[: end if include else start], s


@st.composite
def split(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream(deltas: list[str], stop: list[str], include: bool) -> tuple[str, bool, StopStringMatcher]:
    m = StopStringMatcher(stop, include)
    out, stopped, fed = [], False, ""
    for d in deltas:
        text, now = m.push(d)
        fed += d
        if stopped:
            assert text == "" and now, "text emitted after the stop string"
        out.append(text)
        stopped = stopped or now
        if not stopped:
            held = fed[len("".join(out)):]
            # Only a possible start of a stop string is ever held back.
            assert held == "" or any(s.startswith(held) and s != held for s in stop)
    out.append(m.flush())
    return "".join(out), stopped, m


@settings(max_examples=400, deadline=None)
@given(data=st.data(), text=TEXT, stop=STOP, include=st.booleans())
def test_streamed_output_equals_final_text(data, text, stop, include):
    deltas = data.draw(split(text))
    emitted, stopped, m = stream(deltas, stop, include)
    want, matched = reference(text, stop, include)
    assert emitted == want
    assert stopped == (matched is not None)
    assert m.matched == matched


@settings(max_examples=100, deadline=None)
@given(data=st.data(), text=TEXT, stop=STOP, include=st.booleans())
def test_split_does_not_matter(data, text, stop, include):
    whole, _, _ = stream([text], stop, include)
    pieces, _, _ = stream(data.draw(split(text)), stop, include)
    per_char, _, _ = stream(list(text), stop, include)
    assert whole == pieces == per_char


@pytest.mark.parametrize("text, stop, include, want", [
    ("xaby", ["ab", "b"], False, "x"),  # both complete at "b": the longer one cuts
    ("bcd", ["bcd", "c"], False, "b"),  # "c" completes first, so "bcd" never can
    ("aaab", ["aab"], True, "aaab"),  # the match overlaps a held-back false start
    ("aaab", ["aab"], False, "a"),
    ("é!", ["́"], False, "e"),  # a combining mark is its own code point
])
def test_overlapping_cases(text, stop, include, want):
    for deltas in ([text], list(text)):
        assert stream(deltas, stop, include)[0] == want


def test_examples():
    m = StopStringMatcher(["</s>", "\n\n"], include_stop_str_in_output=False)
    assert m.push("Hello <") == ("Hello ", False)  # "<" could start "</s>"
    assert m.push("/b> ok") == ("</b> ok", False)
    assert m.push("</") == ("", False)
    assert m.push("s> tail") == ("", True)
    assert m.matched == "</s>"
    assert m.push("more") == ("", True)
    assert m.flush() == ""

    m = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert m.push("go ST") == ("go ", False)
    assert m.push("OP and more") == ("STOP", True)

    m = StopStringMatcher(["xyz"])
    assert m.push("abcxy") == ("abc", False)
    assert m.flush() == "xy"


def test_no_stop_strings_pass_through():
    m = StopStringMatcher([])
    assert m.push("anything") == ("anything", False)
    assert m.flush() == ""


@pytest.mark.parametrize("stop", [[""], ["ok", ""]])
def test_empty_stop_string_refused(stop):
    with pytest.raises(VtoolError, match="non-empty"):
        StopStringMatcher(stop)
