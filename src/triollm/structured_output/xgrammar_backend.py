"""The xgrammar backend (vLLM's default): JSON schema, regex, choice, EBNF/GBNF
grammars (not Lark: those go to guidance) and structural tags. JSON objects are strict
(no properties a schema does not list), as xgrammar compiles them in vLLM."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from typing import Any

import torch
import xgrammar

from triollm.structured_output.backend import (
    GrammarOptions,
    UnsupportedConstraint,
    close_objects,
    looks_like_lark,
    schema_of,
    structural_tag_of,
)
from triollm.structured_output.bitmask import bitmask_words
from triollm.structured_output.params import StructuredOutputsParams

__all__ = ["XgrammarBackend", "XgrammarGrammar", "XgrammarMatcher"]


class XgrammarMatcher:
    """One sample's ``xgrammar.GrammarMatcher``. Once it has accepted an end-of-sequence
    token it allows only those (xgrammar itself refuses to compute a mask then; a
    sample held by ``min_tokens`` may still be sampled)."""

    __slots__ = ("_eos_row", "_matcher")

    def __init__(self, matcher: xgrammar.GrammarMatcher, eos_row: torch.Tensor) -> None:
        self._matcher = matcher
        self._eos_row = eos_row

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.is_terminated():
            return bool(int(self._eos_row[token_id // 32]) >> (token_id % 32) & 1)
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def validate_tokens(self, token_ids: list[int]) -> int:
        accepted = 0
        for token_id in token_ids:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return accepted

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        if self._matcher.is_terminated():
            bitmask[row].copy_(self._eos_row)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XgrammarGrammar:
    """An ``xgrammar.CompiledGrammar``."""

    backend = "xgrammar"

    def __init__(self, compiled: xgrammar.CompiledGrammar, eos_row: torch.Tensor, kind: str,
                 compile_seconds: float) -> None:
        self._compiled = compiled
        self._eos_row = eos_row
        self.kind = kind
        self.compile_seconds = compile_seconds

    def matcher(self) -> XgrammarMatcher:
        return XgrammarMatcher(xgrammar.GrammarMatcher(self._compiled), self._eos_row)


#: xgrammar's errors start with a timestamp and its C++ source position.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


#: How deeply a schema's regex (``pattern``) may nest its groups: xgrammar turns one
#: into a grammar recursively, and a deeper one overflows its stack (the process dies).
MAX_PATTERN_NESTING = 256


def _group_depth(regex: str) -> int:
    depth = deepest = 0
    escaped = False
    for char in regex:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(depth - 1, 0)
    return deepest


def _check_patterns(value: Any) -> None:
    """``ValueError`` when a regex in ``value`` (a schema or a structural tag: each
    ``pattern``, each key of ``patternProperties``) nests its groups too deeply."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            regexes = [item["pattern"]] if isinstance(item.get("pattern"), str) else []
            if isinstance(item.get("patternProperties"), dict):
                regexes.extend(item["patternProperties"])
            for regex in regexes:
                if _group_depth(regex) > MAX_PATTERN_NESTING:
                    raise ValueError(f"a pattern nests groups more than "
                                     f"{MAX_PATTERN_NESTING} deep")
            stack.extend(item.values())


def _ebnf_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class XgrammarBackend:
    """xgrammar over the engine's tokenizer (logits width ``vocab_size``; the engine's
    ``eos_token_ids`` end a complete grammar)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        eos_token_ids = sorted(eos_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids or None)
        words = torch.zeros(bitmask_words(vocab_size), dtype=torch.int64)
        for token in eos_token_ids:
            words[token // 32] |= 1 << (token % 32)
        #: The mask that allows only the end-of-sequence tokens.
        self._eos_row = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
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
        return XgrammarGrammar(compiled, self._eos_row, params.kind,
                               time.perf_counter() - started)

    def _compile(self, params: StructuredOutputsParams, options: GrammarOptions
                 ) -> xgrammar.CompiledGrammar:
        any_whitespace = not options.disable_any_whitespace
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = schema_of(params)
            if options.disable_additional_properties:
                close_objects(schema)
            _check_patterns(schema)
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
        _check_patterns(tag)
        if "format" in tag:
            return self._compiler.compile_structural_tag(json.dumps(tag))
        items = [xgrammar.StructuralTagItem(begin=item["begin"],
                                            schema=json.dumps(item["schema"]),
                                            end=item["end"])
                 for item in tag["structures"]]
        return self._compiler.compile_structural_tag(items, tag["triggers"])
