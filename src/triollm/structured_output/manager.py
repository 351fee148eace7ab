"""``StructuredOutputManager``: the engine's side of constrained decoding. It compiles a
request's constraint before the request enters the engine (``LLM`` inline, the async
engine in a worker thread), logs each grammar's backend and compile time, counts the
cache's hits and misses, and holds the reasoning parser whose end of reasoning the
constraints wait for."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from triollm.config import StructuredOutputsConfig
from triollm.reasoning.abstract import ReasoningParser, ReasoningParserManager
from triollm.sampling_params import SamplingParams
from triollm.structured_output.compiler import GrammarCacheStatistics, GrammarCompiler
from triollm.structured_output.grammar import CompiledGrammar

__all__ = ["StructuredOutputManager"]

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    """One engine's compiler and reasoning parser (over its Hugging Face tokenizer,
    logits ``vocab_size`` wide, ``eos_token_ids`` ending a complete grammar)."""

    def __init__(self, config: StructuredOutputsConfig, tokenizer: Any, vocab_size: int,
                 eos_token_ids: Iterable[int]) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self.compiler = (None if tokenizer is None else
                         GrammarCompiler(config, tokenizer, vocab_size, eos_token_ids))
        self._parser: ReasoningParser | None = None
        self._parser_lock = threading.Lock()
        if config.reasoning_parser is not None and tokenizer is not None:
            self._check_reasoning_parser(config.reasoning_parser)

    def _check_reasoning_parser(self, name: str) -> None:
        """A parser this tokenizer cannot serve (no ``<think>`` token) is refused when
        the engine starts, naming the flag, not at each request."""
        try:
            parser_class = ReasoningParserManager.get_reasoning_parser(name)
        except KeyError as error:
            raise ValueError(f"reasoning_parser: {error.args[0]}") from None
        try:
            parser_class(self._tokenizer)
        except ValueError as error:
            raise ValueError(f"reasoning_parser: {error}") from None

    def compile(self, params: SamplingParams, request_id: str = "") -> CompiledGrammar | None:
        """The compiled constraint of ``params`` (None without one). ``ValueError``
        naming the field when it is invalid. Blocks while it compiles: call it off the
        event loop."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        if self.compiler is None:
            raise ValueError("structured_outputs: this engine has no tokenizer to compile "
                             "a constraint for")
        grammar, cached = self.compiler.compile(constraint)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s structured outputs (%s): %s grammar %s", request_id or "request",
                         grammar.kind, grammar.backend,
                         "from the cache" if cached
                         else f"compiled in {grammar.compile_seconds * 1000:.1f} ms")
        return grammar

    def reasoning_parser(self) -> ReasoningParser | None:
        """The parser whose end of reasoning constraints wait for (None: constraints
        apply from the first output token)."""
        name = self.config.reasoning_parser
        if name is None or self.config.enable_in_reasoning:
            return None
        with self._parser_lock:
            if self._parser is None:
                try:
                    parser_class = ReasoningParserManager.get_reasoning_parser(name)
                except KeyError as error:
                    raise ValueError(f"structured_outputs_config.reasoning_parser: "
                                     f"{error.args[0]}") from None
                self._parser = parser_class(self._tokenizer)
            return self._parser

    def statistics(self) -> GrammarCacheStatistics:
        """Compiled-grammar cache hits and misses since the engine started."""
        if self.compiler is None:
            return GrammarCacheStatistics(0, 0, 0)
        return self.compiler.statistics()
