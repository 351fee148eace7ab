"""Reading one JSON tool call, ``{"name": "f", "arguments": {...}}``, whole or in part.

While the object is unfinished, the name counts once its string is closed, and the
arguments stream as the model's own text of their value: every character after
``"arguments":`` up to the value's end belongs to it, so what is sent is always a prefix
of the final value, with no guessing how a partial value will close."""

from __future__ import annotations

import json
import re
from typing import Any

import partial_json_parser
from partial_json_parser.core.options import Allow

from triollm.tool_parsers.incremental import CallScan

__all__ = ["CallList", "ObjectScan", "arguments_json", "decode_json", "scan_call_list",
           "scan_call_object", "scan_call_object_once", "skip_space"]

_DECODER = json.JSONDecoder()
# Llama 3.2 may write "type": "function" first; otherwise the name leads.
_NAME_KEY = re.compile(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*')
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_WHITESPACE = re.compile(r"\s*")


class ObjectScan:
    """A call object read from ``text[start:]``: ``call`` as far as known, ``end`` the
    index just past the object once it is whole, ``invalid`` when it can never be a
    call (not an object, no string name)."""

    __slots__ = ("call", "end", "invalid")

    def __init__(self, call: CallScan, end: int | None = None, invalid: bool = False) -> None:
        self.call = call
        self.end = end
        self.invalid = invalid


def arguments_json(value: Any) -> str | None:
    """The arguments' JSON text from a parsed call's value: an object as it is, a string
    holding a JSON object decoded first (some models quote their arguments), nothing as
    ``{}``. None when it is no JSON object or array."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict | list):
        return None
    return json.dumps(value, ensure_ascii=False)


def skip_space(text: str, pos: int) -> int:
    """The index of the first non-whitespace character at or after ``pos``."""
    match = _WHITESPACE.match(text, pos)
    return match.end() if match else pos


def decode_json(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value that starts at ``text[pos]`` and the index after it; None when
    there is no whole value there."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def _raw_arguments_start(text: str, start: int) -> tuple[str | None, int | None]:
    """The name (when closed) and where the arguments' value starts (when it is an
    object or array written right after the name), for a call written name first."""
    key = _NAME_KEY.match(text, start)
    if key is None:
        return None, None
    decoded = decode_json(text, key.end()) if text.startswith('"', key.end()) else None
    if decoded is None or not isinstance(decoded[0], str):
        return None, None
    name, after_name = decoded
    arguments = _ARGUMENTS_KEY.match(text, after_name)
    if arguments is None or not text.startswith(("{", "["), arguments.end()):
        return name, None
    return name, arguments.end()


def _partial_name(text: str, start: int) -> str | None:
    try:
        partial = partial_json_parser.loads(text[start:], Allow.ALL & ~Allow.STR)
    except Exception:  # a half-written object may not parse yet
        return None
    name = partial.get("name") if isinstance(partial, dict) else None
    return name if isinstance(name, str) else None


def scan_call_object(text: str, start: int) -> ObjectScan:
    """Read the call object that starts at ``text[start]`` (a ``{``); ``text`` ends where
    the call's region ends (or where the stream is so far)."""
    name, arguments_start = _raw_arguments_start(text, start)
    raw = decode_json(text, arguments_start) if arguments_start is not None else None
    if arguments_start is not None and raw is None:
        return ObjectScan(CallScan(name, text[arguments_start:]))  # the object is not whole
    whole = decode_json(text, start)
    if whole is not None:
        value, end = whole
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return ObjectScan(CallScan(), end, invalid=True)
        if arguments_start is not None and raw is not None:
            return ObjectScan(CallScan(value["name"], text[arguments_start:raw[1]], True), end)
        arguments = arguments_json(value.get("arguments", value.get("parameters")))
        if arguments is None:
            return ObjectScan(CallScan(), end, invalid=True)
        return ObjectScan(CallScan(value["name"], arguments, True), end)
    if name is None:
        name = _partial_name(text, start) if '"name"' in text[start:] else None
        return ObjectScan(CallScan(name))
    if arguments_start is None or raw is None:
        return ObjectScan(CallScan(name))
    return ObjectScan(CallScan(name, text[arguments_start:raw[1]], True))


class CallList:
    """The calls of a JSON list read so far, where the text after the list starts (once
    it is closed), and whether it can no longer be a list of calls."""

    def __init__(self) -> None:
        self.calls: list[CallScan] = []
        self.tail: int | None = None
        self.malformed = False


def scan_call_object_once(text: str, start: int, reads: dict[Any, Any]) -> ObjectScan:
    """``scan_call_object``, kept in ``reads`` (``ScanMemo.reads_of``) once whole."""
    found: ObjectScan | None = reads.get(start)
    if found is None:
        found = scan_call_object(text, start)
        if found.end is not None:
            reads[start] = found
    return found


def scan_call_list(text: str, pos: int, final: bool,
                   reads: dict[Any, Any] | None = None) -> CallList:
    """Read the JSON list of call objects that starts at ``text[pos]`` (a ``[``). With
    ``reads`` (``ScanMemo.reads_of``) the whole calls of a shorter text are not read
    again."""
    key = ("call list", pos)
    found = CallList()
    kept = None if reads is None else reads.get(key)
    if kept is None:
        resume = skip_space(text, pos + 1)
    else:
        resume = skip_space(text, kept[0])
        found.calls.extend(kept[1])
    last = _read_calls(text, resume, final, reads, found)
    if reads is not None and last is not None and (kept is None or kept[0] != last[0]):
        reads[key] = (last[0], tuple(found.calls[:last[1]]))
    return found


def _read_calls(text: str, pos: int, final: bool, reads: dict[Any, Any] | None,
                found: CallList) -> tuple[int, int] | None:
    """``scan_call_list``'s reading from ``pos`` into ``found``; where the text after
    the last comma between whole calls starts, and how many calls precede it."""
    last = None
    while pos < len(text):
        if text[pos] == "]" and not found.calls:
            found.tail = pos + 1
            return last
        if text[pos] != "{":
            found.malformed = True
            return last
        call = (scan_call_object(text, pos) if reads is None
                else scan_call_object_once(text, pos, reads))
        found.calls.append(call.call)
        if call.invalid or call.end is None:
            found.malformed = call.invalid or final
            return last
        pos = skip_space(text, call.end)
        if text.startswith(",", pos):
            last = (pos + 1, len(found.calls))
            pos = skip_space(text, pos + 1)
        elif text.startswith("]", pos):
            found.tail = pos + 1
            return last
        elif pos < len(text):
            found.malformed = True
            return last
    if final and not found.calls:
        found.malformed = True
    return last
