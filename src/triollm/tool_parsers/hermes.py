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
        before, regions, after = tagged_regions(text, START, END, final=final)
        calls: list[CallScan] = []
        malformed = False
        for body, _ in regions:
            start = skip_space(body, 0)
            if start == len(body):
                calls.append(CallScan())
                continue
            if body[start] != "{":
                malformed = True
                calls.append(CallScan())
                continue
            found = scan_call_object(body, start)
            malformed = malformed or found.invalid or (
                found.end is not None and body[found.end:].strip() != "")
            calls.append(found.call)
        if final and any(call.name is None or not call.complete for call in calls):
            malformed = True
        content = join_content(before, after, any_call=bool(calls), final=final,
                               tags=(START,))
        return Scan(content, calls, malformed)
