"""The xgrammar backend (vLLM's default): JSON schema, regex, choice, EBNF/GBNF
grammars (not Lark: those go to guidance) and structural tags. JSON objects are strict
(no properties a schema does not list), as xgrammar compiles them in vLLM."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from typing import Any

import xgrammar

from triollm.structured_output.backend import (
    GrammarOptions,
    UnsupportedConstraint,
    close_objects,
    looks_like_lark,
    schema_of,
    structural_tag_of,
)
from triollm.structured_output.params import StructuredOutputsParams

__all__ = ["XgrammarBackend", "XgrammarGrammar", "XgrammarMatcher"]


class XgrammarMatcher:
    """One sample's ``xgrammar.GrammarMatcher``."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XgrammarGrammar:
    """An ``xgrammar.CompiledGrammar``."""

    backend = "xgrammar"

    def __init__(self, compiled: xgrammar.CompiledGrammar, kind: str,
                 compile_seconds: float) -> None:
        self._compiled = compiled
        self.kind = kind
        self.compile_seconds = compile_seconds

    def matcher(self) -> XgrammarMatcher:
        return XgrammarMatcher(xgrammar.GrammarMatcher(self._compiled))


#: xgrammar's errors start with a timestamp and its C++ source position.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _ebnf_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class XgrammarBackend:
    """xgrammar over the engine's tokenizer (logits width ``vocab_size``; the engine's
    ``eos_token_ids`` end a complete grammar)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids) or None)
        # The engine caches compiled grammars itself.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams, options: GrammarOptions
                ) -> XgrammarGrammar:
        if options.whitespace_pattern is not None:
            raise UnsupportedConstraint("xgrammar does not take whitespace_pattern")
        started = time.perf_counter()
        try:
            compiled = self._compile(params, options)
        except (RuntimeError, TypeError) as error:
            raise ValueError(_LOG_PREFIX.sub("", str(error).strip())) from None
        return XgrammarGrammar(compiled, params.kind, time.perf_counter() - started)

    def _compile(self, params: StructuredOutputsParams, options: GrammarOptions
                 ) -> xgrammar.CompiledGrammar:
        any_whitespace = not options.disable_any_whitespace
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = schema_of(params)
            if options.disable_additional_properties:
                close_objects(schema)
            return self._compiler.compile_json_schema(json.dumps(schema),
                                                      any_whitespace=any_whitespace)
        if kind == "regex":
            assert params.regex is not None
            return self._compiler.compile_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            rule = " | ".join(_ebnf_string(choice) for choice in params.choice)
            return self._compiler.compile_grammar(f"root ::= {rule}")
        if kind == "grammar":
            assert params.grammar is not None
            if looks_like_lark(params.grammar):
                raise UnsupportedConstraint("xgrammar takes EBNF/GBNF grammars (rule ::= "
                                            "...), not Lark")
            return self._compiler.compile_grammar(params.grammar)
        tag = structural_tag_of(params)
        if "format" in tag:
            return self._compiler.compile_structural_tag(json.dumps(tag))
        items = [xgrammar.StructuralTagItem(begin=item["begin"],
                                            schema=json.dumps(item["schema"]),
                                            end=item["end"])
                 for item in tag["structures"]]
        return self._compiler.compile_structural_tag(items, tag["triggers"])
