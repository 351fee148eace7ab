"""``llama3_json``: Llama 3.1, 3.2 and 3.3 with JSON tool calling answer
``{"name": "f", "parameters": {...}}``, maybe after ``<|python_tag|>``, several calls
separated by ``;``."""

from __future__ import annotations

from typing import Any

from triollm.tool_parsers.abstract import ToolParserManager
from triollm.tool_parsers.incremental import (
    CallScan,
    IncrementalToolParser,
    Scan,
    join_content,
    tag_overlap,
)
from triollm.tool_parsers.json_calls import scan_call_object_once, skip_space

__all__ = ["Llama3JsonToolParser"]

PYTHON_TAG = "<|python_tag|>"
#: The key of the calls already read in a ``ScanMemo``.
_CALLS = "calls"


@ToolParserManager.register_module(["llama3_json", "llama4_json"])
class Llama3JsonToolParser(IncrementalToolParser):
    """An output is tool calls when it starts (after whitespace and the optional
    ``<|python_tag|>``) with a JSON object; text after the last call is content. Any
    other output is all content."""

    def scan(self, text: str, *, final: bool, request: Any) -> Scan:
        pos = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_space(text, pos + len(PYTHON_TAG))
        elif not final and tag_overlap(text[pos:], (PYTHON_TAG,)) == len(text) - pos:
            return Scan()  # nothing yet, or the start of the tag
        if pos == len(text):
            return Scan(text if final else "")
        if text[pos] != "{":
            return Scan(join_content([], text, any_call=False, final=final, tags=()))
        calls: list[CallScan] = []
        reads = self.memo.reads_of(text, request)
        kept = reads.get(_CALLS)  # where the last ";" ends and the calls before it
        if kept is not None and kept[0] > pos:
            calls.extend(kept[1])
            pos = skip_space(text, kept[0])
        last: tuple[int, int] | None = None  # where the last new ";" ends, calls before it
        try:
            while True:
                found = scan_call_object_once(text, pos, reads)
                calls.append(found.call)
                if found.invalid:
                    return Scan(calls=calls, malformed=True)
                if found.end is None:
                    return Scan(calls=calls, malformed=final)
                after = skip_space(text, found.end)
                if text.startswith(";", after):
                    separator_end = after + 1
                    after = skip_space(text, separator_end)
                    if after < len(text) and text[after] == "{":
                        last = (separator_end, len(calls))
                        pos = after
                        continue
                    if after == len(text):
                        return Scan(calls=calls)
                tail = text[found.end:]
                return Scan(join_content([], tail, any_call=True, final=final, tags=()),
                            calls)
        finally:
            if last is not None:
                reads[_CALLS] = (last[0], tuple(calls[:last[1]]))
