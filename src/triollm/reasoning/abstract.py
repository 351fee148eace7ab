"""The reasoning-parser interface and its registry (vLLM's ``ReasoningParser`` and
``ReasoningParserManager``): a parser splits a model's reasoning (``<think>...``) from
its answer, whole or while it streams, and tells the engine from token ids when the
reasoning has ended (structured outputs apply after it). Pure text work: no torch, no
event loop."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from triollm.parser_registry import ParserRegistry, run_plugin_file
from triollm.tool_parsers.types import DeltaMessage

__all__ = ["ReasoningParser", "ReasoningParserManager"]


class ReasoningParser:
    """Base class over the served model's Hugging Face tokenizer. One instance per
    choice of one request when streaming; ``is_reasoning_end`` keeps no state.

    ``chat_template_kwargs`` are the request's (``enable_thinking`` among them).

    ``start_token_id`` and ``end_token_id`` are the single tokens that open and close
    the reasoning, or None where no one token does. They let the engine follow a
    request token by token without decoding: the reasoning is over for a request whose
    prompt gives ``is_reasoning_end(prompt_token_ids)``, or once it samples
    ``end_token_id``; structured outputs apply from the token after it.
    """

    start_token_id: int | None = None
    end_token_id: int | None = None

    def __init__(self, tokenizer: Any, *,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.model_tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @property
    def vocab(self) -> dict[str, int]:
        return dict(self.model_tokenizer.get_vocab())

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the reasoning is over at the end of ``input_ids`` (a prompt, or a
        prompt and the output so far)."""
        raise NotImplementedError

    def extract_content_ids(self, input_ids: Sequence[int]) -> list[int]:
        """The ids of the answer after the reasoning."""
        raise NotImplementedError

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, content); either may be None."""
        raise NotImplementedError

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """What the newest text adds: ``reasoning_content``, ``content``, or None."""
        raise NotImplementedError


_Parser = TypeVar("_Parser", bound=type[ReasoningParser])
_REGISTRY = ParserRegistry("reasoning parser", ReasoningParser)


class ReasoningParserManager:
    """Parsers by name (``--reasoning-parser NAME``); ``--reasoning-parser-plugin FILE``
    loads a file that registers more with ``register_module``."""

    reasoning_parsers: dict[str, type[ReasoningParser]] = _REGISTRY.parsers

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        return _REGISTRY.get(name)

    @classmethod
    def register_module(cls, name: str | Sequence[str] | None = None, force: bool = True,
                        module: type[ReasoningParser] | None = None
                        ) -> Callable[[_Parser], _Parser] | type[ReasoningParser]:
        """Register a parser class under ``name`` (or its class name), as a decorator or
        directly with ``module``."""
        register = _REGISTRY.register(name, force)
        return register if module is None else register(module)

    @classmethod
    def import_reasoning_parser(cls, plugin_path: str) -> None:
        """Run the Python file ``plugin_path``, whose ``register_module`` calls add its
        parsers."""
        run_plugin_file(plugin_path)
