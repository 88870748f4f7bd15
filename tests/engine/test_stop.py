"""StopChecker: stop strings on streamed text, never partially emitted, however split."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.stop import StopChecker, StopResult


def reference(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """text cut at the stop string that completes first (the longest on a tie)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return (text, None) if best is None else (text[: best[1]], best[2])


def stream(checker: StopChecker, pieces: Sequence[str]) -> tuple[list[str], StopResult | None]:
    """Push pieces until a stop; the emitted chunks (with the flush) and the stopping result."""
    emitted: list[str] = []
    for piece in pieces:
        result = checker.push(piece)
        emitted.append(result.text)
        if result.stopped:
            return emitted, result
    emitted.append(checker.flush())
    return emitted, None


def test_no_stop_strings_pass_text_through() -> None:
    checker = StopChecker(())
    assert checker.push("hello") == StopResult("hello", False, None)
    assert checker.flush() == ""


def test_match_in_one_push_excludes_the_stop_string() -> None:
    checker = StopChecker(("STOP",))
    assert checker.push("hello STOP world") == StopResult("hello ", True, "STOP")
    assert checker.is_stopped
    assert checker.flush() == ""


def test_stop_string_split_across_many_pushes_is_never_emitted() -> None:
    checker = StopChecker(("</answer>",))
    emitted, result = stream(checker, ["The answer is 42", " <", "/", "an", "sw", "er", "> more"])
    assert "".join(emitted) == "The answer is 42 "
    assert result == StopResult("", True, "</answer>")
    # No chunk ever showed a piece of the stop string.
    assert all("<" not in chunk for chunk in emitted)


def test_held_text_is_released_when_the_stop_string_does_not_complete() -> None:
    checker = StopChecker(("</answer>",))
    assert checker.push("x </an") == StopResult("x ", False, None)
    assert checker.push("d") == StopResult("</and", False, None)
    assert checker.push(" </") == StopResult(" ", False, None)
    assert checker.flush() == "</"
    assert checker.flush() == ""


def test_push_after_stop_is_an_error() -> None:
    checker = StopChecker(("\n",))
    assert checker.push("a\nb").stopped
    with pytest.raises(RuntimeError):
        checker.push("more")


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError):
        StopChecker(("ok", ""))


@pytest.mark.parametrize(
    ("stops", "text", "expected", "matched"),
    [
        (("abcd", "bc"), "xabcd", "xa", "bc"),  # "bc" completes first
        (("bc", "abc"), "xabc", "x", "abc"),  # both complete at "c": the longest wins
        (("ab", "abc"), "xabc", "x", "ab"),
        (("aab",), "aaab", "a", "aab"),  # self-overlapping: "aa" held, then "aaa"
        (("abab",), "abababx", "", "abab"),
        (("ba", "ab"), "cab", "c", "ab"),
    ],
)
def test_overlapping_stop_strings(
    stops: tuple[str, ...], text: str, expected: str, matched: str
) -> None:
    assert reference(text, stops) == (expected, matched)
    for pieces in ([text], list(text), [text[:2], text[2:]], [text[:-1], text[-1:]]):
        emitted, result = stream(StopChecker(stops), pieces)
        assert "".join(emitted) == expected, pieces
        assert result is not None and result.matched == matched


def test_work_per_push_is_bounded_by_the_new_text() -> None:
    checker = StopChecker(("x" * 200 + "y",))
    for _ in range(1000):
        checker.push("x" * 50)
    # Only the longest possible prefix (200 characters) is ever held, not the whole output.
    assert len(checker.flush()) == 200


ALPHABET = "ab\n"


@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_stream_equals_text_cut_at_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    expected, matched = reference(text, stops)
    checker = StopChecker(tuple(stops))
    emitted, result = stream(checker, pieces)
    assert "".join(emitted) == expected
    assert (result.matched if result else None) == matched
    # Every prefix of the stream was a prefix of the final answer: nothing was taken back.
    for k in range(len(emitted)):
        assert expected.startswith("".join(emitted[: k + 1]))
