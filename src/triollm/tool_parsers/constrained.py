"""Parsers for outputs that a grammar from the tools constrained (``tool_choice``
``"required"`` or a named function): they stream the same incremental ``tool_calls``
as the model-format parsers."""

from __future__ import annotations

from typing import Any

from triollm.tool_parsers.incremental import CallScan, IncrementalToolParser, Scan
from triollm.tool_parsers.json_calls import decode_json, scan_call_list, skip_space

__all__ = ["NamedToolCallParser", "RequiredToolCallParser"]


class RequiredToolCallParser(IncrementalToolParser):
    """``tool_choice: "required"``: the output is a JSON list of
    ``{"name": ..., "parameters": {...}}`` (the schema of ``tool_choice_schema``)."""

    def scan(self, text: str, *, final: bool, request: Any) -> Scan:
        pos = skip_space(text, 0)
        if pos == len(text):
            return Scan(malformed=final)
        if text[pos] != "[":
            return Scan(malformed=True)
        found = scan_call_list(text, pos, final, self.memo.reads_of(text, request))
        return Scan("", found.calls, found.malformed or (final and found.tail is None))


class NamedToolCallParser(IncrementalToolParser):
    """A named ``tool_choice``: the whole output is the arguments of ``name``; they
    stream as the model writes them."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        super().__init__(tokenizer)
        self.name = name

    def scan(self, text: str, *, final: bool, request: Any) -> Scan:
        start = skip_space(text, 0)
        decoded = decode_json(text, start)
        if decoded is not None:
            end = decoded[1]
            if not isinstance(decoded[0], dict) or text[end:].strip():
                return Scan(calls=[CallScan(self.name, text[start:end], True)], malformed=True)
            return Scan(calls=[CallScan(self.name, text[start:end], True)])
        return Scan(calls=[CallScan(self.name, text[start:])], malformed=final)
