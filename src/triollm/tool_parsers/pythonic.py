"""``pythonic``: Llama 3.2 and Llama 4 (pythonic templates), ToolACE, and other models
that answer a Python list of calls, ``[get_weather(city="Paris"), search(q="x")]``.
The calls are read with ``ast``; nothing is evaluated."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from triollm.tool_parsers.abstract import ToolParserManager
from triollm.tool_parsers.incremental import (
    CallScan,
    IncrementalToolParser,
    Scan,
    join_content,
    tag_overlap,
)
from triollm.tool_parsers.json_calls import skip_space

__all__ = ["PythonicToolParser", "literal_value"]

START, END = "<|python_start|>", "<|python_end|>"
_CALL_HEAD = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_MAYBE_HEAD = re.compile(r"\s*[A-Za-z_][\w.]*\s*$")
_NAMED_CONSTANTS = {"true": True, "false": False, "null": None, "True": True, "False": False,
                    "None": None}


def literal_value(node: ast.expr) -> Any:
    """The JSON value a literal expression writes (``true``/``null`` as JSON spells them
    too); ValueError for anything that is not a literal."""
    if isinstance(node, ast.Constant) and (
            node.value is None or isinstance(node.value, str | int | float | bool)):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = literal_value(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [literal_value(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise ValueError("** in a dict literal")
        return {str(literal_value(key)): literal_value(value)  # type: ignore[arg-type]
                for key, value in zip(node.keys, node.values, strict=True)}
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


def _call(source: str) -> CallScan | None:
    """One element of the list as a whole call, or None when it is none."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        if not _CALL_HEAD.fullmatch(name + "("):
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                return None
            arguments[keyword.arg] = literal_value(keyword.value)
        return CallScan(name, json.dumps(arguments, ensure_ascii=False, allow_nan=False), True)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class _ListReader:
    """Reads the list's elements: the spans of those it holds whole, where the
    unfinished one starts, and the index after ``]`` once the list closes. While
    streaming the text only grows, so each read goes on where the last one stopped."""

    def __init__(self, origin: int = -1) -> None:
        self.origin = origin
        self.seen = ""
        self.i = self.start = origin + 1
        self.depth = 0
        self.quote = ""
        self.spans: list[tuple[int, int]] = []
        self.closed_at: int | None = None
        self.calls: dict[tuple[int, int], CallScan | None] = {}

    def read(self, text: str, origin: int) -> _ListReader:
        reader = self if origin == self.origin and text.startswith(self.seen) else \
            _ListReader(origin)
        reader._advance(text)
        return reader

    def call(self, text: str, span: tuple[int, int]) -> CallScan | None:
        if span not in self.calls:
            self.calls[span] = _call(text[span[0]:span[1]])
        return self.calls[span]

    def _advance(self, text: str) -> None:
        i, depth, quote = self.i, self.depth, self.quote
        while i < len(text) and self.closed_at is None:
            char = text[i]
            if quote:
                if char == "\\":
                    i += 1
                elif char == quote:
                    quote = ""
            elif char in "\"'":
                quote = char
            elif char in "([{":
                depth += 1
            elif char in ")}" or (char == "]" and depth > 0):
                depth -= 1
            elif char == "]":
                if text[self.start:i].strip():
                    self.spans.append((self.start, i))
                self.start, self.closed_at = i, i + 1
            elif char == "," and depth == 0:
                self.spans.append((self.start, i))
                self.start = i + 1
            i += 1
        self.i, self.depth, self.quote = i, depth, quote
        self.seen = text[:min(i, len(text))]


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(IncrementalToolParser):
    """An output is tool calls when it starts (after whitespace, and Llama 4's
    ``<|python_start|>``) with a list whose elements are calls with keyword arguments
    of literal values; text after the list is content. Any other output is content. A
    call streams once whole: its name as soon as it is written, then all its
    arguments."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._reader = _ListReader()

    def scan(self, text: str, *, final: bool, request: Any) -> Scan:
        pos = skip_space(text, 0)
        if text.startswith(START, pos):
            pos = skip_space(text, pos + len(START))
        elif not final and tag_overlap(text[pos:], (START,)) == len(text) - pos:
            return Scan()
        if pos == len(text):
            return Scan(text if final else "")
        if text[pos] != "[":
            return Scan(text)
        self._reader = reader = self._reader.read(text, pos)
        open_at, closed_at = reader.start, reader.closed_at
        calls = [reader.call(text, span) for span in reader.spans]
        if any(call is None for call in calls):
            return Scan(text, [], malformed=True)  # a list, but not of calls
        found = [call for call in calls if call is not None]
        if closed_at is None:
            if final:
                return Scan(malformed=True)
            head = _CALL_HEAD.match(text, open_at)
            if head is not None:
                found.append(CallScan(head.group(1)))
            elif not found and not _MAYBE_HEAD.match(text, open_at) and text[open_at:].strip():
                return Scan(text)  # a list, but not of calls
            return Scan(calls=found)
        if not found:
            return Scan(text if final else "", malformed=final)
        tail = text[closed_at:]
        if tail.lstrip().startswith(END):
            tail = tail.lstrip()[len(END):]
        content = join_content([], tail, any_call=True, final=final, tags=(END,))
        return Scan(content, found)
