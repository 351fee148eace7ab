"""The llguidance backend (vLLM's ``guidance``): JSON schema, regex, choice, Lark and
GBNF grammars, structural tags, and ``whitespace_pattern``."""

from __future__ import annotations

import array
import json
import time
from collections.abc import Iterable
from typing import Any

import llguidance
import llguidance.hf

from triollm.structured_output.backend import (
    GrammarOptions,
    UnsupportedConstraint,
    close_objects,
    schema_of,
    structural_tag_of,
)
from triollm.structured_output.params import StructuredOutputsParams

__all__ = ["GuidanceBackend", "GuidanceGrammar", "GuidanceMatcher"]


class GuidanceMatcher:
    """One sample's ``LLMatcher``."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.is_error():
            return False
        return bool(self._matcher.consume_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def validate_tokens(self, token_ids: list[int]) -> int:
        if self._matcher.is_error():
            return 0
        return int(self._matcher.validate_tokens(token_ids))

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        row_bytes = bitmask.stride(0) * 4
        # The mask is computed in Rust with the GIL released.
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes,
                                              row_bytes)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())


class GuidanceGrammar:
    """A compiled llguidance grammar: a matcher at its start, which new matchers copy
    (building one parses and compiles the grammar; a copy costs microseconds)."""

    backend = "guidance"

    def __init__(self, prototype: llguidance.LLMatcher, kind: str,
                 compile_seconds: float) -> None:
        self._prototype = prototype
        self.kind = kind
        self.compile_seconds = compile_seconds

    def matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._prototype.deep_copy())


class GuidanceBackend:
    """llguidance over the engine's tokenizer (logits width ``vocab_size``; the
    engine's ``eos_token_ids`` end a complete grammar)."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids) or None)
        self._mask_words = (vocab_size + 31) // 32

    def compile(self, params: StructuredOutputsParams, options: GrammarOptions
                ) -> GuidanceGrammar:
        started = time.perf_counter()
        grammar = self._serialize(params, options)
        prototype = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise ValueError(str(prototype.get_error()).strip())
        # The first mask builds the lexer state every copy shares (a second or more for
        # some regexes): here, in the compile thread, not in the runner's step where it
        # would hold up every request. On a copy: a prototype that computed a mask makes
        # each of its copies compute theirs slowly.
        first = prototype.deep_copy()
        mask = array.array("i", bytes(4 * self._mask_words))
        # (compute_bitmask would hold the GIL all along: this call lets it go)
        first.unsafe_compute_mask_ptr(mask.buffer_info()[0], 4 * self._mask_words)
        if first.is_error():
            raise ValueError(str(first.get_error()).strip())
        return GuidanceGrammar(prototype, params.kind, time.perf_counter() - started)

    def _serialize(self, params: StructuredOutputsParams, options: GrammarOptions) -> str:
        kind = params.kind
        if kind in ("json", "json_object"):
            return self._json_grammar(self._schema(schema_of(params), options))
        if kind == "regex":
            assert params.regex is not None
            return str(llguidance.grammar_from("regex", params.regex))
        if kind == "choice":
            return str(llguidance.grammar_from("choice", json.dumps(params.choice)))
        if kind == "grammar":
            assert params.grammar is not None
            return str(llguidance.grammar_from("grammar", params.grammar))
        tag = structural_tag_of(params)
        if "format" in tag:
            raise UnsupportedConstraint("guidance takes vLLM's structures/triggers "
                                        "structural tags, not xgrammar's format")
        tags = [llguidance.StructTag(
            trigger=next(t for t in tag["triggers"] if item["begin"].startswith(t)),
            begin=item["begin"], grammar=self._schema(item["schema"], options),
            end=item["end"]) for item in tag["structures"]]
        return str(llguidance.StructTag.to_grammar(tags))

    @staticmethod
    def _schema(schema: Any, options: GrammarOptions) -> Any:
        """The schema with the options as llguidance reads them (``x-guidance``)."""
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, dict):
            return schema
        if options.disable_additional_properties:
            close_objects(schema)
        settings: dict[str, Any] = {"whitespace_flexible": not options.disable_any_whitespace}
        if options.whitespace_pattern is not None:
            settings["whitespace_pattern"] = options.whitespace_pattern
        return {**schema, "x-guidance": {**settings, **schema.get("x-guidance", {})}}

    @staticmethod
    def _json_grammar(schema: Any) -> str:
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema))
        except (TypeError, KeyError) as error:
            raise ValueError(str(error)) from None
