"""The stop strings' automaton: the stop string it finds is the one a search of the
whole text finds, however the text arrives, and its work per character does not grow
with the number of stop strings."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from triollm.engine.detokenizer import IncrementalDetokenizer
from triollm.engine.stop_strings import StopStrings

words = st.text(alphabet="abc", min_size=1, max_size=4)


def first_stop(stops: list[str], text: str) -> tuple[int, int] | None:
    """(end, length) of the stop string that ends first in ``text``, the longest of
    those that end there; by searching for every occurrence of each."""
    best: tuple[int, int] | None = None
    for stop in stops:
        index = text.find(stop)
        while index != -1:
            candidate = (index + len(stop), -len(stop))
            if best is None or candidate < best:
                best = candidate
            index = text.find(stop, index + 1)
    return None if best is None else (best[0], -best[1])


@given(st.lists(words, min_size=1, max_size=6), st.text(alphabet="abcd", max_size=16),
       st.lists(st.integers(1, 4), min_size=16, max_size=16))
def test_the_first_stop_to_end_is_found_however_the_text_is_split(
        stops: list[str], text: str, cuts: list[int]) -> None:
    automaton = StopStrings(stops)
    state, start, found = 0, 0, None
    for size in cuts:
        piece = text[start:start + size]
        if not piece:
            break
        state, match = automaton.scan(state, piece)
        if match is not None:
            found = (start + match.end, match.length)
            break
        start += size
    assert found == first_stop(stops, text)


class CountingDict(dict[int, int]):
    lookups = 0

    def get(self, key: int, default: Any = None) -> Any:
        type(self).lookups += 1
        return super().get(key, default)


@pytest.mark.parametrize("count", [1, 1000])
def test_the_work_per_character_does_not_grow_with_the_stop_strings(count: int) -> None:
    """A character costs one transition plus failure moves, which it pays at most once
    for each earlier character: at most two table lookups per character, with one stop
    string or a thousand."""
    stops = [f"zq{i}x" for i in range(count)] + ["STOP"]
    automaton = StopStrings(stops)
    automaton._next = CountingDict(automaton._next)
    text = "zq1zq12zq STO zq999 hello " * 40 + "STOP"
    CountingDict.lookups = 0
    _, match = automaton.scan(0, text)
    assert match is not None and match.end == len(text)
    assert CountingDict.lookups <= 2 * len(text)
    assert automaton.max_length == max(map(len, stops))


def test_a_stop_string_begun_before_min_tokens_is_found_after(tokenizer: Any) -> None:
    """Text added while stops are not checked still moves the automaton, so a stop
    string that ends once checks start is found, as a search over the text would."""
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["abcd"])
    for token in tokenizer.encode("xx ab", add_special_tokens=False):
        assert detok.append_token(token, check_stop=False) is None
    stop = None
    for token in tokenizer.encode("cd yy", add_special_tokens=False):
        stop = stop or detok.append_token(token)
    assert stop == "abcd" and detok.output_text.endswith("xx ")
