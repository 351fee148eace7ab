"""Reasoning between ``<think>`` and ``</think>``: the shared logic of the
``deepseek_r1`` and ``qwen3`` parsers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from triollm.reasoning.abstract import ReasoningParser
from triollm.tool_parsers.types import DeltaMessage

__all__ = ["ThinkTagReasoningParser", "single_token_id"]


def single_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` when the vocabulary holds it as one token, else None."""
    try:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
            return None
        return int(token_id)
    except (KeyError, TypeError, ValueError, IndexError):
        return None


class ThinkTagReasoningParser(ReasoningParser):
    """The reasoning runs from ``start_token`` (in the output, or at the end of the
    prompt where the chat template put it) to ``end_token``; the answer follows.

    Text before a ``start_token`` in the output is dropped, as in vLLM. An output with
    no ``end_token`` is unfinished reasoning (``unfinished``). Streaming sends, of
    ``extract_reasoning`` applied to the text so far, what the previous text did not
    already give, so a stream adds up to the whole output's split.
    """

    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer: Any, *,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs=chat_template_kwargs)
        self.start_token_id = single_token_id(tokenizer, self.start_token)
        self.end_token_id = single_token_id(tokenizer, self.end_token)
        if self.start_token_id is None or self.end_token_id is None:
            raise ValueError(f"reasoning parser {type(self).__name__}: the tokenizer has no "
                             f"single {self.start_token!r} and {self.end_token!r} tokens")

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        # The last tag decides: a multi-turn prompt holds earlier turns' </think>, and
        # a template that opens this turn's reasoning ends the prompt with <think>.
        backwards = list(input_ids)[::-1]
        end = _index(backwards, self.end_token_id)
        return end != -1 and not -1 < _index(backwards, self.start_token_id) < end

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        ids = list(input_ids)
        start = _index(ids[::-1], self.start_token_id)
        after_start = 0 if start == -1 else len(ids) - start
        end = _index(ids, self.end_token_id, after_start)
        return [] if end == -1 else ids[end + 1:]

    def unfinished(self, text: str) -> tuple[str | None, str | None]:
        """The split of an output with no ``end_token``: all reasoning."""
        return text, None

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        before, start, after = model_output.partition(self.start_token)
        text = after if start else before
        reasoning, end, content = text.partition(self.end_token)
        if not end:
            return self.unfinished(text)
        return reasoning, content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        old_reasoning, old_content = self.extract_reasoning(previous_text, None)
        reasoning, content = self.extract_reasoning(current_text, None)
        new_reasoning = _extension(old_reasoning or "", reasoning or "")
        new_content = _extension(old_content or "", content or "")
        if new_reasoning is None and new_content is None:
            return None
        return DeltaMessage(reasoning_content=new_reasoning, content=new_content)


def _extension(old: str, new: str) -> str | None:
    if len(new) > len(old) and new.startswith(old):
        return new[len(old):]
    return None


def _index(ids: list[int], token: int | None, start: int = 0) -> int:
    """Where ``token`` first is in ``ids[start:]`` (list.index: a C loop), or -1."""
    try:
        return ids.index(token, start) if token is not None else -1
    except ValueError:
        return -1
