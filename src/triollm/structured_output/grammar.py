"""The small typed objects a compiled constraint travels as, from the engine that
compiles it to the model runner that enforces it. Pure: no torch, no grammar library
(a backend's own objects sit behind these protocols).

``CompiledGrammar`` is compiled once per constraint and shared by every request that
asks for it; ``GrammarMatcher`` is one sample's position in it, advanced token by token
by the runner; ``StructuredOutputRequest`` is what a request carries to the runner
(``ScheduledRequest.structured_output``): the grammar and, with a reasoning parser, the
gate that holds the constraint back until the reasoning has ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from triollm.structured_output.reasoning_gate import ReasoningGate

__all__ = ["CompiledGrammar", "GrammarMatcher", "StructuredOutputRequest"]


class GrammarMatcher(Protocol):
    """One sample's state in a grammar. Used from one thread at a time."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and no advance) if the grammar forbids it."""
        ...

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, from the first, the grammar accepts in turn; the
        matcher does not advance (speculative decoding checks its drafts)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a draft model's proposals)."""
        ...

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask``, a contiguous
        CPU int32 torch tensor ``[rows, ceil(vocab / 32)]``: bit ``t % 32`` of word
        ``t // 32`` is set when token ``t`` is allowed. Once the grammar is complete
        only the end-of-sequence tokens are allowed."""
        ...

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and an end-of-sequence token was accepted."""
        ...


class CompiledGrammar(Protocol):
    """A constraint compiled for one engine's tokenizer; read-only, shared."""

    #: The backend that compiled it: ``xgrammar`` or ``guidance``.
    backend: str
    #: What the constraint was: json, regex, choice, grammar, json_object, structural_tag.
    kind: str
    #: Seconds its compilation took.
    compile_seconds: float

    def matcher(self) -> GrammarMatcher:
        """A new matcher at the grammar's start."""
        ...


@dataclass(frozen=True, slots=True)
class StructuredOutputRequest:
    """A request's constraint as the runner sees it (shared by its ``n`` samples; the
    runner keeps one matcher per sample)."""

    grammar: CompiledGrammar
    #: None: the constraint applies from the first output token.
    reasoning: ReasoningGate | None = None

    @property
    def constrained_from_start(self) -> bool:
        """Whether the first output token is already constrained."""
        return self.reasoning is None or self.reasoning.ended_in_prompt
