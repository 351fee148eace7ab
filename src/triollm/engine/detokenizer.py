"""Token ids to text, one token at a time, with stop strings.

Incremental decoding keeps two offsets into the token list (vLLM's scheme): text is
only emitted once the tokens since ``read_offset`` decode to something that does not
end in an incomplete UTF-8 sequence, so a character split across tokens appears
whole, once. Stop strings are found by an automaton fed only the newly grown text
(engine/stop_strings.py), so a step costs the same however many there are, and one
that spans several tokens is still found.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from triollm.engine.stop_strings import StopStrings

__all__ = ["IncrementalDetokenizer", "Tokenizer", "decode_text"]

_INITIAL_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (every transformers tokenizer has it).

    transformers declares ``decode`` as returning ``str | list[str]`` (a list for a
    batch); read it through ``decode_text``."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...,
               clean_up_tokenization_spaces: bool | None = ...) -> str | list[str]: ...


def decode_text(tokenizer: Tokenizer, token_ids: list[int], *,
                skip_special_tokens: bool = False,
                clean_up_tokenization_spaces: bool | None = None) -> str:
    """One sequence of token ids as text (the tokenizer's own defaults unless given)."""
    if clean_up_tokenization_spaces is None:
        text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    else:
        text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=clean_up_tokenization_spaces)
    return text if isinstance(text, str) else "".join(text)


class IncrementalDetokenizer:
    """Detokenizes one sequence's output tokens and finds its stop strings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | StopStrings | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        """``stop``: the stop strings, or their automaton (built once per request and
        shared by its samples)."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._tokens = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.stop = stop if isinstance(stop, StopStrings) else StopStrings(stop or ())
        self._stop_state = 0
        self.include_stop_str_in_output = include_stop_str_in_output
        self.output_text = ""
        #: Characters held back while streaming because they may begin a stop string.
        self.stop_buffer_length = (
            0 if include_stop_str_in_output or not self.stop else self.stop.max_length - 1
        )

    def _decode(self, token_ids: list[int]) -> str:
        return decode_text(self._tokenizer, token_ids,
                           skip_special_tokens=self._skip_special_tokens,
                           clean_up_tokenization_spaces=False)

    def append_token(self, token_id: int, *, check_stop: bool = True) -> str | None:
        """Add one token; return the stop string it completed, if any (the text is then
        cut at the stop string, after it if ``include_stop_str_in_output``)."""
        self._tokens.append(token_id)
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return None
        new_text = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        # Keep the decode window short: the text decoded so far is already settled.
        if self._prefix_offset > 64:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        previous_length = len(self.output_text)
        self.output_text += new_text
        return self._find_stop_string(previous_length, new_text, check_stop)

    def _find_stop_string(self, previous_length: int, new_text: str,
                          check_stop: bool) -> str | None:
        """The first stop string to end in ``new_text`` (the text from
        ``previous_length``); the text is then cut at it. Unchecked text still moves
        the automaton, so a stop string begun there is found once checks start."""
        if not self.stop:
            return None
        offset = 0
        while offset < len(new_text):
            self._stop_state, found = self.stop.scan(self._stop_state, new_text, offset)
            if found is None:
                return None
            offset = found.end
            if check_stop:
                end = previous_length + offset
                stop = self.output_text[end - found.length:end]
                self.output_text = self.output_text[
                    :end if self.include_stop_str_in_output else end - found.length]
                return stop
        return None

    def text_to_deliver(self, finished: bool) -> str:
        """The text a caller may see now: all of it once finished, otherwise all but a
        tail that could still turn out to be the start of a stop string."""
        if finished or not self.stop_buffer_length:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self.stop_buffer_length)]
