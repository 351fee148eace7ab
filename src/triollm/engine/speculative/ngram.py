"""Prompt lookup: draft tokens for a sequence from its own earlier tokens.

The sequence's last ``n`` tokens, for ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, are looked up among its earlier n-grams; at the first (longest)
hit, the tokens that followed the latest earlier occurrence are proposed. Where they
run into the sequence's end, the match says the sequence repeats with period ``end of
sequence - end of occurrence``, and the proposal continues that period.

Each sequence keeps an index (n-gram -> where it last ended), filled as the sequence
grows, at most ``INDEX_PER_CALL`` positions per call: a client's prompt length never
makes one step's lookup longer (a prompt not indexed yet only finds fewer matches
for a few steps). No torch, no event loop.
"""

from __future__ import annotations

__all__ = ["INDEX_PER_CALL", "NgramIndex"]

#: Positions indexed at most per ``propose`` call.
INDEX_PER_CALL = 512


class NgramIndex:
    """One sequence's n-grams of ``min_n`` to ``max_n`` tokens, by where each last
    ended. The sequence only grows (tokens are never changed), so entries stay true."""

    __slots__ = ("_indexed", "_last", "max_n", "min_n")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._last: dict[tuple[int, ...], int] = {}
        #: The n-grams ending before this position are in the index.
        self._indexed = 0

    @property
    def num_indexed(self) -> int:
        return self._indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens predicted to follow ``tokens`` (empty: no match)."""
        length = len(tokens)
        # Only n-grams ending before the last token: the last one is what is looked up.
        stop = min(length - 1, self._indexed + INDEX_PER_CALL)
        last, low, high = self._last, self.min_n, self.max_n
        for end in range(self._indexed, stop):
            for n in range(low, min(high, end + 1) + 1):
                last[tuple(tokens[end + 1 - n:end + 1])] = end
        self._indexed = max(self._indexed, stop)
        if k < 1:
            return []
        for n in range(min(high, length), low - 1, -1):
            found = last.get(tuple(tokens[length - n:]))
            if found is not None:
                period = length - 1 - found
                return [tokens[found + 1 + i % period] for i in range(k)]
        return []
