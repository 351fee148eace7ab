"""A request's stop strings as one automaton (Aho-Corasick): the text a step adds is
scanned once, character by character, however many stop strings there are.

The automaton reports the first position at which any stop string ends, and there the
longest one ending at it, so the answer does not depend on how the text arrived in
steps. Its state carries over between steps: a stop string split across tokens is found.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["StopMatch", "StopStrings"]

#: Keys of the transition table: ``state * _CODES + ord(character)``.
_CODES = 0x110000


class StopMatch(NamedTuple):
    """A stop string found in a scanned text: it ends just before ``end``."""

    end: int
    length: int


class StopStrings:
    """The automaton of a set of non-empty stop strings; immutable once built, so the
    samples of one request share it. State 0 is the start."""

    def __init__(self, strings: Iterable[str]) -> None:
        self.strings = tuple(dict.fromkeys(s for s in strings if s))
        #: The longest stop string's length (0 for none).
        self.max_length = max(map(len, self.strings), default=0)
        self._next: dict[int, int] = {}
        depth = [0]
        for string in self.strings:
            state = 0
            for char in string:
                key = state * _CODES + ord(char)
                target = self._next.get(key)
                if target is None:
                    target = self._next[key] = len(depth)
                    depth.append(depth[state] + 1)
                state = target
        terminal = [False] * len(depth)
        for string in self.strings:
            terminal[self._walk(string)] = True
        self._fail = [0] * len(depth)
        #: The length of the longest stop string ending at each state (0: none).
        self._match = [0] * len(depth)
        children: dict[int, list[tuple[int, int]]] = {}
        for key, target in self._next.items():
            children.setdefault(key // _CODES, []).append((key % _CODES, target))
        queue = deque([0])
        while queue:
            state = queue.popleft()
            for code, child in children.get(state, ()):
                if state:
                    self._fail[child] = self._advance(self._fail[state], code)
                fallback = self._match[self._fail[child]]
                self._match[child] = depth[child] if terminal[child] else fallback
                queue.append(child)

    def _walk(self, string: str) -> int:
        state = 0
        for char in string:
            state = self._next[state * _CODES + ord(char)]
        return state

    def _advance(self, state: int, code: int) -> int:
        while True:
            target = self._next.get(state * _CODES + code)
            if target is not None:
                return target
            if state == 0:
                return 0
            state = self._fail[state]

    def __bool__(self) -> bool:
        return bool(self.strings)

    def scan(self, state: int, text: str, start: int = 0) -> tuple[int, StopMatch | None]:
        """Feed ``text[start:]`` from ``state``: the state after it, and the first stop
        string that ends in it (the state is then the one after that stop string's end;
        ``end`` is an index into ``text``)."""
        match = self._match
        for index in range(start, len(text)):
            state = self._advance(state, ord(text[index]))
            if match[state]:
                return state, StopMatch(index + 1, match[state])
        return state, None
