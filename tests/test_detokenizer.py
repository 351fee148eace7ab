"""Incremental detokenization: multi-byte characters split across tokens, stop strings."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from triollm.engine.detokenizer import IncrementalDetokenizer

ALPHABET = "ab cd\n,.é東京🙂Привет"


def feed(tokenizer: Any, prompt: list[int], tokens: list[int], **kwargs: Any) -> tuple[
        IncrementalDetokenizer, list[str], str | None]:
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    seen: list[str] = []
    stop = None
    for token in tokens:
        before = detok.output_text
        stop = detok.append_token(token)
        seen.append(detok.output_text[len(before):])
        if stop is not None:
            break
    return detok, seen, stop


def test_multibyte_character_split_across_tokens_appears_once_whole(tokenizer: Any) -> None:
    tokens = tokenizer.encode("🙂東")
    assert len(tokens) > 2, "byte-level BPE should split these characters"
    _, pieces, _ = feed(tokenizer, tokenizer.encode("Hi"), tokens)
    assert "".join(pieces) == "🙂東"
    assert all("\ufffd" not in piece for piece in pieces)


@given(text=st.text(alphabet=ALPHABET, min_size=1, max_size=40),
       prompt=st.text(alphabet=ALPHABET, min_size=1, max_size=10))
def test_incremental_text_equals_full_decode(tokenizer: Any, text: str, prompt: str) -> None:
    tokens = tokenizer.encode(text)
    detok, pieces, _ = feed(tokenizer, tokenizer.encode(prompt), tokens)
    assert detok.output_text == tokenizer.decode(tokens)
    assert all("\ufffd" not in piece for piece in pieces)


@given(text=st.text(alphabet=ALPHABET, min_size=4, max_size=40), data=st.data())
def test_stop_string_is_found_wherever_it_falls(tokenizer: Any, text: str,
                                               data: st.DataObject) -> None:
    start = data.draw(st.integers(0, len(text) - 1))
    length = data.draw(st.integers(1, min(6, len(text) - start)))
    stop = text[start:start + length]
    tokens = tokenizer.encode(text)
    detok, _, found = feed(tokenizer, [1], tokens, stop=[stop])
    assert found == stop
    assert detok.output_text == text[: text.index(stop)]
    kept, _, _ = feed(tokenizer, [1], tokens, stop=[stop], include_stop_str_in_output=True)
    assert kept.output_text == text[: text.index(stop) + len(stop)]


def test_streaming_holds_back_a_possible_stop_prefix(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["STOP"])
    for token in tokenizer.encode("abc ST"):
        detok.append_token(token)
    assert detok.output_text == "abc ST"
    assert detok.text_to_deliver(finished=False) == "abc"
    assert detok.text_to_deliver(finished=True) == "abc ST"
