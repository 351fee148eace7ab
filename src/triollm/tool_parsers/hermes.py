"""``hermes``: Hermes 2 Pro/3, Qwen2.5 and Qwen3 write each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

from typing import Any

from triollm.tool_parsers.abstract import ToolParserManager
from triollm.tool_parsers.incremental import (
    CallScan,
    IncrementalToolParser,
    Scan,
    join_content,
    tagged_regions,
)
from triollm.tool_parsers.json_calls import scan_call_object, skip_space

__all__ = ["Hermes2ProToolParser"]

START, END = "<tool_call>", "</tool_call>"


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(IncrementalToolParser):
    """Calls in ``<tool_call>`` tags; the text outside them is content. A last call whose
    end tag never came still counts when its JSON is whole."""

    keep_special_tokens = True

    def scan(self, text: str, *, final: bool, request: Any) -> Scan:
        reads = self.memo.reads_of(text, request)
        before, regions, after = tagged_regions(text, START, END, final=final, reads=reads)
        calls: list[CallScan] = []
        malformed = False
        for index, (body, closed) in enumerate(regions):
            read = reads.get(index) if closed else None
            if read is None:
                read = _read_region(body)
                if closed:  # a closed region reads the same in any longer text
                    reads[index] = read
            calls.append(read[0])
            malformed = malformed or read[1]
        if final and any(call.name is None or not call.complete for call in calls):
            malformed = True
        content = join_content(before, after, any_call=bool(calls), final=final,
                               tags=(START,))
        return Scan(content, calls, malformed)


def _read_region(body: str) -> tuple[CallScan, bool]:
    """The call in one ``<tool_call>`` region, and whether it is malformed."""
    start = skip_space(body, 0)
    if start == len(body):
        return CallScan(), False
    if body[start] != "{":
        return CallScan(), True
    found = scan_call_object(body, start)
    return found.call, found.invalid or (found.end is not None
                                         and body[found.end:].strip() != "")
