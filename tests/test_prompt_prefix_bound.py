"""A long prompt is refused from its prefix alone (server/offload.py's
``tokens_at_least``): the prefix's token count, less a margin, never exceeds the whole
text's, wherever the text is cut."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.server.limits import PREFIX_MARGIN_TOKENS
from triollm.server.offload import Offload, prefix_chars
from triollm.testing import train_test_tokenizer

TOKENIZER = train_test_tokenizer()
#: Words the tokenizer knows, runs of spaces and newlines, punctuation, and characters
#: outside its training text (accents, combining marks, CJK, emoji, Hangul jamo that NFC
#: composes).
PIECES = st.sampled_from(["hello", " world", "the", " ", "  ", "\n", "\n\n", ".", ",",
                          "'s", "é", "e\u0301", "\u1100\u1161\u11a8", "漢字", "🙂", "123",
                          "-", "ing", "\t"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES, min_size=1, max_size=120), cut=st.integers(0, 2000),
       special=st.booleans())
def test_a_prefix_never_counts_more_tokens_than_the_margin_allows(
        pieces: list[str], cut: int, special: bool) -> None:
    text = "".join(pieces)
    whole = len(TOKENIZER.encode(text, add_special_tokens=special))
    prefix = len(TOKENIZER.encode(text[:cut], add_special_tokens=special))
    assert prefix - PREFIX_MARGIN_TOKENS <= whole


@pytest.mark.anyio
async def test_a_long_text_is_counted_from_its_prefix_and_a_short_one_not_at_all() -> None:
    offload = Offload(TOKENIZER, long_text=1000)
    text = "hello world " * 2000
    enough = 100
    at_least = await offload.tokens_at_least(text, False, enough)
    prefix = len(TOKENIZER.encode(text[:prefix_chars(enough)], add_special_tokens=False))
    assert at_least == prefix - PREFIX_MARGIN_TOKENS > enough
    assert at_least <= len(TOKENIZER.encode(text, add_special_tokens=False))
    # shorter than twice the prefix: not worth a call
    assert await offload.tokens_at_least(text[:2 * prefix_chars(enough) - 1], False,
                                         enough) == 0
    with anyio.fail_after(30):
        assert await offload.tokens_at_least("hi", False, enough) == 0
