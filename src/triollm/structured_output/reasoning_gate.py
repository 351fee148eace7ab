"""``ReasoningGate``: when a model reasons first (a reasoning parser is configured), its
output is constrained only once the reasoning has ended, as in vLLM. Pure: no torch."""

from __future__ import annotations

from collections.abc import Sequence

from triollm.reasoning.abstract import ReasoningParser

__all__ = ["ReasoningGate"]

#: How many of the latest output tokens a parser without a single end token sees.
_TAIL = 16


class ReasoningGate:
    """Asks the parser once about the prompt, then per new output token. A parser that
    names its end token (``end_token_id``, as vLLM's think-tag parsers do) is asked
    nothing per token: the gate compares ids."""

    __slots__ = ("_end_token_id", "_parser", "ended_in_prompt")

    def __init__(self, parser: ReasoningParser, prompt_token_ids: Sequence[int]) -> None:
        self._parser = parser
        end = getattr(parser, "end_token_id", None)
        self._end_token_id = end if isinstance(end, int) and not isinstance(end, bool) else None
        self.ended_in_prompt = bool(parser.is_reasoning_end(prompt_token_ids))

    def ends_at(self, output_token_ids: Sequence[int]) -> bool:
        """Whether the reasoning ends with the last of ``output_token_ids`` (a sample's
        output so far; the constraint applies from the next token)."""
        if not output_token_ids:
            return False
        if self._end_token_id is not None:
            return output_token_ids[-1] == self._end_token_id
        return bool(self._parser.is_reasoning_end(output_token_ids[-_TAIL:]))
